"""Faults against the whole system: Ctrl-C and a killed actor stop everything, named, no orphans."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import psutil
import pytest
import ray_shared
from jobs import JobUnderTest
from ledger import check_ledger

from learner import metric_names as M

RUN_FOREVER = "trainer.total_steps=1000000"
WAIT_S = 180          # for the job to come up and train on a loaded 2-core machine
EXIT_S = 60           # for it to stop after the fault
ORPHAN_GRACE_S = 15   # for killed children to be reaped
# cluster.actor_silent_s of the SIGSTOP tests: their wait for the launcher to notice (the default 15 s is for any
# load; a healthy actor's weight-sync thread beats every 0.5 s, and MEMBER_STALE_S = 3 s already drops a member)
SILENT_S = 6
# Tests whose stop or fault needs no second actor run one: a second was ~5 CPU-s of start-up per job.
ONE_ACTOR = ("--actors", "1")


def launch(tmp_path, *args, preexec_fn=None, own_ray: bool = True):
    """The job as a user starts it, with a Ray of its own (these tests look at the launcher's process tree), or
    joining the tests' shared Ray (tests/ray_shared.py) where a test does not."""
    return subprocess.Popen([sys.executable, "-m", "cluster.start", "--run-dir", str(tmp_path / "run"),
                             RUN_FOREVER, *ray_shared.job_args(own_ray), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=preexec_fn)


def wait_for_training(tmp_path, proc):
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + WAIT_S
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "job never started training"
        time.sleep(0.5)


def wait_for_a_heartbeat_with_groups(tmp_path, proc) -> None:
    """An actor heartbeat (every HEARTBEAT_S) that counts groups made: the final state an interrupted job must
    keep. Training can be 2 steps in before any actor has beaten since its first group (seen: Ctrl-C then, and
    every member in status.json still at 0 groups)."""
    from runbase.keys import connect

    job = json.loads((tmp_path / "run" / "job.json").read_text())
    r = connect(job["redis_url"])
    deadline = time.monotonic() + WAIT_S
    while not any(m.get("groups", 0) > 0 and m.get("busy_s", 0) > 0
                  for m in map(json.loads, r.hvals(f"{job['run_id']}:members"))):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no actor heartbeat with groups"
        time.sleep(0.2)
    r.close()


def member_pid(r, run_id: str, actor: str) -> int:
    """The pid an actor reported; training can start before a slower actor's first heartbeat."""
    deadline = time.monotonic() + WAIT_S
    while (raw := r.hget(f"{run_id}:members", actor)) is None:
        assert time.monotonic() < deadline, f"{actor} never reported"
        time.sleep(0.2)
    return json.loads(raw)["pid"]


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def assert_all_gone(procs):
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while (alive := [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]):
        if time.monotonic() > deadline:
            pytest.fail(f"orphans left: {[(p.pid, p.name()) for p in alive]}")
        time.sleep(0.5)


def test_ctrl_c_stops_every_process(tmp_path):
    proc = launch(tmp_path, *ONE_ACTOR)
    try:
        wait_for_training(tmp_path, proc)
        wait_for_a_heartbeat_with_groups(tmp_path, proc)
        children = descendants(proc.pid)
        assert any("redis-server" in p.name() for p in children)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the whole foreground group
        out, err = proc.communicate(timeout=EXIT_S)
        assert proc.returncode == 130
        assert "interrupted" in err
        # the local Redis is not hit by the group's SIGINT and taken for a crash during the stop
        assert "redis-server died" not in out + err
        assert_all_gone(children)
        # the interrupted job's final state, as a finished one leaves it: the actors' last heartbeats
        status = json.loads((tmp_path / "run" / "status.json").read_text())
        assert any(m.get("groups", 0) > 0 and m["busy_s"] > 0 for m in status["members"].values()), status
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def stopped_by(tmp, sig, *args) -> tuple[int, str]:
    """A job stopped by `sig` once it trains, its stdout's reader gone at once (`| head -1`): (its exit code, its
    stderr), every process gone. The callers name a Ray that is not there in RAY_ADDRESS: the job starts its own."""
    proc = launch(tmp, *ONE_ACTOR, *args,
                  preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # a suite under nohup
    try:
        proc.stdout.close()   # the launcher's next print (the progress line, every few seconds) finds no reader
        wait_for_training(tmp, proc)
        children = descendants(proc.pid)
        if sig == signal.SIGHUP:
            os.killpg(proc.pid, sig)   # the terminal's hang-up reaches its whole foreground group
        else:
            proc.send_signal(sig)      # a scheduler's, to the launcher alone
        _, err = proc.communicate(timeout=EXIT_S)
        assert_all_gone(children)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def assert_stopped_like_ctrl_c(run, sig, code: int, err: str) -> None:
    """Stopped as Ctrl-C stops a job (not ray.init's own handler, which exits 1 without the "interrupted" line),
    its final state written; the progress line's BrokenPipeError did not end it with a traceback."""
    assert code == 128 + sig, err[-2000:]
    assert "interrupted" in err and "stdout can no longer be written" in err, err[-2000:]
    assert json.loads((run / "status.json").read_text())["members"]


@pytest.fixture(scope="module")
def sigtermed(tmp_path_factory):
    """A profiled job (cluster.profile=true) stopped by a scheduler's SIGTERM to the launcher alone (as `timeout`
    sends it): (its run directory, exit code, stderr)."""
    tmp = tmp_path_factory.mktemp("sigterm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ADDRESS", "127.0.0.1:9")  # nothing listens there: a local job must not join it
        code, err = stopped_by(tmp, signal.SIGTERM, "cluster.profile=true")
    return SimpleNamespace(run=tmp / "run", code=code, err=err)


def test_sigterm_stops_every_process_like_ctrl_c(sigtermed):
    assert_stopped_like_ctrl_c(sigtermed.run, signal.SIGTERM, sigtermed.code, sigtermed.err)


def test_a_signalled_profiled_job_keeps_every_profile(sigtermed):
    """Each process returns on the stop keys and writes its profile before the launcher kills what is left (a kill
    at once would lose every profile of the run)."""
    profiles = sigtermed.run / "profiles"
    written = sorted(p.name for p in profiles.glob("*.txt")) if profiles.exists() else []
    for role in ("learner-0", "actor-0", "ingest"):
        assert f"{role}.txt" in written, (written, sigtermed.err[-2000:])
    assert "cumulative" in (profiles / "learner-0.txt").read_text()   # a pstats summary, not an empty file


def test_hangup_stops_every_process_like_ctrl_c(tmp_path, monkeypatch):
    """A closing terminal's SIGHUP to the whole group (by default it kills the launcher at once: no status.json)."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    code, err = stopped_by(tmp_path, signal.SIGHUP)
    assert_stopped_like_ctrl_c(tmp_path / "run", signal.SIGHUP, code, err)


@pytest.mark.parametrize("scaled", [False, True], ids=["started", "scaled"])
def test_losing_every_actor_fails_the_job_naming_them(tmp_path, redis_url, r, run_id, scaled):
    """Actors that used up their restarts are not replaced, also once cluster.scale set a target: each lowers
    the target by one (before, the launcher started a fresh actor with a fresh budget for each, forever)."""
    proc = launch(tmp_path, "--redis-url", redis_url, f"cluster.run_id={run_id}", "cluster.max_restarts=0")
    try:
        wait_for_training(tmp_path, proc)
        if scaled:   # the actor count cluster.scale keeps (here the one the job started with)
            res = subprocess.run([sys.executable, "-m", "cluster.scale", "--run-dir", str(tmp_path / "run"),
                                  "--actors", "2"], capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr
        children = descendants(proc.pid)
        for actor in ("actor-0", "actor-1"):  # one lost actor is survived; the last one is not
            os.kill(member_pid(r, run_id, actor), signal.SIGKILL)
        out, err = proc.communicate(timeout=EXIT_S)
        assert proc.returncode == 1
        assert "actor-0 died" in out and "actor-1 died" in out, out[-3000:]
        assert "no rollout actor is left" in err, err[-3000:]
        assert ("actor target lowered to 0" in out) == scaled, out[-3000:]
        assert "scaled up" not in (tmp_path / "run" / "logs" / "launcher.log").read_text()
        assert_all_gone(children)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_silent_actor_is_detected_and_its_leases_reclaimed(tmp_path, redis_url, r, run_id):
    """SIGSTOP (a hung engine): no exit, no error, just silence. The launcher notices within the
    silence timeout, kills it, returns its leased prompts, and the run finishes on the other actor."""
    proc = launch(tmp_path, "--redis-url", redis_url, f"cluster.run_id={run_id}", "cluster.max_restarts=0",
                  "trainer.total_steps=60", f"cluster.actor_silent_s={SILENT_S}", own_ray=False)
    try:
        wait_for_training(tmp_path, proc)
        victim = member_pid(r, run_id, "actor-0")
        os.kill(victim, signal.SIGSTOP)
        t0, stopped_at = time.monotonic(), time.time()
        # what it holds now stays frozen with it (it may be between batches, holding nothing), except groups
        # already on their way to the ingest, which may still be stored (checked below, lease by lease)
        held = {g.decode() for g, v in r.hgetall(f"{run_id}:leases").items() if json.loads(v)["actor"] == "actor-0"}
        while r.hexists(f"{run_id}:members", "actor-0"):
            assert time.monotonic() - t0 < SILENT_S + 15, "silent actor never detected"
            assert proc.poll() is None
            time.sleep(0.5)
        step_at = json.loads(r.get(f"{run_id}:metrics"))[M.STEP]
        while json.loads(r.get(f"{run_id}:metrics"))[M.STEP] < step_at + 3:  # training goes on
            assert proc.poll() is None and time.monotonic() - t0 < WAIT_S
            time.sleep(0.5)
        leases = [json.loads(v) for v in r.hvals(f"{run_id}:leases")]
        assert all(lease["actor"] != "actor-0" for lease in leases)
        assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
        out, err = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    books = check_ledger(r, run_id, tmp_path / "run", steps=60)
    # every id it held is in `seen`: stored (groups already on their way, within moments of the stop) or
    # marked when its lease was returned at detection, SILENT_S later (so a late copy is not stored)
    scores = {g: r.zscore(f"{run_id}:seen", g) for g in held}
    assert None not in scores.values(), scores
    reclaimed = {g for g, t in scores.items() if t > stopped_at + SILENT_S / 2}
    returned = int(re.search(r"actor-0 [^\n]*; (\d+) leased groups returned", out).group(1))
    assert len(reclaimed) <= returned <= books["returned"]  # the silent actor's other leases went back


def test_a_silent_actor_killed_by_the_launcher_counts_one_restart(tmp_path, redis_url, r, run_id):
    """The launcher's own SIGKILL of a silent actor is one death: the run() it queues for the restarted process
    can reach the dead one before Ray noticed ("temporarily unavailable"); counted as a second death, that answer
    would make one SIGSTOP drop the actor for good with cluster.max_restarts=1 instead of restarting it (and use
    up two restarts with 3)."""
    from cluster.launch import RESPAWN_RACE_S

    proc = launch(tmp_path, "--redis-url", redis_url, f"cluster.run_id={run_id}", "cluster.max_restarts=1",
                  f"cluster.actor_silent_s={SILENT_S}", *ONE_ACTOR, own_ray=False)
    try:
        wait_for_training(tmp_path, proc)
        victim = member_pid(r, run_id, "actor-0")
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        while r.hexists(f"{run_id}:members", "actor-0"):
            assert time.monotonic() - t0 < SILENT_S + 15, "silent actor never detected"
            assert proc.poll() is None
            time.sleep(0.5)
        # restarted under the same id, within its one restart: it reports again from a new process
        launcher_log = tmp_path / "run" / "logs" / "launcher.log"
        while not r.hexists(f"{run_id}:members", "actor-0"):
            assert "actor-0 died" not in launcher_log.read_text(), "one SIGSTOP counted as a second death"
            assert proc.poll() is None and time.monotonic() - t0 < WAIT_S, "actor-0 never came back"
            time.sleep(0.2)
        back = member_pid(r, run_id, "actor-0")
        assert back != victim
        time.sleep(RESPAWN_RACE_S)   # a late answer for the killed process would have been counted by now
        log = launcher_log.read_text()
        assert log.count("actor-0 went silent") == 1 and "restarting (1/1)" in log, log[-3000:]
        assert "actor-0 died" not in log and "used up its restarts" not in log, log[-3000:]
        assert r.hexists(f"{run_id}:members", "actor-0") and proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=EXIT_S)
        assert proc.returncode == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# One job, two hung reward calls: the actor's first call of all never returns, the learner's first held-out call
# returns after HANG_S. Each is watched on its own (cluster.actor_stall_s, cluster.learner_stall_s); an actor
# waiting at admission while the learner is held still beats, so neither hang sets off the other's watch.
ACTOR_STALL_S, LEARNER_STALL_S = 5, 4
HANG_S = 3 * LEARNER_STALL_S
HANG_STEPS = 20   # one actor: without the hung actor's kill no step could be trained after its hang
HANG_PY = """import os, sys, time
def hang_once(marker, seconds):
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        time.sleep(seconds)
    except FileExistsError:
        pass
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if 'actors.rollout' in sys.modules:   # an actor: its first call of all hangs
        hang_once({actor!r}, 10**6)
    elif 'learner.train' in sys.modules:  # the learner's held-out evaluation: its first call hangs, then goes on
        hang_once({learner!r}, {hang_s})
    return float(solution_str.strip() == ground_truth)
"""


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory, redis_server):
    """The job above, run to its end: (its directory, its output, its Redis client, run id, markers)."""
    from runbase.keys import connect

    tmp = tmp_path_factory.mktemp("hung")
    markers = {"actor": str(tmp / "actor-hung-once"), "learner": str(tmp / "learner-hung-once")}
    (tmp / "hang.py").write_text(HANG_PY.format(**markers, hang_s=HANG_S))
    r, run_id = connect(redis_server.url), f"test-{uuid.uuid4().hex[:8]}"
    job = JobUnderTest(tmp / "run", r, run_id, "--actors", "1", f"trainer.total_steps={HANG_STEPS}",
                       f"data.reward_fn_path={tmp}/hang.py", f"cluster.actor_stall_s={ACTOR_STALL_S}",
                       f"cluster.learner_stall_s={LEARNER_STALL_S}", redis_url=redis_server.url)
    try:
        code = job.finish()
    finally:
        job.kill()
    try:
        assert code == 0, job.err[-3000:]
        yield SimpleNamespace(run=tmp / "run", out=job.out, r=r, run_id=run_id, markers=markers)
    finally:
        r.close()


def test_an_actor_whose_reward_function_hangs_is_killed_and_restarted_naming_the_stall(hung_job):
    """A reward function that never returns stalls its actor's loop while the actor's weight-sync thread still
    beats: unwatched, the job would stop training and wait forever, saying nothing. Past cluster.actor_stall_s the launcher
    kills and restarts it, naming the stall, and the actor's log holds its stacks at the stall (the hung call in
    them); the job ends with its books balanced (the hung group's lease was returned)."""
    assert os.path.exists(hung_job.markers["actor"])
    gone = re.search(rf"(actor-\d) made no progress for \d+s \(cluster\.actor_stall_s={ACTOR_STALL_S}", hung_job.out)
    assert gone and re.search(rf"{gone.group(1)} [^\n]*restarting \(1/3\)", hung_job.out), hung_job.out[-3000:]
    log = (hung_job.run / "logs" / f"{gone.group(1)}.log").read_text()
    assert "in compute_score" in log and "hang.py" in log, log[-3000:]
    books = check_ledger(hung_job.r, hung_job.run_id, hung_job.run, steps=HANG_STEPS)
    assert books["returned"] >= 1


def test_a_learner_whose_held_out_reward_function_hangs_is_reported_naming_the_phase(hung_job):
    """The learner scores its held-out evaluation with the job's reward function; one that hangs there stopped
    training while the launcher said nothing (actors are watched, the learner was not). Past
    cluster.learner_stall_s the launcher names the phase and the step, once, and rank 0's log holds its stacks at
    the stall (the hung call in them); here the call returns after a while and the job finishes, books balanced."""
    assert os.path.exists(hung_job.markers["learner"])
    said = re.findall(r"learner-0 has been in its evaluate phase \(weights version 0\) for \d+s "
                      rf"\(cluster\.learner_stall_s={LEARNER_STALL_S}:", hung_job.out)
    assert len(said) == 1, hung_job.out[-3000:]   # once per stall, not every monitor tick
    log = (hung_job.run / "logs" / "learner-0.log").read_text()
    assert "in compute_score" in log and "hang.py" in log, log[-3000:]
    check_ledger(hung_job.r, hung_job.run_id, hung_job.run, steps=HANG_STEPS)
