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
    def __init__(self, directory: str | Path, limits: Limits = Limits()):
        self.dir, self.limits = Path(directory), limits
        if not batch_path(self.dir, 0).exists():
            raise FileNotFoundError(f"buffer.replay_dir: no recorded batch {batch_path(self.dir, 0)} "
                                    "(record one with trainer.record_batches=true)")

    def next_batch(self, learner_version: int) -> Batch:
        path = batch_path(self.dir, learner_version)
        if not path.exists():
            raise FileNotFoundError(f"buffer.replay_dir: the recording has no batch for step {learner_version} "
                                    f"({path}); set trainer.total_steps to at most the recorded steps")
        t0 = time.monotonic()
        payloads = msgpack.unpackb(path.read_bytes())
        groups = [decode(p, self.limits) for p in payloads]
        return Batch(groups, payloads, [], 0, time.monotonic() - t0)

    def ack(self, batch: Batch) -> None:
        pass

    def ack_ids(self, entry_ids) -> None:
        pass
