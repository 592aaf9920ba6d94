"""The learner process: one rank of the FSDP2 group. Rank 0 also owns the buffer sampler,
the prompt feeder, the weight publisher, evaluation and metrics.

Step k trains weights of version k on groups with staleness k - version_start <= s, then
publishes version k+1. Every rank runs the same number of micro-batches (equal shares).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import time
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from buffer.replay import ReplaySource, record
from buffer.sampler import RedisSampler
from buffer.schema import Limits, decode
from buffer.store import ABANDONED_STALE
from data.dataset import prompt_sources
from engines.evaluate import evaluate_prompts
from engines.hf_engine import HFEngine  # transformers itself is imported when an engine is built
from learner import loggers
from learner import metric_names as M
from learner.advantages import kl_penalty
from learner.batching import collate, groups_to_rows, layout, split_rows, to_device
from learner.losses import normalize, policy_loss_terms
from learner.metrics import MetricsWriter, step_metrics
from learner.model import (clip_grad_norm, full_state_dict, gather_full, load_policy, optimizer_step,
                           response_logprobs, shadow_of, wrap_policy)
from learner.ppo import PPOExtras, needs_extras, plan_micro_batches
from learner.profiling import StepProfiler
from rewards.scorers import record_scorer
from runbase import checkpoints
from runbase.keys import Keys, connect, mark_startup
from runbase.net import local_host
from runbase.stalls import arm_stall_dump, cancel_stall_dump
from weightsync.backends import publisher, resolve
from weightsync.core import flatten
from weightsync.flat import checksum, layout_from_meta, plan_buckets, wire_dtype
from weightsync.join import JoinServer, LastVersion
from weightsync.store import client_store, master_store

log = logging.getLogger(__name__)

# Non-zero ranks wait in a collective while rank 0 waits for trajectories; a slow actor
# fleet is not a failure, so the learner group's timeout is generous.
LEARNER_GROUP_TIMEOUT = timedelta(minutes=30)
PUBLISH_ATTEMPTS = 3        # a version is retried this often (each without newly silent members)
MEMBER_STALE_WAIT_S = 3.5   # > weightsync.gloo.MEMBER_STALE_S: a dead member is then visibly stale
MAX_SKIPS_IN_A_ROW = 5     # steps with a non-finite update skipped one after another before the learner
                            # fails: one bad batch is skipped; this many means the policy itself diverged
EVALUATOR_WAIT_S = 900.0    # an evaluation the learner waits for (the first and the last): covers the
                            # evaluator's vLLM start-up (compilation, CUDA graphs) beside the actors'
EVALUATOR_POLL_S = 0.05    # the learner's look at the evaluator's answers while it waits for one (~0.5 s each)


def pick_backend(cfg, learner_device: torch.device) -> str:
    """weightsync.backend as the launcher resolved it; `auto` (a learner built outside the launcher)
    by the same rule, weightsync/backends.py, from where this learner sits."""

    return resolve(cfg.weightsync.backend, learner_on_cuda=learner_device.type == "cuda",
                   actors_on_cuda=cfg.actors.device.startswith("cuda"), n_gpus=torch.cuda.device_count(),
                   learners=cfg.cluster.learners)


def learner_device(lc, rank: int) -> torch.device:
    """Where rank `rank` computes: GPU rank mod the visible GPUs when `learner.device` is cuda (or auto
    with a GPU present), else the CPU. Sets the current CUDA device as a side effect."""
    if lc.on_cuda(torch.cuda.is_available()):
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device(f"cuda:{torch.cuda.current_device()}")
    return torch.device("cpu")


def init_learner_group(device: torch.device, host: str, port: int, rank: int, world: int):
    """The learner group (NCCL on GPUs, gloo on CPUs) and the gloo group its step statistics and
    control messages ride on (None on CPU: the default group is gloo already). Its rendezvous store is
    served by rank 0 on `host`:`port` only (port 0: any free one, for a one-rank group)."""

    store = (master_store if rank == 0 else client_store)(host, port, LEARNER_GROUP_TIMEOUT)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world, timeout=LEARNER_GROUP_TIMEOUT)
    return dist.new_group(backend="gloo") if device.type == "cuda" else None


def build_policy(lc, model_path: str, device: torch.device, model=None):
    """The wrapped policy and its AdamW, as every learner (and the one-process sync baseline) trains them;
    `model`: an already built module instead of the one at `model_path` (benchmarks)."""

    world = dist.get_world_size() if dist.is_initialized() else 1
    model = wrap_policy(model if model is not None else load_policy(model_path, device, lc.attn_implementation),
                        lc, device, world)
    # one fused kernel per step on a GPU (bench/learner.py measured with it); the foreach path elsewhere
    opt = torch.optim.AdamW(model.parameters(), lr=lc.lr, betas=tuple(lc.betas), weight_decay=lc.weight_decay,
                            fused=device.type == "cuda" and not lc.param_offload)
    return model, opt


def checkpoint_error(path: str, e: BaseException) -> RuntimeError:
    """A checkpoint that could not be written, named, with the free space where it goes (a full disk)."""
    import shutil

    try:
        free = f"{shutil.disk_usage(os.path.dirname(path)).free / 2**20:.1f} MiB free there"
    except OSError:
        free = "free space unknown"
    cause = str(e).strip().splitlines()
    return RuntimeError(f"checkpoint {path} could not be written ({free}; trainer.checkpoint_every): "
                        f"{type(e).__name__}: {cause[-1] if cause else ''}".rstrip(": "))


class LearnerProcess:
    def __init__(self, cfg, *, rank: int, world: int, master_addr: str, master_port: int, run_id: str,
                 redis_url: str, run_dir: str, model_path: str):
        self.cfg, self.rank, self.world, self.run_dir = cfg, rank, world, run_dir
        self.eval_version = None  # the version rank 0's eval engine holds (known alike on every rank)
        self.eval_engine = None   # rank 0's HF engine for evaluation and export (trainer.val_engine=learner)
        lc = cfg.learner
        self.device = learner_device(lc, rank)
        torch.set_num_threads(lc.torch_threads)
        torch.manual_seed(lc.seed)
        self.cpu_group = init_learner_group(self.device, master_addr, master_port, rank, world)
        self.model, self.opt = build_policy(lc, model_path, self.device)

        # critic (gae) and frozen reference (KL): built before rank 0's own setup, same order on every rank
        self.ppo = PPOExtras(cfg, model_path, self.device, group=self.cpu_group) if needs_extras(cfg) else None
        self.pad_id = self.model.config.pad_token_id or 0
        self.limits = Limits(vocab_size=self.model.config.vocab_size)
        self.ws_device = "cpu"
        if rank == 0:
            self._init_rank0(run_id, redis_url, model_path)
            self.ws_device = self.device if self.ws_backend in ("cuda_ipc", "nccl") else "cpu"

            # the last version gathered, sent at once to members that join (restarted, new, scaled up)
            self.last_version = LastVersion()
            self.joins = JoinServer(self.publisher, self.r, self.keys, self.last_version, device=self.ws_device)
        self.start_step = self._resume() if cfg.cluster.resume else 0
        self.unacked: list = []  # entry ids trained since the last checkpoint (acked when it completes)
        self.profiler = StepProfiler(cfg.trainer.profile_steps, f"{run_dir}/profiles", rank=rank,
                                     cuda=self.device.type == "cuda")

    def _init_rank0(self, run_id, redis_url, model_path):
        cfg = self.cfg
        self.keys = Keys(run_id)
        self.r = connect(redis_url)
        self.r.setnx(self.keys.version, 0)
        self.r.hset(self.keys.learner, mapping={"pid": os.getpid(), "host": socket.gethostname()})
        if cfg.buffer.replay_dir:
            self.sampler = ReplaySource(cfg.buffer.replay_dir, self.limits,
                                        groups_per_step=cfg.learner.groups_per_step, steps=cfg.trainer.total_steps)
        else:
            self.sampler = RedisSampler(self.r, self.keys, groups_per_step=cfg.learner.groups_per_step,
                                        max_staleness=cfg.buffer.max_staleness, limits=self.limits,
                                        should_stop=self._waiting,
                                        consumer=f"rank0-{os.getpid()}", deadletter_maxlen=cfg.buffer.deadletter_maxlen)
        self.ws_backend = pick_backend(cfg, self.device)
        # the weight-sync store's announced address (runbase/net.py)
        self.publisher = publisher(self.ws_backend, self.r, self.keys, timeout_s=cfg.weightsync.timeout_s,
                                   device=self.device, host=local_host(cfg.cluster.bind_host))
        # trainer.val_engine=learner: evaluation on rank 0's own HF engine; vllm: by the evaluator process
        self.eval_engine = HFEngine(model_path, device=str(self.device)) if cfg.trainer.val_engine == "learner" \
            else None
        if self.eval_engine is not None:
            self.tokenizer = self.eval_engine.tokenizer
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model_path = model_path
        self.val_pending: set[int] = set()      # versions asked of the evaluator, not answered yet
        self.val_reward: dict[int, float] = {}  # version -> held-out reward (evaluator results)
        self.val_arrived: dict[int, dict] = {}  # evaluator results not yet on a metrics line
        # the built-in task, or verl parquet rows rendered with the model's chat template and tokenized
        self.prompts, self.val = prompt_sources(cfg, self.tokenizer, start=int(self.r.get(self.keys.prompt_cursor) or 0))
        self.score = record_scorer(cfg.data.reward_options())
        self.val_accuracy: dict[int, float] = {}  # version -> share of held-out samples fully right
        self.metrics = MetricsWriter(self.run_dir, loggers=loggers.for_run(cfg, self.run_dir, run_id), redis=self.r,
                                     key=self.keys.metrics)  # trainer.logger's sinks
        self._feed_prompts()

    def run(self) -> dict:
        tc = self.cfg.trainer
        if self.rank == 0:
            self.joins.start()
        if self.start_step:  # resumed: actors start from the base model, give them our version first
            if self.rank == 0:
                self.r.set(self.keys.version, self.start_step)
            self._publish(self.start_step)
        self._mark("ready")   # model, optimizer and process group built
        self._phase("evaluate", self.start_step)
        val_initial = val = self._evaluate(self.start_step)
        self._mark("initial_eval")
        last = self._val_clock = time.monotonic()  # trainer.val_every_s counts from the first trained step
        step, skips = self.start_step, 0  # skips: steps skipped in a row (the step number is tried again)
        while step < tc.total_steps:
            self.profiler.step(step)
            # waiting for groups is the actors' time (the launcher watches them); reading recorded ones is ours
            self._phase("read" if self.cfg.buffer.replay_dir else "wait", step)
            t_read = time.monotonic()
            batch = self._read_batch(step)
            read_s = time.monotonic() - t_read
            export = self._export_requested()
            t_train = time.monotonic()
            self._phase("train", step)
            rows, share, export, timed_eval = self._scatter(batch, step, export)
            stats = self._train_step(share, rows)
            if stats.get(M.SKIPPED):
                skips = self._skip_step(step, batch, stats, skips)
                continue
            skips = 0
            stats[M.TRAIN_S] = time.monotonic() - t_train  # scatter + forward/backward + optimizer
            stats[M.READ_S] = read_s
            version = step + 1
            val = self._publish_and_evaluate(version, stats, timed_eval)
            if self.rank == 0:
                self.r.set(self.keys.version, version)
                self._feed_prompts()
                now = time.monotonic()
                extra = self._val_extras(step, version, val, val_initial)
                self._log_step(step, version, rows, batch, stats, now - last, extra)
                last = now
            # after the step's line: a step a checkpoint counts always has its metrics line
            self._phase("checkpoint", version)
            self._ack_or_checkpoint(batch, version, last=version == tc.total_steps)
            if export:
                self._phase("export", version)
                self._export(f"{self.run_dir}/policy-step-{version:08d}", version)
            step += 1
        return self._close_run(val_initial, val)

    def _read_batch(self, step: int):
        """Rank 0: the next batch from the buffer (recorded with trainer.record_batches; a retried step's
        batch replaces a skipped one's); None on the other ranks (they get their share by scatter)."""
        if self.rank != 0:
            return None
        batch = self.sampler.next_batch(step)
        if step == self.start_step:
            self._mark("first_batch")
        if self.cfg.trainer.record_batches:
            record(f"{self.run_dir}/batches", step, batch.payloads)
        return batch

    def _publish_and_evaluate(self, version: int, stats: dict, timed: bool = False):
        """Publish `version` every weightsync.sync_every steps and evaluate it every trainer.val_every
        (both at the last step, waited for) or when rank 0's clock says so (`timed`: trainer.val_every_s);
        the learner's time in each goes into `stats`."""
        tc = self.cfg.trainer
        last = version == tc.total_steps
        t0 = time.monotonic()
        if version % self.cfg.weightsync.sync_every == 0 or last:
            self._phase("publish", version)
            self._publish(version, wait=last)
        stats[M.PUBLISH_S] = time.monotonic() - t0  # gather + send + every actor's ack (0: not this step)
        t0 = time.monotonic()
        due = tc.evaluates_at(version) or timed
        if due:
            self._val_clock = t0
            self._phase("evaluate", version)
        val = self._evaluate(version, wait=last) if due else None
        stats[M.EVAL_S] = time.monotonic() - t0  # the learner's wait (an evaluator's own time: M.VAL_EVAL_S)
        return val

    def _close_run(self, val_initial, val) -> dict:
        """After the last step: the last publication's end, the join server stopped, the export; the summary."""
        tc = self.cfg.trainer
        self._phase("close", tc.total_steps)
        self.profiler.close()
        self._join_publication()
        if self.rank == 0:
            self.joins.close()
        if tc.export_hf and tc.val_engine == "vllm":  # collective: the final weights for the export below
            self._load_eval_engine(tc.total_steps)
        summary = {"val_reward_start": val_initial, "val_reward_end": val, "steps": tc.total_steps,
                   "start_step": self.start_step}
        if self.rank == 0:
            summary["val_accuracy_start"] = self.val_accuracy.get(self.start_step)
            summary["val_accuracy_end"] = self.val_accuracy.get(tc.total_steps)
            self.metrics.close()
            if tc.export_hf:  # the final evaluation loaded the final weights into the eval engine
                summary["policy"] = self._save_policy(f"{self.run_dir}/policy")
        return summary

    def _export_requested(self) -> bool:
        """Rank 0, as a step starts: whether an export was asked for (cluster.export; done after the step)."""
        return self.rank == 0 and bool(self.r.exists(self.keys.export))

    def _skip_step(self, step: int, batch, stats: dict, skips: int) -> int:
        """A step whose loss or gradient norm was not finite, skipped on every rank (train_step: nothing
        applied, no version published). Rank 0 dead-letters its groups with the reason (acked, admission
        slots freed) and writes a metrics line with `train/skipped: 1` and no groups; the step number is tried
        again on the next batch. Returns the steps skipped in a row; too many fail the learner."""
        why = stats[M.SKIP_REASON]
        if skips + 1 >= MAX_SKIPS_IN_A_ROW:
            raise RuntimeError(f"{skips + 1} steps in a row had a {why} (step {step}): not one bad batch but a "
                               "diverging policy; lower learner.lr or raise the precision (learner.param_dtype)")
        if self.rank == 0:
            n = self.sampler.skip(batch, f"skipped_{why.replace(' ', '_')}", step)
            self._feed_prompts()  # the freed admission slots need prompts: the retried step's groups
            log.warning("step %d skipped: %s; its %d groups dead-lettered, the step is tried again", step, why, n)
            self.metrics.write({M.STEP: step, M.VERSION: step, M.SKIPPED: 1, M.SKIP_REASON: why,
                                M.DEAD_LETTERED: n, M.TIME: time.time()})
        return skips + 1

    def _load_eval_engine(self, version: int) -> bool:
        """Collective: the learner's current weights into rank 0's eval engine (once per version: an
        export right after an evaluation reuses them); True on rank 0."""

        if self.eval_version != version:
            sd = full_state_dict(self.model)
            if self.rank == 0 and self.eval_engine is not None:
                self.eval_engine.load_weights(sd, version, checksum(sd))
            elif self.rank == 0:  # evaluation runs elsewhere: keep the weights for an export
                self.policy_sd = sd
            self.eval_version = version
        return self.rank == 0

    def _export(self, out: str, version: int) -> None:
        """On demand (`python -m cluster.export`): the current policy as a Hugging Face folder."""
        if self._load_eval_engine(version):
            self._save_policy(out)
            pipe = self.r.pipeline()
            pipe.rpush(self.keys.exported, out)
            pipe.delete(self.keys.export)
            pipe.execute()

    def _save_policy(self, out: str) -> str:
        if self.eval_engine is not None:
            self.eval_engine.model.save_pretrained(out)
        else:  # no HF engine here: the base model's folder with the exported weights loaded into it
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
            model.load_state_dict(self.policy_sd)
            model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        log.info("policy exported to %s", out)
        return out

    def _ack_or_checkpoint(self, batch, version: int, last: bool) -> None:
        """Without checkpoints: ack after the optimizer step. With them: ack a step's groups only
        once a complete checkpoint covers it, so a crash never loses a step a resume cannot redo
        (the last step is always checkpointed, so nothing stays pending at the end)."""
        every = self.cfg.trainer.checkpoint_every
        if not every:
            if self.rank == 0:
                self.sampler.ack(batch)
            return
        if self.rank == 0:
            self.unacked += batch.entry_ids
        if version % every == 0 or last:
            self._save_checkpoint(version)
            if self.rank == 0:
                self.sampler.ack_ids(self.unacked)
                self.unacked = []
                # the groups of steps up to here are gone from Redis: a resume must start from this checkpoint
                self.r.set(self.keys.checkpointed, version)

    def _save_checkpoint(self, step: int) -> None:
        """Collective: DCP shards of model + optimizer, each rank's RNG, then a COMPLETE marker."""
        path = str(checkpoints.folder(self.run_dir, step))
        self._write_shards(path)
        dist.barrier(group=self.cpu_group)
        if self.rank == 0:
            try:
                checkpoints.write_marker(path, {"step": step, "time": time.time(),
                                                **(self.ppo.scalar_state() if self.ppo else {})})
            except OSError as e:
                raise checkpoint_error(path, e) from e
            log.info("checkpoint of step %d complete: %s", step, path)
            for gone in checkpoints.prune(self.run_dir, self.cfg.trainer.keep_checkpoints):
                log.info("checkpoint %s removed (trainer.keep_checkpoints=%d)", gone, self.cfg.trainer.keep_checkpoints)

    def _write_shards(self, path: str) -> None:
        """Collective: this rank's DCP shards of model + optimizer (and critic), and its RNG state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        try:
            dcp.save({"model": msd, "optim": osd, **self._critic_state()}, checkpoint_id=path)
            torch.save(torch.get_rng_state(), f"{path}/rng-rank{self.rank}.pt")
        except (Exception, dcp.api.CheckpointException) as e:  # (a BaseException) a full disk reads as
            raise checkpoint_error(path, e) from e              # "unexpected pos 704 vs 598" from torch's writer

    def _resume(self) -> int:
        """Load the newest checkpoint with a COMPLETE marker; returns its step (0 if none)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        done = checkpoints.complete(self.run_dir)   # an empty or cut marker is passed over, with a warning
        if not done:
            log.warning("resume: no complete checkpoint in %s/checkpoints; starting at step 0", self.run_dir)
            return 0
        path = str(done[-1][1])
        msd, osd = get_state_dict(self.model, self.opt)
        state = {"model": msd, "optim": osd, **self._critic_state()}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if "critic" in state:
            set_state_dict(self.ppo.critic, self.ppo.critic_opt, model_state_dict=state["critic"],
                           optim_state_dict=state["critic_optim"])
        rng = f"{path}/rng-rank{self.rank}.pt"
        if os.path.exists(rng):
            torch.set_rng_state(torch.load(rng))
        marker = checkpoints.read_marker(path)
        step = marker["step"]
        if self.ppo:
            self.ppo.load_scalar_state(marker)
        log.info("resumed from %s (step %d)", path, step)
        return step

    def _critic_state(self) -> dict:
        """The critic's DCP state (model and optimizer shards), saved and loaded beside the policy's;
        the reference is the frozen base model and needs none."""
        if self.ppo is None or self.ppo.critic is None:
            return {}
        from torch.distributed.checkpoint.state_dict import get_state_dict

        cmsd, cosd = get_state_dict(self.ppo.critic, self.ppo.critic_opt)
        return {"critic": cmsd, "critic_optim": cosd}

    def _scatter(self, batch, version: int, export: bool):
        """Rank 0's groups to every rank (as validated msgpack bytes, never pickle); each rank
        rebuilds the same rows deterministically and keeps its equal share. The header also carries
        rank 0's decisions to export and to evaluate by the clock (trainer.val_every_s) after this step, so
        every rank joins their collectives."""
        if self.rank == 0:
            blob = msgpack.packb(batch.payloads)
            every = self.cfg.trainer.val_every_s
            timed = bool(every) and time.monotonic() - self._val_clock >= every
            head = torch.tensor([len(blob), int(export), int(timed)], dtype=torch.int64)
        else:
            head = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(head, 0, group=self.cpu_group)
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(head[0]), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.cpu_group)
        groups = [decode(p, self.limits, trusted=True) for p in msgpack.unpackb(buf.numpy().tobytes())]
        rows = groups_to_rows(groups, version, scale_std=self.cfg.learner.scale_adv_by_std)
        return rows, split_rows(rows, self.world)[self.rank], bool(head[1]), bool(head[2])

    def _train_step(self, share, rows) -> dict:
        return train_step(self.model, self.opt, share, rows, self.cfg.learner, temperature=self.cfg.actors.temperature,
                          world=self.world, pad_id=self.pad_id, device=self.device, group=self.cpu_group,
                          extras=self.ppo)

    def _publish(self, version: int, *, wait: bool = True) -> None:
        """Collective over the learner group: gather full tensors one bucket at a time (rank 0
        broadcasts bucket i while every rank gathers bucket i+1) and retry without dead members.
        With `weightsync.overlap` on one rank and not `wait`, the acks are awaited on a thread
        while the next step runs (`_join_publication`)."""

        self._join_publication()
        sd = self.model.state_dict()  # sharded DTensors (or plain tensors on one rank): global shapes
        wire = self.cfg.weightsync.dtype  # the engines' dtype: cast after the gather, one bucket at a time
        lay = layout_from_meta((n, wire_dtype(t.dtype, wire), tuple(t.shape)) for n, t in sd.items())
        buckets = plan_buckets(lay, int(self.cfg.weightsync.bucket_mb * 2**20))
        overlap = not wait and self.world == 1 and self.cfg.weightsync.overlap
        locked = self.rank == 0 and self.joins.lock.acquire()  # the join server keeps off until the end
        try:
            for attempt in range(PUBLISH_ATTEMPTS):
                self._send_version(version, sd, lay, buckets, copy=overlap)
                if overlap:
                    import threading

                    self._finishing = threading.Thread(target=self._finish, args=(version, True), daemon=True)
                    self._finishing.start()
                    locked = False  # released by the thread, once the version's acks are in
                    return
                ok = torch.tensor([1 if self.rank != 0 or self._finish(version) else 0])
                dist.broadcast(ok, 0, group=self.cpu_group)
                if ok.item():
                    return
                if self.rank == 0:  # let a dead member's heartbeat go stale so the next epoch leaves it out
                    time.sleep(MEMBER_STALE_WAIT_S)
            log.error("version %d reached no actor after %d attempts; the join server sends it to live members "
                      "that lack it", version, PUBLISH_ATTEMPTS)
        finally:
            if locked:
                self.joins.lock.release()

    def _send_version(self, version: int, sd, lay, buckets, *, copy: bool) -> None:
        """One attempt's buckets: every rank gathers each (collective), rank 0 sends it and keeps it
        in `last_version` (what the join server sends to members that join later)."""

        if self.rank == 0:
            self.publisher.begin(version, lay, buckets)
            self.last_version.begin(version, lay, buckets)
        for b in buckets:
            wire = self.cfg.weightsync.dtype
            full = gather_full([sd[n] for n in b["names"]], self.ws_device)
            named = [(n, t.to(wire_dtype(t.dtype, wire))) for n, t in zip(b["names"], full)]
            if self.rank == 0:
                flat = flatten(named, copy=copy)
                self.publisher.send(flat, named)
                self.last_version.put(b, flat)
        if self.rank == 0:
            self.last_version.complete()

    def _finish(self, version: int, release: bool = False) -> bool:
        """Rank 0: the end of a publication (every member's acks, the checksum round); True if it arrived.
        `release`: an overlapped publication's thread hands the publisher back to the join server."""
        try:
            if self.publisher.finish() is None:
                return False
            log.info("published version %d: %s", version, self.publisher.stats)
            return True
        finally:
            if release:
                self.joins.lock.release()

    def _join_publication(self) -> None:
        """Wait for an overlapped publication's end (before the next one, and before the run ends)."""
        if (t := getattr(self, "_finishing", None)) is not None:
            t.join()
            self._finishing = None

    def _val_extras(self, step: int, version: int, val, val_initial) -> dict:
        """The evaluation fields of a step's metrics line: this step's own, or (val_engine=vllm) the
        newest result the evaluator sent since the last line, with the version it is of."""
        extra = {M.VAL_REWARD_INITIAL: val_initial} if step == self.start_step else {}
        if val is not None:
            extra[M.VAL_REWARD] = val
            extra[M.VAL_ACCURACY] = self.val_accuracy[version]
        elif self.cfg.trainer.val_engine == "vllm":
            self._collect_val()
            if self.val_arrived:  # the newest answer since the last line (all are in <run>:val)
                v = max(self.val_arrived)
                res, self.val_arrived = self.val_arrived[v], {}
                extra.update({M.VAL_REWARD: res["reward"], M.VAL_ACCURACY: res["accuracy"], M.VAL_VERSION: v,
                              M.VAL_EVAL_S: res["eval_s"], M.VAL_LEN_MEAN: res.get("len_mean"),
                              M.VAL_LEN_MAX: res.get("len_max")})
        if step == self.start_step:
            extra[M.VAL_ACCURACY_INITIAL] = self.val_accuracy[self.start_step]
        return extra

    def _evaluate_elsewhere(self, version: int, wait: bool):
        """trainer.val_engine=vllm: ask the evaluator for `version`; with `wait`, its held-out reward (rank 0)."""
        if self.rank != 0:
            return None
        self.r.sadd(self.keys.val_requests, version)
        self.val_pending.add(version)
        deadline = time.monotonic() + EVALUATOR_WAIT_S
        while wait and version in self.val_pending:  # (other answers arriving meanwhile stay in val_arrived)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the evaluator did not evaluate version {version} in {EVALUATOR_WAIT_S:.0f} s "
                                   f"(its log: {self.run_dir}/logs/evaluator.log)")
            if not self._collect_val():
                time.sleep(EVALUATOR_POLL_S)
        if not wait:
            return None
        self.val_arrived.pop(version, None)  # returned here, so logged as this step's own evaluation
        return self.val_reward.get(version)

    def _collect_val(self) -> dict:
        """Rank 0: the evaluator's answers to pending requests, recorded as the learner's own would be."""
        arrived = {}
        for v in sorted(self.val_pending):
            if (raw := self.r.hget(self.keys.val_results, v)) is None:
                continue
            self.val_pending.discard(v)
            res = json.loads(raw)
            if "skipped" in res:
                log.warning("held-out evaluation of version %d skipped: %s", v, res["skipped"])
                continue
            self.val_reward[v], self.val_accuracy[v] = res["reward"], res["accuracy"]
            self.r.hset(self.keys.val, v, res["reward"])
            self.r.hsetnx(self.keys.checksums, v, res["checksum"])  # as the learner's own evaluation, below
            arrived[v] = res
        self.val_arrived.update(arrived)
        return arrived

    def _evaluate(self, version: int, *, wait: bool = True):
        """Held-out reward of the learner's current weights (collective; the value on rank 0). With an
        evaluator (val_engine=vllm) it is asked for, and waited for only with `wait`."""

        if self.cfg.trainer.val_engine == "vllm":
            return self._evaluate_elsewhere(version, wait)
        if not self._load_eval_engine(version):
            return None
        tc, a = self.cfg.trainer, self.cfg.actors
        res = evaluate_prompts(self.eval_engine, self.val, self.score, samples=tc.val_samples,
                               temperature=a.temperature, max_tokens=a.max_tokens, seed=tc.val_seed, stop=a.stop)
        if self.device.type == "cuda":  # the generation's KV cache back to the driver: engines beside us need it
            torch.cuda.empty_cache()
        val = res["reward"]
        self.val_accuracy[version] = res["accuracy"]
        # a publication's checksum (of the weights in weightsync.dtype, as the engines hold them) stands; this
        # engine's (the learner's own dtype) is the record only of a version nobody was sent (the initial one)
        self.r.hsetnx(self.keys.checksums, version, self.eval_engine.checksum)
        self.r.hset(self.keys.val, version, val)
        log.info("held-out reward at version %d: %.4f (accuracy %.4f)", version, val, res["accuracy"])
        return val

    def _waiting(self) -> bool:
        """Asked by the sampler while it waits for groups: keep the prompt queue fed (groups the ingest
        rejected used up prompts without reaching a batch) and say whether the job is stopping."""
        self._feed_prompts()
        return bool(self.r.exists(self.keys.stop))

    def _feed_prompts(self) -> None:
        """Keep enough prompts queued for everything admission may let actors start."""
        s, G = self.cfg.buffer.max_staleness, self.cfg.learner.groups_per_step
        missing = (s + 2) * G - self.r.llen(self.keys.prompts)
        if missing > 0:
            recs = [json.dumps(p.record()) for p in (next(self.prompts) for _ in range(missing))]
            pipe = self.r.pipeline()
            pipe.rpush(self.keys.prompts, *recs)
            pipe.set(self.keys.prompt_cursor, self.prompts.position)
            pipe.execute()

    def _log_step(self, step, version, rows, batch, stats, wall, extra) -> None:
        # what the step's wall time spent outside the phases timed (the previous step's acks included)
        stats[M.OTHER_S] = wall - sum(stats[k] for k in (M.READ_S, M.TRAIN_S, M.PUBLISH_S, M.EVAL_S))
        m = {**step_metrics(step, version, rows, batch.groups, hist_bound=self.cfg.buffer.max_staleness,
                            dropped_stale=batch.dropped_stale, wait_s=batch.wait_s, wall_s=wall,
                            loss_norm=self.cfg.learner.loss_norm),
             **stats, **extra, **{M.PUBLISHER_STATS[k]: v for k, v in self.publisher.stats.items()},
             M.WS_JOINS: self.joins.served,
             M.ABORTED_STALE: int(self.r.hget(self.keys.rejected, "dropped_" + ABANDONED_STALE) or 0)}
        self.metrics.write(m)
        if step == self.start_step:
            self._mark("first_step")

    def _phase(self, name: str, version: int) -> None:
        """Rank 0: where the loop stands (the phase, and the weights' version it works on or made), for the
        launcher's stall report (cluster.learner_stall_s) and its stack dump, due if the phase lasts that long;
        none is due while it waits for groups. (Other ranks wait in the step's first collective while rank 0 waits
        for groups: their time there is not theirs to report.)"""
        stall_s = self.cfg.cluster.learner_stall_s
        if self.rank != 0 or not stall_s:
            return
        if name == "wait":
            cancel_stall_dump()
        else:
            arm_stall_dump(stall_s)
        # the launcher times a phase by its own clock from when it first sees it (rank 0 may run on another node)
        self.r.hset(self.keys.learner_phase, mapping={"phase": name, "version": version, "since": time.time()})

    def _mark(self, event: str) -> None:
        """Rank 0: a point on the way to the first trained step (status.json's start-up timeline)."""
        if self.rank == 0:
            mark_startup(self.r, self.keys, "learner-0", event)


