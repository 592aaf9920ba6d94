"""Every actor SIGKILLed at once (issue 19 item 2): Ray restarts them on the base model at version 0,
too stale for admission; they must get the learner's current weights without a training step (rank 0
sends its last published version to members that joined), or nobody can make a group and the job
hangs. A 2-actor job on one learner rank, and the only actor of a 1-actor job on 2 learner ranks; both
finish their steps and the books balance."""
from __future__ import annotations

import json
import os
import signal

import pytest

from jobs import JobUnderTest
from ledger import check_ledger, counted_steps

KILL_AT = 4      # > max_staleness + 1 (2 + 1): a restarted actor at version 0 is refused leases
STEPS = KILL_AT + 3
# After the kill: the restarts (~1 s), the actors' start (model load, 7-20 s on 2 loaded cores), the
# join publication (< 0.1 s) and 3 steps (~1 s each) fit in 30 s; a hang costs no more than this.
AFTER_KILL_S = 90


def pids(job: JobUnderTest, actors: list[str]) -> dict[str, int]:
    return {a: job.pid_of(a) for a in actors}


@pytest.mark.parametrize("actors,learners", [(2, 1), (1, 2)], ids=["2-actors", "1-actor-2-learners"])
def test_every_actor_killed_at_once_the_job_finishes(tmp_path, redis_url, r, run_id, actors, learners):
    names = [f"actor-{i}" for i in range(actors)]
    job = JobUnderTest(tmp_path / "run", r, run_id, "--actors", str(actors), "--learners", str(learners),
                       f"trainer.total_steps={STEPS}", "buffer.max_staleness=2", "weightsync.timeout_s=5",
                       redis_url=redis_url)
    try:
        job.wait_step(KILL_AT)
        victims = pids(job, names)
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        assert job.finish(timeout=AFTER_KILL_S) == 0, job.err[-3000:]
    finally:
        job.kill()
    for a in names:
        assert f"{a} died" in job.out, job.out[-2000:]
    lines = counted_steps(job.run_dir)
    assert lines[-1]["ws_joins"] >= 1  # rank 0 sent its last version to the restarted actors
    check_ledger(r, run_id, job.run_dir, steps=STEPS)
    # the restarted actors (same ids, new processes) end on the learner's final weights
    status = json.loads((job.run_dir / "status.json").read_text())
    final = status["checksums"][str(STEPS)]
    assert set(status["members"]) == set(names)
    for a, m in status["members"].items():
        assert m["pid"] != victims[a], f"{a} was not restarted"
        assert (m["version"], m["checksum"]) == (STEPS, final), a
