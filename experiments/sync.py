"""python -m experiments.sync [--config F] [--run-dir D] [--actors N] [section.key=value ...]

The synchronous baseline: the same learner (FSDP2 model, `groups_to_rows`, `train_step`), the same
engine, prompts, rewards, admission rule and seeds as `cluster.start`, with generation and training
strictly alternating in one process (verl's hybrid-engine schedule), on the CPU or one GPU
(`learner.device`, `actors.device`: engine and learner then share it): generate step k's groups with
weights k, train, load weights k+1, repeat. No Redis, ZeroMQ or Ray: nothing here can go stale.

It writes `metrics.jsonl` with the learner's fields, so the staleness sweep treats it as one more
setting, and `tests/integration/test_experiments.py` checks that `cluster.start max_staleness=0`
reproduces it number for number (docs/design.md: s = 0 must equal a synchronous run).

How the distributed system's randomness is mirrored: actor i seeds its torch RNG with
`actors.seed + i` once and then only `generate` draws from it; group ids are `g1, g2, ...` in
lease order and prompts are leased in stream order; so one RNG state per actor, switched in
around each generate call, replays exactly what an actor does. With N > 1 actors, which actor
leases which batch is a race in the real system; here batches go round-robin (verl's even split).

With `actors.engine=vllm` the engine is vLLM's, in this process beside the learner (TRL's "colocate",
verl's hybrid engine): weights reach it by reference after each step. The schedule is the same as
`cluster.start max_staleness=0`, the draws are not: vLLM's sampling noise belongs to its engine, one here
against one per actor there, so the exact s=0 == sync check stays with the HF engine.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from actors.groups import build_group
from buffer.schema import Limits, decode, encode
from buffer.staleness import admission_cap
from cluster.config import load_config
from data.dataset import prompt_sources
from data.tasks import token_ids
from data.tiny_model import resolve_model_path
from engines.backends import build_engine
from engines.core import SamplingParams
from engines.lora import published_state
from learner import metric_names as M
from learner.metrics import MetricsWriter, step_metrics
from rewards.scorers import record_scorer
from runbase.configload import ConfigError, dump_yaml
from runbase.devices import cuda_refusal

log = logging.getLogger(__name__)


def _rng_state(device):
    """The CPU generator's state, and that of the engine's GPU when it samples on one."""
    import torch

    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state, device) -> None:
    import torch

    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class SyncTrainer:
    """One process: N actor RNG streams over one engine, and a one-rank FSDP learner."""

    def __init__(self, cfg, run_dir: Path, model_path: str):
        import torch
        import torch.distributed as dist

        from learner.train import build_policy, init_learner_group, learner_device  # lazy: imports torch

        self.cfg, self.run_dir = cfg, run_dir
        lc, a = cfg.learner, cfg.actors
        self.device = learner_device(lc, 0)
        torch.set_num_threads(lc.torch_threads)
        torch.manual_seed(lc.seed)
        # a one-rank group: the learner's FSDP code path, unchanged (NCCL plus a gloo group on a GPU)
        if not dist.is_initialized():
            self.group = init_learner_group(self.device, "127.0.0.1", 0, 0, 1)
        else:  # a caller's group: step statistics still need gloo beside NCCL
            self.group = dist.new_group(backend="gloo") if self.device.type == "cuda" else None
        self.model, self.opt = build_policy(lc, model_path, self.device, eos_logit_bias=cfg.actors.eos_logit_bias)
        from learner.ppo import PPOExtras, needs_extras  # lazy: imports torch

        self.ppo = PPOExtras(cfg, model_path, self.device, group=self.group) if needs_extras(cfg) else None
        self.pad_id = self.model.config.pad_token_id or 0
        self.engine = build_engine(a, model_path, seed=a.seed, lora=lc.lora)
        self.limits = Limits(vocab_size=self.engine.vocab_size, max_response_tokens=cfg.buffer.max_response_tokens,
                             max_message_bytes=cfg.buffer.max_message_bytes)
        dev = self.engine_device = torch.device(a.device)
        learner_rng = _rng_state(dev)
        self.actor_rng = []
        for i in range(cfg.cluster.actors):  # what RolloutWorker.run does after building its engine
            torch.manual_seed(a.seed + i)
            self.actor_rng.append(_rng_state(dev))
        _set_rng_state(learner_rng, dev)
        # the learner's prompt source (built-in task or data.train_files) and the actors' scorer
        self.prompts, self.val = prompt_sources(cfg, self.engine.tokenizer)
        self.score = record_scorer(cfg.data.reward_options())
        self.metrics = MetricsWriter(str(run_dir))  # metrics.jsonl only
        self.started = 0     # groups admitted so far (the admission counter)
        self.batches = 0     # generate calls so far (round-robin over actor streams)

    def _generate(self, version: int):
        """Step `version`'s groups, admitted by the same rule as the system's (s = 0: one step's worth),
        leased groups_per_batch at a time. Returns (groups, [(seconds, decode_steps, rows)] per batch)."""

        a, G = self.cfg.actors, self.cfg.learner.groups_per_step
        params = SamplingParams(n=a.n, temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_tokens,
                                eos_logit_bias=a.eos_logit_bias)
        tok = self.engine.tokenizer
        groups, timing = [], []
        while (room := admission_cap(version, 0, G) - self.started) > 0:
            leased = []
            for _ in range(min(a.groups_per_batch, room)):
                self.started += 1
                leased.append((f"g{self.started}", next(self.prompts).record()))
            stream = self.batches % len(self.actor_rng)
            self.batches += 1
            t0 = time.time()
            ids = [token_ids(rec, tok) for _gid, rec in leased]
            dev = self.engine_device
            own = _rng_state(dev)
            _set_rng_state(self.actor_rng[stream], dev)
            outs = self.engine.generate(ids, params)
            self.actor_rng[stream] = _rng_state(dev)
            _set_rng_state(own, dev)
            for (gid, p), pids, comps in zip(leased, ids, outs):
                g = build_group(gid, p, pids, comps, score=self.score, tokenizer=tok, actor_id=f"actor-{stream}",
                                created_at=t0, version=version)
                g.sent_at = time.time()
                groups.append(decode(encode(g, self.limits), self.limits))  # the wire round trip, as the learner sees it
            timing.append((time.time() - t0, max(len(c.token_ids) for cs in outs for c in cs), len(leased) * a.n))
        return groups, timing

    def _load_weights(self, version: int) -> float:
        from learner.model import full_state_dict  # lazy: imports torch
        from weightsync.flat import checksum  # lazy: imports torch

        t0 = time.monotonic()
        sd = published_state(self.model, full_state_dict(self.model))  # with learner.lora, the adapter alone
        self.engine.load_weights(sd, version, checksum(sd))
        return time.monotonic() - t0

    def _evaluate(self) -> dict:
        """Exactly the learner's evaluation (learner/evaluation.py `LocalEvaluation.evaluate`): reward and accuracy."""
        from engines.evaluate import evaluate_prompts  # lazy: imports torch

        tc, a = self.cfg.trainer, self.cfg.actors
        return evaluate_prompts(self.engine, self.val, self.score,
                                samples=tc.val_samples, temperature=a.temperature, max_tokens=a.max_tokens,
                                seed=tc.val_seed)

    def run(self, progress=None) -> dict:
        from learner.batching import groups_to_rows, split_rows  # lazy: imports torch
        from learner.step import train_step  # lazy: imports torch

        cfg, tc = self.cfg, self.cfg.trainer
        val_initial = last_val = self._evaluate()
        last = time.monotonic()
        for step in range(tc.total_steps):
            t0 = time.monotonic()
            groups, timing = self._generate(step)
            t1 = time.monotonic()
            rows = groups_to_rows(groups, step, scale_std=cfg.learner.scale_adv_by_std)
            stats = train_step(self.model, self.opt, split_rows(rows, 1)[0], rows, cfg.learner,
                               temperature=cfg.actors.temperature, world=1, pad_id=self.pad_id, device=self.device,
                               group=self.group, extras=self.ppo)
            t2 = time.monotonic()
            version = step + 1
            publish_s = self._load_weights(version)
            val = self._evaluate() if tc.evaluates_at(version) else None
            now = time.monotonic()
            m = {**step_metrics(step, version, rows, groups, hist_bound=0, dropped_stale=0, wait_s=t1 - t0,
                                wall_s=now - last, loss_norm=cfg.learner.loss_norm),
                 **stats, M.MODE: "sync", M.GEN_S: t1 - t0, M.TRAIN_S: t2 - t1, M.WS_PUBLISH_S: publish_s,
                 M.GEN_BATCHES: timing}
            if step == 0:  # the learner's names: the sweep's accuracy table takes sync as its reference
                m[M.VAL_REWARD_INITIAL], m[M.VAL_ACCURACY_INITIAL] = val_initial["reward"], val_initial["accuracy"]
            if val is not None:
                m[M.VAL_REWARD], m[M.VAL_ACCURACY] = val["reward"], val["accuracy"]
                last_val = val
            self.metrics.write(m)
            last = now
            if progress:
                progress(m)
        self.metrics.close()
        return {"val_reward_start": val_initial["reward"], "val_reward_end": last_val["reward"],
                "val_accuracy_start": val_initial["accuracy"], "val_accuracy_end": last_val["accuracy"],
                "steps": tc.total_steps, "start_step": 0}


def _train(cfg, run_dir: Path, tty: bool) -> dict:
    """The model (built-in ones built on first use), the trainer, its run with a progress line; the summary."""
    trainer = SyncTrainer(cfg, run_dir, resolve_model_path(cfg.model.path, cfg.task))

    def progress(m):
        line = (f"step {m[M.STEP] + 1}/{cfg.trainer.total_steps} | reward {m[M.REWARD_MEAN]:.3f} | "
                f"{m[M.SAMPLES_PER_S]:.0f} samples/s | gen {m[M.GEN_S]:.2f}s train {m[M.TRAIN_S]:.2f}s")
        if tty:
            sys.stdout.write("\r\033[K" + line)
            sys.stdout.flush()
        elif (m[M.STEP] + 1) % 10 == 0:
            print(line, flush=True)

    return trainer.run(progress)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.sync", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", help="YAML file merged over configs/default.yaml")
    p.add_argument("--actors", type=int, help="actor RNG streams to mirror (cluster.actors)")
    p.add_argument("--run-dir", help="output directory (default runs/sync-<time>)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=20")
    args = p.parse_intermixed_args(argv)
    overrides = ([f"cluster.actors={args.actors}"] if args.actors is not None else []) + args.overrides
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if any(d.startswith("cuda") for d in (cfg.learner.device, cfg.actors.device)):
        import torch  # lazy: only to count the GPUs CUDA was asked for on

        if why := cuda_refusal(cfg.learner.device, cfg.actors.device, torch.cuda.device_count()):
            print(f"error: {why}", file=sys.stderr)
            return 2
    run_dir = Path(args.run_dir or cfg.cluster.run_dir or f"runs/sync-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    # a second run here would append to the first one's metrics, or share a cluster.start job's directory
    if held := [f for f in ("metrics.jsonl", "job.json") if (run_dir / f).exists()]:
        print(f"error: {run_dir} already holds a run ({held[0]}); give another --run-dir or remove it",
              file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, run_dir / "config.yaml")
    logging.basicConfig(filename=run_dir / "sync.log", level=logging.INFO)
    print(f"sync run: outputs in {run_dir}", flush=True)
    tty = sys.stdout.isatty()
    # Ctrl-C even when started with SIGINT ignored (nohup, a background job of a script: it is inherited), as
    # cluster.start does: a sweep's --run-seconds SIGINT, or a test's, did nothing then
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        summary = _train(cfg, run_dir, tty)
    except KeyboardInterrupt:   # Ctrl-C (during a cold cache's model build too), or a sweep's --run-seconds
        metrics = run_dir / "metrics.jsonl"   # line-buffered: every finished step's line is there, whole
        steps = len(M.read_metrics(metrics)) if metrics.exists() else 0
        print(("\n" if tty else "") + f"interrupted: {steps} steps in {metrics}", flush=True)
        return 128 + signal.SIGINT   # as a shell reports a signal, and as cluster.start does
    print(("\n" if tty else "") + f"done: {json.dumps(summary)}", flush=True)
    print(f"held-out reward: {summary['val_reward_start']:.4f} at step 0 -> {summary['val_reward_end']:.4f} "
          f"after {summary['steps']} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
