"""Recorded batches: write each step's batch to disk, and train on them again later.

A recorded batch holds the validated payloads exactly as the learner received them, so a
replaying learner rebuilds bit-identical rows: with the same seed and weights, a replayed
run reproduces the recorded one step for step, whatever the actors did then.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import msgpack

from buffer.core import Batch, TrajectorySource
from buffer.schema import Limits, decode


def batch_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.msgpack"


def record(directory: str | Path, step: int, payloads: list[bytes]) -> None:
    """Atomically (write + rename), so a crash never leaves a truncated batch behind."""
    path = batch_path(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgpack.packb(payloads))
    os.replace(tmp, path)


class ReplaySource(TrajectorySource):
    def __init__(self, directory: str | Path, limits: Limits = Limits(), *, groups_per_step: int = 0,
                 steps: int = 0):
        """`groups_per_step` (learner.groups_per_step, 0: not checked): every replayed batch must hold that
        many groups; `steps` (trainer.total_steps, 0: not checked): batches 0..steps-1 must all be there,
        checked here, before a step is trained, not when the run reaches the first missing one."""
        self.dir, self.limits, self.groups_per_step = Path(directory), limits, groups_per_step
        if not batch_path(self.dir, 0).exists():
            raise FileNotFoundError(f"buffer.replay_dir: no recorded batch {batch_path(self.dir, 0)} "
                                    "(record one with trainer.record_batches=true)")
        if (missing := next((k for k in range(steps) if not batch_path(self.dir, k).exists()), None)) is not None:
            raise FileNotFoundError(f"buffer.replay_dir: the recording has no batch for step {missing} "
                                    f"({batch_path(self.dir, missing)}) of trainer.total_steps={steps}; set "
                                    f"trainer.total_steps to at most {missing}, the recorded steps")

    def next_batch(self, learner_version: int) -> Batch:
        path = batch_path(self.dir, learner_version)
        if not path.exists():
            raise FileNotFoundError(f"buffer.replay_dir: the recording has no batch for step {learner_version} "
                                    f"({path}); set trainer.total_steps to at most the recorded steps")
        t0 = time.monotonic()
        payloads = msgpack.unpackb(path.read_bytes())
        if self.groups_per_step and len(payloads) != self.groups_per_step:
            # the learner would silently train on another batch size than its config says
            raise ValueError(f"buffer.replay_dir: {path} holds {len(payloads)} groups, learner.groups_per_step "
                             f"is {self.groups_per_step}; replay with the recording run's learner.groups_per_step")
        groups = [decode(p, self.limits) for p in payloads]
        return Batch(groups, payloads, [], 0, time.monotonic() - t0)

    def ack(self, batch: Batch) -> None:
        pass

    def ack_ids(self, entry_ids) -> None:
        pass
