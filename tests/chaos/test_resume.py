"""SIGKILL the learner mid-run (groups read, not yet covered by a checkpoint), then --resume; that resumed
run's learner is killed in the middle of its first checkpoint save, and a second --resume starts from the last
complete checkpoint, not the partial one. The run completes, every step counts once, no group is trained
twice, nothing stays pending, the books balance.

(One chain of three jobs: before, the kill during a checkpoint save had a job of its own in test_faults.py,
a fourth job start.)"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time

from runbase import faults
from jobs import JobUnderTest
from ledger import check_ledger, counted_steps, metrics_lines
from learner import metric_names as M

EVERY = 4
# One actor in each job: the chain judges the learner's checkpoints and the books, which one actor's groups exercise
# as well as two; a second actor was ~5 CPU-s of start-up per job, four jobs in a row.
ONE_ACTOR = ("--actors", "1")


def done_summary(job: JobUnderTest) -> dict:
    return json.loads(next(ln for ln in job.out.splitlines() if ln.startswith("done: "))[6:])


def incomplete(ckpts) -> set[str]:
    return {p.name for p in ckpts.iterdir() if not (p / "COMPLETE").exists()} if ckpts.exists() else set()


def test_learner_killed_then_resumed_then_killed_in_a_checkpoint_save(tmp_path, redis_url, r, run_id):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    every = f"trainer.checkpoint_every={EVERY}"
    a = JobUnderTest(run, r, run_id, *ONE_ACTOR, every, "trainer.total_steps=1000000", redis_url=redis_url)
    try:
        a.wait_step(2 * EVERY + 1)
        os.kill(int(r.hget(f"{run_id}:learner", "pid")), signal.SIGKILL)
        assert a.finish(timeout=60) == 1
    finally:
        a.kill()
    assert "learner-0 failed" in a.err, a.err[-2000:]
    killed_a = len(metrics_lines(run))  # lines the first learner wrote
    partial_before = incomplete(ckpts)  # a SIGKILL that lands inside a save leaves one (seen); not judged here

    # the resumed run's learner dies after writing its first checkpoint's shards, before COMPLETE
    faults.arm(r, run_id, faults.LEARNER_KILL_IN_CHECKPOINT)
    t_b = time.time()
    b = JobUnderTest(run, r, run_id, "--resume", *ONE_ACTOR, every, "trainer.total_steps=1000000",
                     redis_url=redis_url)
    try:
        assert b.finish() == 1, b.err[-3000:]
    finally:
        b.kill()
    assert "learner-0 failed" in b.err, b.err[-2000:]
    assert not faults.armed(r, run_id, faults.LEARNER_KILL_IN_CHECKPOINT)
    lines = metrics_lines(run)
    start_b = lines[killed_a][M.STEP]  # the resumed learner's first line
    assert M.VAL_REWARD_INITIAL in lines[killed_a]
    assert start_b >= 2 * EVERY and start_b % EVERY == 0, start_b
    # steps the kill lost (if it hit between checkpoints) are trained again: their groups too
    redone = {g for m in lines[:killed_a] if m[M.STEP] >= start_b for g in m[M.GROUPS_TRAINED]}
    killed_at = start_b + EVERY  # its first save: shards written by this learner, no COMPLETE
    partial = ckpts / f"step-{killed_at:08d}"
    assert incomplete(ckpts) == partial_before | {partial.name}, (incomplete(ckpts), partial_before)
    shards = list(partial.glob("*.distcp"))
    assert shards and all(p.stat().st_mtime >= t_b for p in shards), "the fault should leave shards without COMPLETE"

    # `seen` as a run made before it became a sorted set left it: the resume replaces it (the ingest's store
    # script would fail on the wrong type)
    seen = f"{run_id}:seen"
    ids = r.zrange(seen, 0, -1)
    r.delete(seen)
    r.sadd(seen, *ids)
    steps = killed_at + EVERY
    c = JobUnderTest(run, r, run_id, "--resume", *ONE_ACTOR, every, f"trainer.total_steps={steps}",
                     "trainer.keep_checkpoints=2", redis_url=redis_url)
    try:
        assert c.finish() == 0, c.err[-3000:]
    finally:
        c.kill()
    assert done_summary(c)["start_step"] == killed_at - EVERY  # the last complete one, not the partial one
    counted = counted_steps(run)
    assert [m[M.STEP] for m in counted] == list(range(steps))  # every step counts exactly once
    trained = [g for m in counted for g in m[M.GROUPS_TRAINED]]
    assert len(trained) == len(set(trained))                  # no group trained twice
    assert redone <= set(trained)
    assert r.xpending(f"{run_id}:traj", "learner")["pending"] == 0  # nothing left in flight
    check_ledger(r, run_id, run, steps=steps)
    # trainer.keep_checkpoints=2: the two newest complete ones stay; older ones and the partial save are gone
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{killed_at:08d}", f"step-{steps:08d}"]

    # the newest checkpoint removed by hand: its groups are acked and gone from Redis, so a resume from the one
    # before cannot redo the steps between; refused naming both (not a wait at admission that never ends)
    shutil.rmtree(ckpts / f"step-{steps:08d}")
    d = JobUnderTest(run, r, run_id, "--resume", *ONE_ACTOR, every, f"trainer.total_steps={steps + EVERY}",
                     redis_url=redis_url)
    try:
        assert d.finish(timeout=120) != 0
    finally:
        d.kill()
    assert f"the run's Redis acknowledged the groups of every step up to {steps}" in d.err, d.err[-2000:]
    assert f"newest complete checkpoint in {ckpts} is at step {killed_at}" in d.err