@torch.no_grad()
def _micro_batch_sums(loss, clipped, lp, b) -> torch.Tensor:
    """One micro-batch's share of train_step's accumulator: loss, clipped tokens, tokens, |lp - behavior|,
    k3 KL, then tokens, |lp - behavior| and k3 over its staleness-0 rows (b["fresh"])."""
    d = (lp - b["behavior_logprobs"]) * b["mask"]
    k3 = (d.exp() - 1 - d) * b["mask"]
    f = b["fresh"]
    return torch.stack([loss.detach(), clipped.sum(), b["mask"].sum(), d.abs().sum(), k3.sum(),
                        (b["mask"] * f).sum(), (d.abs() * f).sum(), (k3 * f).sum()]).double().cpu()


def _step_stats(acc: torch.Tensor, grad_norm: float) -> dict:
    """The step's metrics from train_step's all-reduced accumulator (its layout is written there)."""
    fresh_tokens = max(float(acc[5]), 1.0)
    return {M.LOSS: float(acc[0]), M.CLIP_FRAC: float(acc[1] / acc[2]), M.GRAD_NORM: grad_norm,
            M.MISMATCH_ABS: float(acc[3] / acc[2]), M.MISMATCH_KL: float(acc[4] / acc[2]),
            M.FRESH_TOKENS: float(acc[5]), M.ENGINE_MISMATCH_ABS: float(acc[6]) / fresh_tokens,
            M.ENGINE_MISMATCH_KL: float(acc[7]) / fresh_tokens}


