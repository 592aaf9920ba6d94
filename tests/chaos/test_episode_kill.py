"""kill -9 of an actor in the middle of multi-turn episodes (configs/tool_toy.yaml with tools that take 0.3 s):
the episodes it had between turns are resumed by the next actor from their last finished turn (the journal in
Redis, actors/journal.py), the job finishes its steps, and the books balance."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from jobs import JobUnderTest
from ledger import check_ledger

from data.tasks import TaskConfig
from data.tiny_model import resolve_model_path

HERE = Path(__file__).resolve().parent
CONFIG = str(HERE.parents[1] / "configs" / "tool_toy.yaml")
STEPS = 12
VAL_PROMPTS = 16       # held-out episodes per evaluation (data.val_max_prompts: the built-in model stays the one
                       # every tiny-tool test shares; task.num_val_prompts would key another to build)
JOURNAL_WAIT_S = 60   # for the victim to hold a group with a finished turn (episodes of 0.3 s tools: at once)


@pytest.fixture(scope="module", autouse=True)
def tiny_tool_model():
    """The built-in tiny-tool model built here, once, before any job: on a fresh cache its warm-up would otherwise
    run inside the job's start-up, which the job's waits do not budget for (minutes on a loaded 2-core machine)."""
    return resolve_model_path("builtin:tiny-tool", TaskConfig())


def journaled_group_of(r, run_id: str, actor: str) -> str | None:
    """A group leased by `actor` whose episodes have finished turns kept in Redis."""
    for gid, lease in r.hgetall(f"{run_id}:leases").items():
        if json.loads(lease)["actor"] == actor and r.hlen(f"{run_id}:ep:{gid.decode()}"):
            return gid.decode()
    return None


def test_an_actor_killed_mid_episode_its_episodes_resume_from_their_last_turn(tmp_path, redis_url, r, run_id,
                                                                             monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    job = JobUnderTest(tmp_path / "run", r, run_id, "--config", CONFIG, "--actors", "2",
                       "env.name=slow_tools:SlowReverseEnv", f"trainer.total_steps={STEPS}", "trainer.val_samples=1",
                       f"data.val_max_prompts={VAL_PROMPTS}", "weightsync.timeout_s=5", redis_url=redis_url,
                       own_ray=True)   # its processes find the test's environment on PYTHONPATH: the launcher's env
    try:
        job.wait_step(2)
        victim = job.pid_of("actor-0")
        deadline = time.monotonic() + JOURNAL_WAIT_S
        while (gid := journaled_group_of(r, run_id, "actor-0")) is None:
            assert time.monotonic() < deadline, "actor-0 never held a group with a finished turn"
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        assert job.finish() == 0, job.err[-3000:]
    finally:
        job.kill()
    assert "actor-0 died" in job.out, job.out[-2000:]
    status = json.loads((job.run_dir / "status.json").read_text())
    resumed = sum(m.get("episodes_resumed", 0) for m in status["members"].values())
    assert resumed >= 1, status["members"]
    assert sum(m.get("turns_resumed", 0) for m in status["members"].values()) >= resumed
    # the journals left are those of groups in flight at the end, each waiting in the queue for a resumed job
    left = {k.decode().rsplit(":", 1)[1] for k in r.keys(f"{run_id}:ep:*")}
    tagged = {json.loads(p).get("resume_gid") for p in r.lrange(f"{run_id}:prompts", 0, -1)}
    assert left <= tagged, (left, tagged)
    books = check_ledger(r, run_id, job.run_dir, steps=STEPS)
    assert books["returned"] >= 1, books
    print(f"resumed group {gid}: {resumed} episodes; books {books}")
