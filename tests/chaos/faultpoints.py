"""The chaos tests' fault points, wrapped around product methods from outside the product code.

A job under test (tests/chaos/jobs.py) names this file in runbase.faults.ENV; every process of the job
loads it once as it starts (cluster/proc.py) and calls `install()`, which wraps the methods of the
components that process has loaded. Each wrapper fires its fault (runbase.faults) when a test armed it,
once: `take` deletes the arming atomically. A process started directly runs its module under this file
(`python faultpoints.py MODULE ARGS...`), and an in-process test passes its monkeypatch's setattr, so the
wrappers go when the test ends.
"""
from __future__ import annotations

import functools
import importlib
import math
import sys

from runbase import faults

WRAPPED = "_fault_point"  # marks a wrapper, so a second install() wraps nothing twice


def _wrap(patch, cls, name: str, around) -> None:
    """cls.name replaced by a function calling around(original, self, *args, **kwargs)."""
    original = getattr(cls, name)
    if getattr(original, WRAPPED, False):
        return

    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        return around(original, self, *args, **kwargs)

    setattr(wrapped, WRAPPED, True)
    patch(cls, name, wrapped)


def _store_or_die(store, server, groups):
    """The ingest dies between receiving groups and writing them (INGEST_KILL_BEFORE_STORE)."""
    if faults.take(server.r, server.keys.run, faults.INGEST_KILL_BEFORE_STORE):
        faults.die()
    return store(server, groups)


def _poison_the_share(scatter, source, batch, step, *args):
    """Rank 0's share of step LEARNER_NAN_AT_STEP gets one NaN advantage, as overflowing numbers make it."""
    rows, share, *rest = scatter(source, batch, step, *args)
    if source.rank == 0 and faults.value(source.r, source.keys.run, faults.LEARNER_NAN_AT_STEP) == step \
            and faults.take(source.r, source.keys.run, faults.LEARNER_NAN_AT_STEP):
        share[0].advantage = share[0].reward = math.nan
    return (rows, share, *rest)


def _die_after_step(after_step, ckpt, batch, version, *args, **kwargs):
    """Rank 0 dies once version LEARNER_KILL_AT_STEP's step is acked or checkpointed: a crash between checkpoints."""
    after_step(ckpt, batch, version, *args, **kwargs)
    if ckpt.rank == 0 and faults.value(ckpt.r, ckpt.keys.run, faults.LEARNER_KILL_AT_STEP) == version \
            and faults.take(ckpt.r, ckpt.keys.run, faults.LEARNER_KILL_AT_STEP):
        faults.die()


def _die_after_shards(write_shards, ckpt, path):
    """Rank 0 dies with its checkpoint's shards written and no COMPLETE marker (LEARNER_KILL_IN_CHECKPOINT)."""
    write_shards(ckpt, path)
    if ckpt.rank == 0 and faults.take(ckpt.r, ckpt.keys.run, faults.LEARNER_KILL_IN_CHECKPOINT):
        faults.die()


def install(patch=setattr) -> None:
    """Wrap the fault points of the components this process has loaded (the ingest's, the learner's)."""
    if ingest := sys.modules.get("buffer.ingest"):
        _wrap(patch, ingest.IngestServer, "store", _store_or_die)
    if batches := sys.modules.get("learner.batches"):
        _wrap(patch, batches.BatchSource, "scatter", _poison_the_share)
    if checkpoint := sys.modules.get("learner.checkpoint"):
        _wrap(patch, checkpoint.Checkpointer, "after_step", _die_after_step)
        _wrap(patch, checkpoint.Checkpointer, "write_shards", _die_after_shards)


if __name__ == "__main__":  # python faultpoints.py MODULE ARGS...: MODULE's main(ARGS) with the faults installed
    target = importlib.import_module(sys.argv[1])
    install()
    raise SystemExit(target.main(sys.argv[2:]))
