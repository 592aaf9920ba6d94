"""Faults inside a running job, one test each, every one ending with the books balanced
(tests/chaos/ledger.py): the ingest SIGKILLed between receive and write, the Redis server
SIGKILLed under load and restarted from its AOF, the learner paused for 15 s, and resume parity on
recorded trajectories (the learner killed in the middle of a checkpoint save: tests/chaos/test_resume.py)."""
from __future__ import annotations

import json
import os
import signal
import time

import psutil

from runbase import faults
from jobs import JobUnderTest
from ledger import check_ledger, counted_steps
from learner import metric_names as M

# The learner is stopped for BOUND_S + PLATEAU_S: the actors hit the bound in seconds (measured: their group count
# stopped rising 2 s into the pause), and the plateau judged is 10 s sampled every second (the same 10 samples as the
# former 20 s sampled every 2 s; before that PAUSE_S = 40, whose first half was 20 s of waiting on a bound reached
# within 2).
BOUND_S = 5           # for the actors to reach the admission bound after the pause starts (2.5x the 2 s measured)
PLATEAU_S = 10        # then this long the stream, Redis memory and the actors' group counts must stay flat
PAUSE_S = BOUND_S + PLATEAU_S
SAMPLE_S = 1.0        # how often the paused run is measured


def actor_logs(run_dir) -> str:
    return "".join(p.read_text() for p in (run_dir / "logs").glob("actor-*.log"))


def test_ingest_killed_between_receive_and_write_then_redis_killed_under_load(tmp_path):
    """Two faults in one job with its own Redis: the ingest dies between receive and write (restarted, the group
    it swallowed resent, nothing dead-lettered); once it serves again the Redis server is SIGKILLed under load
    and restarted from its AOF, which holds every acknowledged group and balances. (Each fault had a job of its
    own before.)"""
    from cluster.redis_local import LocalRedis

    run_id = "ingest-redis-kill"
    job = JobUnderTest(tmp_path / "run", None, run_id, "trainer.total_steps=40")
    try:
        r = job.connect()
        job.wait_step(3)
        address = r.hget(f"{run_id}:ingest", "address")
        faults.arm(r, run_id, faults.INGEST_KILL_BEFORE_STORE)
        job.wait(lambda: not faults.armed(r, run_id, faults.INGEST_KILL_BEFORE_STORE), "the fault to fire")
        job.wait(lambda: r.hget(f"{run_id}:ingest", "address") != address, "the ingest to serve again")
        s = job.step()
        job.wait_step(s + 1)
        server = next(p for p in psutil.Process(job.proc.pid).children(recursive=True)
                      if p.name().startswith("redis-server"))
        stored_before = r.zcard(f"{run_id}:seen")
        assert job.step() < 40 - 5, "the Redis kill should land under load, well before the end"
        server.kill()
        assert job.finish() == 0, job.err[-3000:]
    finally:
        job.kill()
    assert "ingest died" in job.out and "restarting (1/3)" in job.out, job.out[-2000:]
    assert "the ingest moved" in actor_logs(job.run_dir)  # the group it swallowed was resent
    assert "redis-server died; restarting from its AOF" in job.out, job.out[-2000:]
    # the job stopped its server; the AOF it left holds every acknowledged group and balances
    again = LocalRedis(job.run_dir / "redis")
    try:
        from runbase.keys import connect

        r = connect(again.url)
        assert r.zcard(f"{run_id}:seen") > stored_before
        books = check_ledger(r, run_id, job.run_dir, steps=40)
        assert books["deadletter"] == 0
    finally:
        again.stop()


