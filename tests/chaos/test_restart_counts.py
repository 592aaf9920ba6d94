"""An actor that dies again right after its restart is a death of its own: counted toward cluster.max_restarts
and said, even inside the window where the launcher forgives Ray's answers to the call it queued for the
restart (cluster/supervision.py RESPAWN_RACE_S). The job finishes and the books balance."""
from __future__ import annotations

import os
import re
import signal
import time

from jobs import JobUnderTest
from ledger import check_ledger

from cluster.supervision import RESPAWN_RACE_S

STEPS = 40
RESTART_WAIT_S = 60   # for Ray to restart the killed process and for it to log that it started


def started_pids(log_path) -> list[int]:
    """The pids, in order, of each incarnation of the role that logged its start."""
    text = log_path.read_text() if log_path.exists() else ""
    return [int(p) for p in re.findall(r"pid=(\d+) INFO proc: actor-0 started", text)]


def test_an_actor_killed_again_right_after_its_restart_counts_twice(tmp_path, redis_url, r, run_id):
    job = JobUnderTest(tmp_path / "run", r, run_id, "--actors", "2", f"trainer.total_steps={STEPS}",
                       "weightsync.timeout_s=5", "cluster.max_restarts=3", redis_url=redis_url)
    log_path = tmp_path / "run" / "logs" / "actor-0.log"
    try:
        job.wait_step(2)
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
    out = job.out
    print(f"killed again {again_after_s:.1f} s after the first kill (the forgiving window: {RESPAWN_RACE_S} s)")
    assert "restarting (1/3)" in out and "restarting (2/3)" in out, out[-3000:]
    assert out.count("actor-0 died") >= 2, out[-3000:]
    check_ledger(r, run_id, job.run_dir, steps=STEPS)