def _micro_batches(model, plan, prep, lc, acc, kl_sum, rows, *, world, pad_id, device, temperature,
                   total_tokens) -> None:
    """Forward and backward of each micro-batch of the step's `plan`; its sums go into `acc` (train_step's
    layout) and the reference KL into `kl_sum`."""
    for mb in plan:
        fields = prep.token_fields(mb, ["advantages", "ref_logprobs"]) if prep else None
        b = to_device(collate(mb, pad_id, fields, **layout(lc)), device)
        lp = response_logprobs(model, b, temperature, lc.logprob_chunk_tokens)
        # decoupled: proximal = lp.detach(), the pre-update policy (one optimizer step per batch)
        terms, clipped = policy_loss_terms(lc.correction, lp, b["behavior_logprobs"], b["advantages"], b["mask"],
                                           clip_low=lc.clip_low, clip_high=lc.clip_high,
                                           decoupled_cap=lc.decoupled_cap, tis_cap=lc.tis_cap)
        if "ref_logprobs" in b:
            kl = kl_penalty(lp, b["ref_logprobs"], lc.kl_loss_type) * b["mask"]
            if prep.kl_loss:  # verl: policy loss + kl_loss_coef x KL, aggregated like the policy loss
                terms = terms + lc.kl_loss_coef * kl
            kl_sum += kl.detach().sum().double().cpu()
        loss = normalize(terms, b["mask"], lc.loss_norm, total_tokens=total_tokens, total_seqs=len(rows),
                         seq_weight=b["seq_weight"])
        (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already global
        acc[:8] += _micro_batch_sums(loss, clipped, lp, b)


def train_step(model, opt, share, rows, lc, *, temperature: float, world: int, pad_id: int, device,
               group=None, extras=None) -> dict:
    """One optimizer step on this rank's share; identical on any number of ranks (see losses.py).

    Collective over the learner group: every rank must call it with the same number of rows.
    `extras` (learner/ppo.py PPOExtras): learn-time token advantages from the critic or REINFORCE++,
    the reference KL loss, and the critic's own update after the policy's.
    """

    total_tokens = float(sum(len(r.response_ids) for r in rows))
    # loss, clipped tokens, tokens, |lp - behavior|, k3 KL, and the last three again over staleness-0
    # rows only: same weights on both sides, so that is the engine-vs-learner numerical noise floor;
    # then a non-finite flag per rank (summed by the all-reduce: ranks skip a step together).
    acc = torch.zeros(9, dtype=torch.float64)
    plan = plan_micro_batches(share, lc.micro_batch_size_per_gpu,
                              lc.max_tokens_per_micro_batch if lc.use_dynamic_bsz else 0, group, packed=lc.pack_sequences)
    prep = extras.prepare(share, rows, plan, pad_id=pad_id, temperature=temperature) if extras else None
    kl_sum = torch.zeros(1, dtype=torch.float64)  # KL(pi || ref) summed over tokens (with a reference)
    model.train()
    shadow = shadow_of(model)  # learner.plain_compute=shadow: the step computes on a bf16 copy of the weights
    if shadow:  # the weights as they are now: last step's update, or a checkpoint loaded since
        shadow.refresh()
    with shadow.computing(model) if shadow else contextlib.nullcontext():
        _micro_batches(model, plan, prep, lc, acc, kl_sum, rows, world=world, pad_id=pad_id, device=device,
                       temperature=temperature, total_tokens=total_tokens)
    if shadow:
        shadow.to_masters()
    grad_norm = clip_grad_norm(model, lc.grad_clip, group)
    acc[8] = float(not (math.isfinite(float(acc[0])) and math.isfinite(grad_norm)))  # this rank's verdict
    dist.all_reduce(acc, group=group)  # one verdict for all: a non-finite loss or norm on any rank skips
    if acc[8] > 0:  # never apply it: optimizer state untouched (no Adam moments fed a NaN), no version
        opt.zero_grad(set_to_none=True)
        return {M.SKIPPED: 1, M.SKIP_REASON: "non-finite " + ("loss" if not math.isfinite(float(acc[0]))
                                                              else "grad norm")}
    optimizer_step(opt, model, optimizer_offload=lc.optimizer_offload, device=device)
    stats = _step_stats(acc, grad_norm)
    if lc.use_dynamic_bsz:
        stats[M.MICRO_BATCHES] = len(plan)
    if prep is not None:
        stats.update(prep.stats)
        if extras.ref is not None:
            dist.all_reduce(kl_sum, group=group)
            stats[M.KL_REF] = float(kl_sum[0] / acc[2])
        if extras.critic is not None:
            stats.update(extras.update_critic(share, rows, prep, pad_id=pad_id, world=world))
    return stats
