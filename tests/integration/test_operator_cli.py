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
