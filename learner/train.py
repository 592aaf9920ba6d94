"""The learner process: one rank of the FSDP2 group. Rank 0 also owns the buffer sampler,
the prompt feeder, the weight publisher, evaluation and metrics.

Step k trains weights of version k on groups with staleness k - version_start <= s, then
publishes version k+1. Every rank runs the same number of micro-batches (equal shares).
The loop is here; what it hands each step to lives beside it: learner/batches.py (read, scatter,
ack), learner/step.py (the train step), learner/publish.py, learner/evaluation.py, learner/checkpoint.py.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from buffer.schema import Limits
from buffer.store import ABANDONED_STALE
from data.dataset import prompt_sources
from engines.lora import apply_lora, enabled
from learner import loggers
from learner import metric_names as M
from learner.batches import BatchSource
from learner.checkpoint import Checkpointer
from learner.config import LearnerView
from learner.evaluation import build_evaluation
from learner.metrics import MetricsWriter, step_metrics
from learner.model import load_policy, set_eos_logit_bias, wrap_policy
from learner.phases import PhaseReport
from learner.ppo import PPOExtras, needs_extras
from learner.profiling import StepProfiler
from learner.publish import Publication
from learner.step import train_step
from rewards.scorers import record_scorer
from runbase.keys import Keys, connect
from weightsync.store import client_store, master_store

log = logging.getLogger(__name__)

# Non-zero ranks wait in a collective while rank 0 waits for trajectories; a slow actor
# fleet is not a failure, so the learner group's timeout is generous.
LEARNER_GROUP_TIMEOUT = timedelta(minutes=30)
MAX_SKIPS_IN_A_ROW = 5     # steps with a non-finite update skipped one after another before the learner
                            # fails: one bad batch is skipped; this many means the policy itself diverged


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


def build_policy(lc, model_path: str, device: torch.device, model=None, eos_logit_bias: float = 0.0):
    """The wrapped policy and its AdamW, as every learner (and the one-process sync baseline) trains them;
    `model`: an already built module instead of the one at `model_path` (benchmarks); `eos_logit_bias`:
    actors.eos_logit_bias, which the policy's logprobs include as the engines' sampling does."""

    world = dist.get_world_size() if dist.is_initialized() else 1
    if model is None:
        model = load_policy(model_path, device, lc.attn_implementation, lc.master_dtype)
    if enabled(lc.lora):  # the base frozen, an adapter on it (the same on every rank: engines/lora.py)
        model = apply_lora(model, lc.lora)
    set_eos_logit_bias(model, model_path, eos_logit_bias)
    model = wrap_policy(model, lc, device, world)
    # what trains: every weight, or the adapter alone (no AdamW state for a frozen base)
    params = [p for p in model.parameters() if p.requires_grad]
    # one fused kernel per step on a GPU (bench/learner.py measured with it); the foreach path elsewhere
    opt = torch.optim.AdamW(params, lr=lc.lr, betas=tuple(lc.betas), weight_decay=lc.weight_decay,
                            fused=device.type == "cuda" and not lc.param_offload)
    return model, opt


class LearnerProcess:
    """One rank of the learner group and its loop: read a batch, train it, then hand the step to the
    components, each of which decides when it acts (learner/publish.py, evaluation.py, checkpoint.py); the
    batch source (learner/batches.py) reads, scatters and acks."""

    def __init__(self, cfg, *, rank: int, world: int, master_addr: str, master_port: int, run_id: str,
                 redis_url: str, run_dir: str, model_path: str):
        view = self.view = LearnerView.of(cfg)  # what this process reads of the root configuration, once
        self.rank, self.world, self.run_dir = rank, world, run_dir
        lc = view.learner
        self.device = learner_device(lc, rank)
        torch.set_num_threads(lc.torch_threads)
        torch.manual_seed(lc.seed)
        self.cpu_group = init_learner_group(self.device, master_addr, master_port, rank, world)
        self.model, self.opt = build_policy(lc, model_path, self.device, eos_logit_bias=view.eos_logit_bias)

        # critic (gae) and frozen reference (KL): built before rank 0's own setup, same order on every rank
        self.ppo = PPOExtras(cfg, model_path, self.device, group=self.cpu_group) if needs_extras(cfg) else None
        self.pad_id = self.model.config.pad_token_id or 0
        self.limits = Limits(vocab_size=self.model.config.vocab_size)
        self.r = self.keys = None  # Redis is rank 0's: the other ranks follow its decisions by collectives
        if rank == 0:
            self.keys, self.r = Keys(run_id), connect(redis_url)
            self.r.setnx(self.keys.version, 0)
            self.r.hset(self.keys.learner, mapping={"pid": os.getpid(), "host": socket.gethostname()})
        self.report = PhaseReport(self.r, self.keys, view.stall_s)
        self._build_components(cfg, run_id, model_path)
        self.start_step = self.checkpointer.resume() if view.resume else 0
        self.profiler = StepProfiler(view.trainer.profile_steps, f"{run_dir}/profiles", rank=rank,
                                     cuda=self.device.type == "cuda")

    def _build_components(self, cfg, run_id: str, model_path: str) -> None:
        """The publication, the evaluation, the batch source and the checkpointer; on rank 0 also the prompt
        stream (from the cursor a resumed run left) and the metrics writer (trainer.logger's sinks)."""
        view, rank, group, run_dir = self.view, self.rank, self.cpu_group, self.run_dir
        ranked = {"rank": rank, "r": self.r, "keys": self.keys}
        self.publication = Publication(view.weightsync, model=self.model, world=self.world, group=group,
                                       device=self.device, report=self.report, bind_host=view.bind_host, **ranked)
        self.evaluation = build_evaluation(view, model=self.model, device=self.device, model_path=model_path,
                                           run_dir=run_dir, report=self.report, **ranked)
        prompts = None
        if rank == 0:
            # the built-in task, or verl parquet rows rendered with the model's chat template and tokenized
            prompts, val = prompt_sources(cfg, self.evaluation.tokenizer,
                                          start=int(self.r.get(self.keys.prompt_cursor) or 0))
            self.evaluation.held_out(val, record_scorer(cfg.data.reward_options()))
            self.metrics = MetricsWriter(run_dir, loggers=loggers.for_run(cfg, run_dir, run_id), redis=self.r,
                                         key=self.keys.metrics)
        self.batches = BatchSource(view, world=self.world, group=group, limits=self.limits, run_dir=run_dir,
                                   report=self.report, prompts=prompts, **ranked)
        self.checkpointer = Checkpointer(view.trainer, model=self.model, opt=self.opt, ppo=self.ppo, group=group,
                                         run_dir=run_dir, batches=self.batches, **ranked)
        if rank == 0:
            self.batches.feed()

    def run(self) -> dict:
        total = self.view.trainer.total_steps
        self.publication.start()
        if self.start_step:  # resumed: actors start from the base model, give them our version first
            if self.rank == 0:
                self.r.set(self.keys.version, self.start_step)
            self.publication.publish(self.start_step)
        self.report.mark("ready")   # model, optimizer and process group built
        val_initial = val = self.evaluation.evaluate_first(self.start_step)
        self.report.mark("initial_eval")
        self.evaluation.start_clock()  # trainer.val_every_s counts from the first trained step
        last = time.monotonic()
        step, skips = self.start_step, 0  # skips: steps skipped in a row (the step number is tried again)
        while step < total:
            self.profiler.step(step)
            batch, read_s = self.batches.read(step, first=step == self.start_step)
            asked = (self._export_requested(), self.evaluation.clock_due())  # rank 0's, for every rank
            t_train = time.monotonic()
            self.report.phase("train", step)
            rows, share, (export, timed) = self.batches.scatter(batch, step, asked)
            stats = self._train(share, rows)
            if stats.get(M.SKIPPED):
                skips = self._skip_step(step, batch, stats, skips)
                continue
            skips = 0
            stats[M.TRAIN_S] = time.monotonic() - t_train  # scatter + forward/backward + optimizer
            stats[M.READ_S] = read_s
            version = step + 1
            val = self._publish_and_evaluate(version, stats, timed)
            if self.rank == 0:
                self.r.set(self.keys.version, version)
                self.batches.feed()
                now = time.monotonic()
                first = step == self.start_step
                extra = self.evaluation.line_fields(version, val, start=self.start_step if first else None,
                                                    start_val=val_initial)
                self._log_step(step, version, rows, batch, stats, now - last, extra)
                last = now
            # after the step's line: a step a checkpoint counts always has its metrics line
            self.report.phase("checkpoint", version)
            self.checkpointer.after_step(batch, version, last=version == total)
            if export:
                self._export(version)
            step += 1
        return self._close_run(val_initial, val)

    def _train(self, share, rows) -> dict:
        return train_step(self.model, self.opt, share, rows, self.view.learner, temperature=self.view.temperature,
                          world=self.world, pad_id=self.pad_id, device=self.device, group=self.cpu_group,
                          extras=self.ppo)

    def _publish_and_evaluate(self, version: int, stats: dict, timed: bool):
        """The step's version to the publication and the evaluation (each acts when it is due: `timed` is rank
        0's clock, trainer.val_every_s); the learner's time in each goes into `stats`."""
        last = version == self.view.trainer.total_steps
        t0 = time.monotonic()
        self.publication.publish_if_due(version, last=last)
        stats[M.PUBLISH_S] = time.monotonic() - t0  # gather + send + every actor's ack (0: not this step)
        t0 = time.monotonic()
        val = self.evaluation.evaluate_if_due(version, timed=timed, last=last)
        stats[M.EVAL_S] = time.monotonic() - t0  # the learner's wait (an evaluator's own time: M.VAL_EVAL_S)
        return val

    def _close_run(self, val_initial, val) -> dict:
        """After the last step: the last publication's end, the join server stopped, the export; the summary."""
        tc = self.view.trainer
        self.report.phase("close", tc.total_steps)
        self.profiler.close()
        self.publication.close()
        if tc.export_hf:  # collective: the final weights for the export below (a final evaluation may hold them)
            self.evaluation.hold(tc.total_steps)
        summary = {"val_reward_start": val_initial, "val_reward_end": val, "steps": tc.total_steps,
                   "start_step": self.start_step}
        if self.rank == 0:
            summary["val_accuracy_start"] = self.evaluation.accuracy.get(self.start_step)
            summary["val_accuracy_end"] = self.evaluation.accuracy.get(tc.total_steps)
            self.metrics.close()
            if tc.export_hf:
                summary["policy"] = self.evaluation.save_policy(f"{self.run_dir}/policy")
        return summary

    def _export_requested(self) -> bool:
        """Rank 0, as a step starts: whether an export was asked for (cluster.export; done after the step)."""
        return self.rank == 0 and bool(self.r.exists(self.keys.export))

    def _export(self, version: int) -> None:
        """On demand (`python -m cluster.export`): the current policy as a Hugging Face folder (collective)."""
        self.report.phase("export", version)
        out = f"{self.run_dir}/policy-step-{version:08d}"
        if self.evaluation.hold(version):
            self.evaluation.save_policy(out)
            pipe = self.r.pipeline()
            pipe.rpush(self.keys.exported, out)
            pipe.delete(self.keys.export)
            pipe.execute()

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
            n = self.batches.skip(batch, f"skipped_{why.replace(' ', '_')}", step)
            log.warning("step %d skipped: %s; its %d groups dead-lettered, the step is tried again", step, why, n)
            self.metrics.write({M.STEP: step, M.VERSION: step, M.SKIPPED: 1, M.SKIP_REASON: why,
                                M.DEAD_LETTERED: n, M.TIME: time.time()})
        return skips + 1

    def _log_step(self, step, version, rows, batch, stats, wall, extra) -> None:
        # what the step's wall time spent outside the phases timed (the previous step's acks included)
        stats[M.OTHER_S] = wall - sum(stats[k] for k in (M.READ_S, M.TRAIN_S, M.PUBLISH_S, M.EVAL_S))
        m = {**step_metrics(step, version, rows, batch.groups, hist_bound=self.view.max_staleness,
                            dropped_stale=batch.dropped_stale, wait_s=batch.wait_s, wall_s=wall,
                            loss_norm=self.view.learner.loss_norm),
             **stats, **extra, **self.publication.line_fields(),
             M.ABORTED_STALE: int(self.r.hget(self.keys.rejected, "dropped_" + ABANDONED_STALE) or 0)}
        self.metrics.write(m)
        if step == self.start_step:
            self.report.mark("first_step")
