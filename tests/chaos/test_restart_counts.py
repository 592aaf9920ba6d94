"""Restarts counted per process, in one job with two ingest shards (buffer.ingest_shards=2): an actor SIGKILLed, then
SIGKILLed again as soon as it is back, and a shard SIGKILLed between receive and write. The job finishes and the
books balance (tests/chaos/ledger.py)."""
from __future__ import annotations

import os
import re
import signal
import time
import uuid
from types import SimpleNamespace

import pytest
from jobs import JobUnderTest
from ledger import check_ledger

from cluster.supervision import RESPAWN_RACE_S
from runbase import faults

STEPS = 40
RESTART_WAIT_S = 60   # for Ray to restart the killed process and for it to log that it started


def started_pids(log_path) -> list[int]:
    """The pids, in order, of each incarnation of the role that logged its start."""
    text = log_path.read_text() if log_path.exists() else ""
    return [int(p) for p in re.findall(r"pid=(\d+) INFO proc: actor-0 started", text)]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, redis_server):
    """The job above, run to its end: (its directory, its output, its Redis client, run id, when the second kill
    came after the first)."""
    from runbase.keys import connect

    run, r, run_id = tmp_path_factory.mktemp("kills") / "run", connect(redis_server.url), f"test-{uuid.uuid4().hex[:8]}"
    job = JobUnderTest(run, r, run_id, "--actors", "2", f"trainer.total_steps={STEPS}", "buffer.ingest_shards=2",
                       "weightsync.timeout_s=5", "cluster.max_restarts=3", "trainer.export_hf=false",
                       "trainer.tensorboard=false", redis_url=redis_server.url)
    log_path = run / "logs" / "actor-0.log"
    try:
        job.wait_step(2)
        ingest = r.hgetall(f"{run_id}:ingest")
        assert {b"address:0", b"address:1"} <= ingest.keys() and ingest[b"address:0"] != ingest[b"address:1"]
        faults.arm(r, run_id, faults.INGEST_KILL_BEFORE_STORE)
        job.wait(lambda: not faults.armed(r, run_id, faults.INGEST_KILL_BEFORE_STORE), "the shard's fault to fire")
        first = job.pid_of("actor-0")
        os.kill(first, signal.SIGKILL)
        t_kill = time.monotonic()
        deadline = t_kill + RESTART_WAIT_S
        while not (pids := [p for p in started_pids(log_path) if p != first]):
            assert time.monotonic() < deadline, "actor-0 was not restarted"
            time.sleep(0.05)
        os.kill(pids[-1], signal.SIGKILL)   # the restarted process, as soon as it is up
        again_after_s = time.monotonic() - t_kill
        assert job.finish() == 0, job.err[-3000:]
    finally:
        job.kill()
    try:
        yield SimpleNamespace(run=run, out=job.out, r=r, run_id=run_id, again_after_s=again_after_s)
    finally:
        r.close()


def test_an_actor_killed_again_right_after_its_restart_counts_twice(killed):
    """A death of its own, counted toward cluster.max_restarts and said, even inside the window where the launcher
    forgives Ray's answers to the call it queued for the restart (cluster/supervision.py RESPAWN_RACE_S)."""
    out = killed.out
    print(f"killed again {killed.again_after_s:.1f} s after the first kill (the forgiving window: {RESPAWN_RACE_S} s)")
    for n in (1, 2):
        assert re.search(rf"actor-0 [^\n]*restarting \({n}/3\)", out), out[-3000:]
    assert out.count("actor-0 died") >= 2, out[-3000:]
    check_ledger(killed.r, killed.run_id, killed.run, steps=STEPS)


def test_a_killed_shard_is_restarted_and_the_books_balance(killed):
    """Restarted under its own role; its actor follows the new address and resends; both shards store into the one
    stream, and nothing is dead-lettered."""
    shards = re.findall(r"(ingest-[01]) died", killed.out)
    assert len(shards) == 1 and re.search(rf"{shards[0]} [^\n]*restarting \(1/3\)", killed.out), killed.out[-3000:]
    logs = {i: (killed.run / "logs" / f"ingest-{i}.log").read_text() for i in (0, 1)}
    assert all("started" in text for text in logs.values())  # both shards served
    books = check_ledger(killed.r, killed.run_id, killed.run, steps=STEPS)
    assert books["deadletter"] == 0
