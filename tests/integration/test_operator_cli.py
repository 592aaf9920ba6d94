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
    from buffer.store import Keys
    from cluster.config import load_config
    from cluster.progress import Progress

    keys = Keys(run_id)
    progress = Progress(load_config(overrides=["cluster.actors=2"]), r, keys)
    assert "actors alive 0/2" in progress.line()
    r.set(keys.scale_target, 1)
    assert "actors alive 0/1" in progress.line()
