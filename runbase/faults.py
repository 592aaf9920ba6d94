"""Fault injection for the chaos tests: one-shot faults armed in Redis, fired at named points.

A test arms a fault (`arm`); the process that owns the point fires it the next time it gets
there, once (`take` deletes it atomically). Nothing arms faults in a normal run, and every
check sits on a path that already talks to Redis at a low rate (a periodic tick, a checkpoint).
"""
from __future__ import annotations

import os
import signal

from runbase.keys import Keys

INGEST_KILL_BEFORE_STORE = "ingest_kill_before_store"      # the ingest dies between receive and write
LEARNER_KILL_IN_CHECKPOINT = "learner_kill_in_checkpoint"  # rank 0 dies after the shards, before COMPLETE
LEARNER_KILL_AT_STEP = "learner_kill_at_step"  # value: the version after whose step rank 0 dies
LEARNER_NAN_AT_STEP = "learner_nan_at_step"    # value: the step whose batch rank 0 poisons (one NaN advantage)


def key(run_id: str) -> str:
    return Keys(run_id).faults


def arm(r, run_id: str, name: str, value=1) -> None:
    r.hset(key(run_id), name, value)


def armed(r, run_id: str, name: str) -> bool:
    return bool(r.hexists(key(run_id), name))


def take(r, run_id: str, name: str) -> bool:
    """True exactly once per arming."""
    return bool(r.hdel(key(run_id), name))


def die() -> None:
    """The fault itself: an unclean death, as from the OOM killer or a lost machine."""
    os.kill(os.getpid(), signal.SIGKILL)