def test_paused_learner_bounds_memory_and_actors_wait(tmp_path, redis_url, r, run_id):
    """SIGSTOP the learner for PAUSE_S: actors fill the buffer up to the staleness bound and
    wait there; the stream and Redis memory stop growing; afterwards nothing was dropped."""
    s, G = 2, 4
    job = JobUnderTest(tmp_path / "run", r, run_id, "trainer.total_steps=20", f"buffer.max_staleness={s}",
                       f"learner.groups_per_step={G}", redis_url=redis_url)
    learner = None
    try:
        job.wait_step(2)
        learner = int(r.hget(f"{run_id}:learner", "pid"))
        os.kill(learner, signal.SIGSTOP)
        samples, t0 = [], time.monotonic()
        while time.monotonic() - t0 < PAUSE_S:
            groups = sum(json.loads(m)["groups"] for m in r.hvals(f"{run_id}:members"))
            samples.append((time.monotonic() - t0, r.xlen(f"{run_id}:traj"), r.info("memory")["used_memory"], groups))
            assert job.proc.poll() is None
            time.sleep(SAMPLE_S)
        os.kill(learner, signal.SIGCONT)
        assert job.finish() == 0, job.err[-3000:]
    finally:
        if learner:
            try:
                os.kill(learner, signal.SIGCONT)
            except ProcessLookupError:
                pass
        job.kill()
    # admission: started < (v + s + 1) * G, and the learner holds at most one batch read: bounded
    assert max(x for _t, x, _m, _g in samples) <= (s + 2) * G
    late = [x for x in samples if x[0] > BOUND_S]  # long after the actors reached the bound
    assert len({g for *_rest, g in late}) == 1, "actors kept producing while the learner was stopped"
    mem = [m for _t, _x, m, _g in late]
    assert max(mem) - min(mem) < 2**20, f"Redis memory grew while paused: {min(mem)} -> {max(mem)}"
    books = check_ledger(r, run_id, job.run_dir, steps=20)
    # nothing dropped silently: any group that arrived too stale (a slow actor's, in arrival
    # order) was counted by the step that dropped it
    assert books["dropped"] == sum(m[M.DROPPED_STALE] for m in counted_steps(job.run_dir))


def test_resume_parity_on_recorded_trajectories(tmp_path, redis_url, r, run_id):
    """N steps straight == N/2 steps, a crash, and --resume: bit-identical weights and losses, on the same
    recorded batches with the same seed. The straight run is the live run that recorded them (a replay of
    them straight, without a crash, was a fourth job: the crashed run's own steps before the crash are that)."""
    n = 8

    def run(name, *args):
        job = JobUnderTest(tmp_path / name, r, f"{run_id}-{name}", *args, redis_url=redis_url)
        try:
            code = job.finish()
        finally:
            job.kill()
        return job, code

    live, code = run("live", "--actors", "1", f"trainer.total_steps={n}", "trainer.record_batches=true")
    assert code == 0, live.err[-3000:]
    replay = ("--actors", "0", f"buffer.replay_dir={tmp_path / 'live' / 'batches'}", f"trainer.total_steps={n}",
              f"trainer.checkpoint_every={n // 2}")
    faults.arm(r, f"{run_id}-crashed", faults.LEARNER_KILL_AT_STEP, n // 2 + 2)  # between checkpoints
    # the profiler changes no number: step 2 (before the checkpoint the resume starts from) is profiled
    crashed, code = run("crashed", *replay, "trainer.profile_steps=[2,2]")
    assert code == 1 and "learner-0 failed" in crashed.err, crashed.err[-2000:]
    prof = tmp_path / "crashed" / "profiles" / "learner-rank0-steps-2-2"
    summary = (prof.parent / (prof.name + ".txt")).read_text()
    assert summary.startswith("learner loop iterations 2-2: wall") and "aten::" in summary
    assert (prof.parent / (prof.name + ".trace.json.gz")).stat().st_size > 0
    resumed, code = run("crashed", *replay, "--resume")
    assert code == 0, resumed.err[-3000:]
    summary = json.loads(next(ln for ln in resumed.out.splitlines() if ln.startswith("done: "))[6:])
    assert summary["start_step"] == n // 2  # the checkpoint before the crash: steps 0..3 are the crashed run's

    def final(name):
        return json.loads((tmp_path / name / "status.json").read_text())["checksums"][str(n)]

    assert final("crashed") == final("live")
    losses = {name: [m[M.LOSS] for m in counted_steps(tmp_path / name)] for name in ("live", "crashed")}
    assert losses["crashed"] == losses["live"] and len(losses["live"]) == n
