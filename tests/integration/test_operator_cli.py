"""Operator commands against a job: one that has ended gets a one-line answer (no Redis traceback, in
seconds), and the progress line shows the actor target cluster.scale set, not the starting count."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("command", [["cluster.scale", "--actors", "1"], ["cluster.export"], ["cluster.status"]])
def test_operator_commands_on_an_ended_job_say_so(tmp_path, command):
    with socket.socket() as s:  # a port nothing listens on: the job's Redis is gone with the job
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "job.json").write_text(json.dumps({"run_id": "ended", "redis_url": f"redis://127.0.0.1:{port}/0"}))
    res = subprocess.run([sys.executable, "-m", command[0], "--run-dir", str(tmp_path), *command[1:]],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "cannot reach the job" in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("command", [["cluster.scale", "--actors", "1"], ["cluster.export"], ["cluster.status"]])
def test_operator_commands_on_an_ended_job_whose_redis_lives_on_say_so(tmp_path, redis_url, r, run_id, command):
    """With --redis-url the job's Redis outlives it: the launcher marks the end, and a scale on the ended job
    (answered "actor target set", a later --resume would run that many actors) is refused."""
    from runbase.keys import Keys

    (tmp_path / "job.json").write_text(json.dumps({"run_id": run_id, "redis_url": redis_url}))
    r.set(Keys(run_id).ended, repr(1.0e9))
    res = subprocess.run([sys.executable, "-m", command[0], "--run-dir", str(tmp_path), *command[1:]],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert f"run {run_id} ended at 2001-09-" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not r.exists(Keys(run_id).scale_target) and not r.exists(Keys(run_id).export)


@pytest.mark.parametrize("command", [["cluster.scale", "--actors", "1"], ["cluster.export"], ["cluster.status"]])
def test_operator_commands_on_an_ended_job_whose_port_another_redis_took_say_so(tmp_path, redis_url, r, run_id,
                                                                                 command):
    """A local job's Redis ends with it; its port, in job.json, may later be another job's Redis. There the run
    has no keys: scale answered "actor target set" (exit 0) and status printed an empty job."""
    from runbase.keys import Keys

    other = Keys(f"{run_id}-other")   # the job that now owns the port
    r.hset(other.startup, "launcher:launched", "1.0")
    (tmp_path / "job.json").write_text(json.dumps({"run_id": run_id, "redis_url": redis_url}))
    res = subprocess.run([sys.executable, "-m", command[0], "--run-dir", str(tmp_path), *command[1:]],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert f"holds no run {run_id}" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not r.exists(Keys(run_id).scale_target) and not r.exists(Keys(run_id).export)
    assert r.keys(f"{run_id}:*") == []   # nothing written under the ended run's name


def _ended_run(tmp_path, how: str, code: int) -> None:
    """A run directory as the launcher leaves it: job.json, then status.json with its `ended` record last."""
    from cluster.rundir import record_end

    (tmp_path / "job.json").write_text(json.dumps({"run_id": "r1", "redis_url": "redis://127.0.0.1:9/0"}))
    (tmp_path / "status.json").write_text(json.dumps({
        "version": 20, "val_reward": {"0": 0.375, "20": 0.441},
        "members": {"actor-0": {"version": 20, "groups": 84}, "actor-1": {"version": 20, "groups": 80}}}))
    record_end(tmp_path, how, "trainer.total_steps=20 reached" if code == 0 else "learner-0 failed: CUDA OOM", code)


@pytest.mark.parametrize("how,code", [("finished", 0), ("failed", 1)])
def test_status_of_an_ended_run_prints_its_final_state_with_its_own_exit_code(tmp_path, how, code):
    _ended_run(tmp_path, how, code)
    res = subprocess.run([sys.executable, "-m", "cluster.status", "--run-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == (0 if how == "finished" else 3), (res.stdout, res.stderr)
    out = res.stdout
    assert f"{how} at" in out and f"(exit {code})" in out and "version 20 (steps trained)" in out, out
    assert "0.3750 at version 0 -> 0.4410 at version 20" in out and "actor-1: version 20, 80 groups" in out, out
    assert ("reached" in out) if how == "finished" else ("CUDA OOM" in out), out
    js = subprocess.run([sys.executable, "-m", "cluster.status", "--run-dir", str(tmp_path), "--json"],
                        capture_output=True, text=True, timeout=60)
    assert json.loads(js.stdout)["ended"]["how"] == how


@pytest.mark.parametrize("command", [["cluster.scale", "--actors", "1"], ["cluster.export"]])
def test_scale_and_export_on_an_ended_run_say_plainly_it_has_ended(tmp_path, command):
    _ended_run(tmp_path, "finished", 0)
    res = subprocess.run([sys.executable, "-m", command[0], "--run-dir", str(tmp_path), *command[1:]],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "the run has ended" in res.stderr and "finished at" in res.stderr, res.stderr
    assert "is it running?" not in res.stderr and "Traceback" not in res.stderr


def test_a_resumed_run_is_not_taken_for_its_ended_predecessor(tmp_path):
    """--resume rewrites job.json as its job starts: the old `ended` record then no longer speaks for the run."""
    import os

    from cluster.rundir import ended_state

    _ended_run(tmp_path, "interrupted", 130)
    assert ended_state(tmp_path)["ended"]["exit_code"] == 130
    later = json.loads((tmp_path / "status.json").read_text())["ended"]["at"] + 5
    os.utime(tmp_path / "job.json", (later, later))
    assert ended_state(tmp_path) is None


@pytest.mark.parametrize("command", [["cluster.scale", "--actors", "1"], ["cluster.status"]])
def test_operator_commands_give_up_on_a_port_that_never_answers(tmp_path, command):
    """A listener that accepts and never replies (a stopped Redis, or not Redis at all) hung every operator
    command forever: one reply timeout now, then the one-line error."""
    import threading
    import time

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        conns = []
        threading.Thread(target=lambda: conns.append(srv.accept()), daemon=True).start()
        (tmp_path / "job.json").write_text(json.dumps(
            {"run_id": "mute", "redis_url": f"redis://127.0.0.1:{srv.getsockname()[1]}/0"}))
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", command[0], "--run-dir", str(tmp_path), *command[1:]],
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "cannot reach the job (Timeout reading" in res.stderr, res.stderr
    assert time.monotonic() - t0 < 30, "gave up, but only after retrying the timeout"


def test_scale_refuses_an_actor_count_no_cluster_holds(tmp_path):
    from cluster.scale import MAX_ACTORS

    res = subprocess.run([sys.executable, "-m", "cluster.scale", "--run-dir", str(tmp_path), "--actors",
                          str(MAX_ACTORS + 1)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and f"--actors must be in 1..{MAX_ACTORS}" in res.stderr, res.stderr


def test_status_watch_ends_with_the_job(tmp_path, redis_url, r, run_id):
    """`cluster.status --watch` while the job ends: a line saying so and exit 0 (it was a Redis traceback)."""
    import time

    from runbase.keys import Keys

    (tmp_path / "job.json").write_text(json.dumps({"run_id": run_id, "redis_url": redis_url}))
    r.hset(Keys(run_id).startup, "launcher:launched", repr(time.time()))   # what a launcher writes first
    proc = subprocess.Popen([sys.executable, "-m", "cluster.status", "--run-dir", str(tmp_path), "--watch"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # its first frame: it is watching (a fixed 3 s sleep assumed it started by then; the end marked before
        # its first look is another case, an ended job: exit 2)
        assert proc.stdout.readline(), proc.communicate()
        assert proc.poll() is None   # watching a job that runs
        r.set(Keys(run_id).ended, repr(time.time()))
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert out.rstrip().endswith(f"run {run_id} ended; its final state is in its run directory's status.json"), out


def test_progress_line_shows_the_scaled_actor_target(r, run_id):
    from cluster.config import load_config
    from cluster.progress import Progress
    from runbase.keys import Keys

    keys = Keys(run_id)
    progress = Progress(load_config(overrides=["cluster.actors=2"]), r, keys)
    assert "actors alive 0/2" in progress.line()
    r.set(keys.scale_target, 1)
    assert "actors alive 0/1" in progress.line()


def test_progress_line_while_starting_says_where_the_start_is(r, run_id):
    """Before the first step: seconds since launch, actor engines built, what the learner is doing (the
    processes' start-up marks), so a minute of vLLM start-up on a GPU is not a silent wait."""
    import time

    from cluster.config import load_config
    from cluster.progress import Progress
    from runbase.keys import Keys, mark_startup

    keys = Keys(run_id)
    progress = Progress(load_config(overrides=["cluster.actors=2"]), r, keys)
    assert progress.line() == "starting: actors alive 0/2"   # the launcher has not marked its launch yet
    r.hset(keys.startup, "launcher:launched", repr(time.time() - 42))
    assert progress.line().startswith("starting 42 s (0/2 actor engines built, learner loading): actors alive 0/2")
    mark_startup(r, keys, "actor-1", "engine")
    mark_startup(r, keys, "learner-0", "ready")
    assert "(1/2 actor engines built, learner evaluating the initial weights)" in progress.line()
    mark_startup(r, keys, "evaluator", "engine")
    mark_startup(r, keys, "learner-0", "initial_eval")
    assert "learner waiting for its first batch, evaluator ready)" in progress.line()


def test_progress_and_status_read_the_namespaced_metrics_line(r, run_id):
    from cluster.config import load_config
    from cluster.progress import Progress
    from cluster.status import collect, render
    from learner import metric_names as M
    from runbase.keys import Keys

    keys = Keys(run_id)
    line = {M.STEP: 4, M.VERSION: 5, M.REWARD_MEAN: 0.625, M.STALENESS_MEAN: 1.5, M.STALENESS_MAX: 2,
            M.STALENESS_HIST: [1, 2, 5], M.DROPPED_STALE: 3, M.SAMPLES_PER_S: 40.0, M.TOKENS_PER_S: 900.0,
            M.WAIT_S: 0.25, M.VAL_REWARD: 0.5, M.WS_EPOCH: 7}
    r.set(keys.metrics, json.dumps(line))  # the learner's latest line, as MetricsWriter stores it
    text = Progress(load_config(overrides=["trainer.total_steps=10"]), r, keys).line()
    assert text.startswith("step 5/10 | reward 0.625 | staleness 1.50 (max 2, dropped 3) | 40 samples/s 900 tok/s")
    s = collect(r, keys)
    assert s["learner"] == {"step": 4, "version": 5, "samples_per_s": 40.0, "tokens_per_s": 900.0, "wait_s": 0.25,
                            "reward_mean": 0.625, "val_reward": 0.5}
    assert s["staleness_hist"] == [1, 2, 5] and s["weights"]["epoch"] == 7
    assert "reward 0.625" in render(s)


def test_a_fresh_job_on_a_redis_that_holds_its_run_id_is_refused(tmp_path, redis_url, r, run_id):
    """Two launchers with one cluster.run_id on one --redis-url (different run dirs) shared a namespace: the
    second's start-up deleted the first's ingest address, stop flags and memberships, both trained from one
    stream, and the second failed with "ingest exited before the learner finished". A fresh job is refused
    before anything starts, naming the id; nothing of the run already there is touched."""
    from runbase.keys import Keys

    k = Keys(run_id)
    r.hset(k.startup, "launcher:launched", repr(1.0e9))   # what the first launcher wrote
    r.hset(k.members, "actor-0", "{}")
    r.set(k.ingest, "x")
    res = subprocess.run([sys.executable, "-m", "cluster.start", "--run-dir", str(tmp_path / "second"),
                          f"cluster.run_id={run_id}", "--redis-url", redis_url, "trainer.total_steps=1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"cluster.run_id {run_id}: the Redis at {redis_url} already holds a run of that id (launched 2001-09-" \
           in res.stderr + res.stdout, res.stderr[-3000:]
    assert r.hget(k.members, "actor-0") == b"{}" and r.get(k.ingest) == b"x"   # the first job's state stands


def test_a_fixed_ingest_port_already_taken_is_refused_naming_the_key(tmp_path):
    """buffer.ingest_port held by another process: refused before anything starts, naming the key (the ingest used
    to fail to bind, be restarted to the same error until its restarts ran out, and end the job naming no key)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "cluster.start", "--run-dir", str(tmp_path / "run"),
                              f"buffer.ingest_port={port}", "trainer.total_steps=1"],
                             capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"buffer.ingest_port={port}: port {port} (ingest shard 0) is taken" in res.stderr + res.stdout, \
        res.stderr[-3000:]
    assert "restarting" not in res.stdout
