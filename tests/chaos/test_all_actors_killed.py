"""Every actor SIGKILLed at once: Ray restarts them on the base model at version 0,
too stale for admission; they must get the learner's current weights without a training step (rank 0
sends its last published version to members that joined), or nobody can make a group and the job
hangs. A 2-actor job on one learner rank, and the only actor of a 1-actor job on 2 learner ranks; both
finish their steps and the books balance. Both jobs also skip one step whose update is not finite
(one NaN advantage in rank 0's share, through the fault hook): the step is tried again,
its groups are dead-lettered, and the books count them."""
from __future__ import annotations

import json
import os
import signal

import pytest

from runbase import faults
from jobs import JobUnderTest
from ledger import check_ledger, counted_steps, metrics_lines
from learner import metric_names as M

POISON_AT = 1    # the step whose update is not finite (skipped, then tried again on fresh groups)
KILL_AT = 4      # > max_staleness + 1 (2 + 1): a restarted actor at version 0 is refused leases
AHEAD = 3        # max_staleness + 1: admission lets actors start groups this many steps past the learner
# When the actors die at version v the buffer holds at most the groups of steps up to v + AHEAD; the rest
# need the restarted actors. On idle cores the tiny model's steps take ~50 ms, so the learner may be several
# steps past KILL_AT when the kill lands: 16 more steps keep it far from the end. After the kill: the restarts
# (~1 s), the actors' start (7-20 s on 2 loaded cores), the join publication (< 0.1 s) and the steps fit in 90 s.
STEPS = KILL_AT + 16
AFTER_KILL_S = 120


def pids(job: JobUnderTest, actors: list[str]) -> dict[str, int]:
    return {a: job.pid_of(a) for a in actors}


@pytest.mark.parametrize("actors,learners", [(2, 1), (1, 2)], ids=["2-actors", "1-actor-2-learners"])
def test_every_actor_killed_at_once_the_job_finishes(tmp_path, redis_url, r, run_id, actors, learners):
    names = [f"actor-{i}" for i in range(actors)]
    faults.arm(r, run_id, faults.LEARNER_NAN_AT_STEP, POISON_AT)
    job = JobUnderTest(tmp_path / "run", r, run_id, "--actors", str(actors), "--learners", str(learners),
                       f"trainer.total_steps={STEPS}", "buffer.max_staleness=2", "weightsync.timeout_s=5",
                       redis_url=redis_url)
    try:
        job.wait_step(KILL_AT)
        victims = pids(job, names)
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        killed_at = int(r.get(f"{run_id}:version") or 0)  # no group starts after this (no actor is left)
        assert STEPS > killed_at + AHEAD, f"the learner was at {killed_at}: the buffer could finish the job alone"
        assert job.finish(timeout=AFTER_KILL_S) == 0, job.err[-3000:]
    finally:
        job.kill()
    for a in names:
        assert f"{a} died" in job.out, job.out[-2000:]
    lines = counted_steps(job.run_dir)
    assert lines[-1][M.WS_JOINS] >= 1  # rank 0 sent its last version to the restarted actors
    skipped = [m for m in metrics_lines(job.run_dir) if m.get(M.SKIPPED)]
    assert [(m[M.STEP], m[M.SKIP_REASON]) for m in skipped] == [(POISON_AT, "non-finite loss")]
    assert [m[M.VERSION] for m in lines] == list(range(1, STEPS + 1))  # no version for the skipped step
    books = check_ledger(r, run_id, job.run_dir, steps=STEPS)
    assert books["skipped"] == skipped[0][M.DEAD_LETTERED] == 8  # learner.groups_per_step
    reasons = [f[b"reason"] for _id, f in r.xrange(f"{run_id}:deadletter")]
    assert reasons == [b"skipped_non-finite_loss"] * 8
    # the restarted actors (same ids, new processes) that worked end on the learner's final weights; one
    # restarted as the learner finished (a restarted actor alone can make the 6 steps left) may have got none
    status = json.loads((job.run_dir / "status.json").read_text())
    final = status["checksums"][str(STEPS)]
    assert set(status["members"]) == set(names)
    for a, m in status["members"].items():
        assert m["pid"] != victims[a], f"{a} was not restarted"
        if m["groups"] or m["version"]:
            assert (m["version"], m["checksum"]) == (STEPS, final), a
    assert any(m["groups"] for m in status["members"].values()), "no restarted actor made a group"
