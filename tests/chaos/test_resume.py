"""SIGKILL the learner mid-run (groups read, not yet covered by a checkpoint), then --resume:
the run completes, every step counts once, no group is trained twice, nothing stays pending."""
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
EVERY = 4


def test_learner_killed_then_resumed(tmp_path, redis_url, r, run_id):
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--redis-url", redis_url, f"trainer.checkpoint_every={EVERY}"]
    a = subprocess.Popen([sys.executable, "-m", "cluster.start", *common, f"cluster.run_id={run_id}",
                          "trainer.total_steps=1000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while json.loads(r.get(f"{run_id}:metrics") or "{}").get(M.STEP, -1) < 2 * EVERY + 1:
            assert a.poll() is None and time.monotonic() < deadline, a.communicate()
            time.sleep(0.2)
        os.kill(int(r.hget(f"{run_id}:learner", "pid")), signal.SIGKILL)
        _out, err = a.communicate(timeout=60)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
    assert a.returncode == 1 and "learner-0 failed" in err, err[-2000:]

    b = subprocess.run([sys.executable, "-m", "cluster.start", *common, "--resume", "trainer.total_steps=16"],
                       capture_output=True, text=True, timeout=WAIT_S)
    assert b.returncode == 0, b.stderr[-3000:]
    summary = json.loads(next(ln for ln in b.stdout.splitlines() if ln.startswith("done: "))[6:])
    start = summary["start_step"]
    assert start >= 2 * EVERY and start % EVERY == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    first_b = next(i for i, m in enumerate(lines) if m[M.STEP] == start and M.VAL_REWARD_INITIAL in m and i > 0)
    counted = [m for m in lines[:first_b] if m[M.STEP] < start] + lines[first_b:]
    assert [m[M.STEP] for m in counted] == list(range(16))  # every step counts exactly once
    trained = [g for m in counted for g in m[M.GROUPS_TRAINED]]
    assert len(trained) == len(set(trained))                # no group trained twice
    redone = {g for m in lines[:first_b] if m[M.STEP] >= start for g in m[M.GROUPS_TRAINED]}
    assert redone <= set(trained)  # steps the crash lost (if it hit between checkpoints) were trained again
    assert r.xpending(f"{run_id}:traj", "learner")["pending"] == 0  # nothing left in flight
    check_ledger(r, run_id, run, steps=16)
