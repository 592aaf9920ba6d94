"""Elastic actors in a running job: one added, one drained, one SIGKILLed (Ray restarts it under
the same id); the run completes and every live actor ends on the learner's final weights."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from ledger import check_ledger
from learner import metric_names as M

WAIT_S = 180
TIMEOUT_S = 3  # weightsync.timeout_s for this run: what a dead member may cost a publication
# The add, drain and kill below were over by step ~90 on a slow 2-core VM (31 s of training), by step ~105 in a
# 2026-12-03 run; 3x margin (was 400: ~80 more steps, ~9 s, of training after everything checked had happened)
STEPS = 320


def test_add_drain_and_kill_actors_during_a_run(tmp_path, redis_url, r, run_id):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.start", "--run-dir", str(run), "--actors", "3", "--redis-url", redis_url,
         f"cluster.run_id={run_id}", f"trainer.total_steps={STEPS}", f"weightsync.timeout_s={TIMEOUT_S}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    members = f"{run_id}:ws:members"

    def step():
        raw = r.get(f"{run_id}:metrics")
        return json.loads(raw)[M.STEP] if raw else -1

    def wait(cond, what):
        deadline = time.monotonic() + WAIT_S
        while not cond():
            assert proc.poll() is None, f"job exited while waiting for {what}: {proc.communicate()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def scale(n):
        res = subprocess.run([sys.executable, "-m", "cluster.scale", "--run-dir", str(run), "--actors", str(n)],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr

    try:
        # every actor has reported (a slow one on a loaded machine may not have by step 2: the learner needs
        # only two of them to train)
        wait(lambda: step() >= 2 and r.hlen(f"{run_id}:members") >= 3, "training, every actor reporting")
        status = subprocess.run([sys.executable, "-m", "cluster.status", "--run-dir", str(run), "--json"],
                                capture_output=True, text=True, timeout=30)
        assert status.returncode == 0, status.stderr
        st = json.loads(status.stdout)
        assert sorted(st["actors"]) == ["actor-0", "actor-1", "actor-2"]
        assert all(a["alive"] and a["engine"] == "hf" for a in st["actors"].values())
        assert st["learner"]["step"] >= 2 and st["buffer"]["deadletter"] == 0
        text = subprocess.run([sys.executable, "-m", "cluster.status", "--run-dir", str(run)],
                              capture_output=True, text=True, timeout=30).stdout
        assert "actor-2" in text and "learner  step" in text
        scale(4)
        wait(lambda: r.hexists(members, "actor-3"), "actor-3 to join")
        s = step()
        wait(lambda: step() >= s + 3, "steps with 4 actors")
        scale(3)  # drains the newest: actor-3
        wait(lambda: not r.hexists(members, "actor-3"), "actor-3 to leave")
        wait(lambda: r.hexists(f"{run_id}:members", "actor-0"), "actor-0 to report")
        victim = json.loads(r.hget(f"{run_id}:members", "actor-0"))["pid"]
        os.kill(victim, signal.SIGKILL)
        wait(lambda: not r.hexists(f"{run_id}:members", "actor-0") or
             json.loads(r.hget(f"{run_id}:members", "actor-0"))["pid"] != victim, "actor-0's death to be handled")
        wait(lambda: r.hexists(f"{run_id}:members", "actor-0") and
             json.loads(r.hget(f"{run_id}:members", "actor-0"))["pid"] != victim, "actor-0 to be restarted")
        s = step()
        wait(lambda: step() >= s + 3, "steps after the replacement joined")
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "actor-0 died" in out and "restarting (1/3)" in out and "actor-3 drained" in out
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == STEPS
    assert max(m[M.WS_MEMBERS] for m in lines) == 4 and lines[-1][M.WS_MEMBERS] == 3
    # a publication that met a dead member failed fast and was retried: bounded by the timeouts
    assert max(m[M.WS_PUBLISH_S] for m in lines) < 2 * TIMEOUT_S + 5
    status = json.loads((run / "status.json").read_text())
    final = status["checksums"][str(STEPS)]
    assert set(status["members"]) == {"actor-0", "actor-1", "actor-2"}  # actor-0 restarted, no new id
    for actor, m in status["members"].items():
        assert (m["version"], m["checksum"]) == (STEPS, final), actor
    check_ledger(r, run_id, run, steps=STEPS)
