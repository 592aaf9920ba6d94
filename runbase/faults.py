"""Fault injection for the chaos tests: one-shot faults armed in Redis, fired at named points.

A test arms a fault (`arm`); the process that owns the point fires it the next time it gets
there, once (`take` deletes it atomically). The points are not in the product code: a job started
with ENV naming a fault module (tests/chaos/faultpoints.py) has every process load it once as it starts
(cluster/proc.py), and that module's `install()` wraps the methods of the components the process loaded.
Without ENV nothing is loaded and no component looks for faults.
"""
from __future__ import annotations

import importlib.util
import os
import signal

from runbase.keys import Keys

ENV = "ASYNCRL_FAULTS"  # the path of a fault module whose install() a process calls once as it starts

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


def value(r, run_id: str, name: str) -> int | None:
    """The value a fault was armed with (None: not armed)."""
    raw = r.hget(key(run_id), name)
    return None if raw is None else int(raw)


def take(r, run_id: str, name: str) -> bool:
    """True exactly once per arming."""
    return bool(r.hdel(key(run_id), name))


def die() -> None:
    """The fault itself: an unclean death, as from the OOM killer or a lost machine."""
    os.kill(os.getpid(), signal.SIGKILL)


def load(path: str):
    """The fault module at `path` (a file: it need not be importable from the process's path)."""
    spec = importlib.util.spec_from_file_location("asyncrl_fault_points", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install_from(environ) -> bool:
    """A process's start: the fault module ENV names, installed (True), or nothing when ENV is unset."""
    if not (path := environ.get(ENV)):
        return False
    load(path).install()
    return True
