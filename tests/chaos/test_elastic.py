"""Elastic actors in one running job that learns: 2 actors, scaled to 4 (two added), an on-demand export,
scaled to 2 (the two newest drained), one SIGKILLed (Ray restarts it under the same id), scaled to 1 (one
more drained). The run completes and learns, the job exits 0, every live actor ends on the learner's final
weights, and the books balance.

(Before, test_scale.py scaled a second job 2 -> 6 -> 1 for the same add/drain/export path and the learning
check: one job now covers both, a job start and ~300 steps fewer.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from jobs import JobUnderTest
from ledger import check_ledger
from learner import metric_names as M

TIMEOUT_S = 3  # weightsync.timeout_s for this run: what a dead member may cost a publication
# Every event below was over by step ~104 on 2 cores when the job went 3 -> 6 -> 3 -> 1 (6 actors by step 81, one
# left at 104); with two actor starts fewer on each side, sooner. 2x margin at least; the rest of the run trains on
# the one actor left
STEPS = 240
WINDOW = 20  # steps averaged at each end of the run to say the reward rose


def cli(module: str, *args: str, timeout: float = 300) -> str:
    res = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_add_drain_kill_and_export_while_learning(tmp_path, redis_url, r, run_id):
    run = tmp_path / "run"
    members = f"{run_id}:ws:members"
    job = JobUnderTest(run, r, run_id, "--actors", "2", f"trainer.total_steps={STEPS}",
                       f"weightsync.timeout_s={TIMEOUT_S}", redis_url=redis_url)

    def scale(n):
        cli("cluster.scale", "--run-dir", str(run), "--actors", str(n), timeout=30)

    def pid(actor):
        """The pid `actor` last reported, None while it has no entry: read once, since the launcher removes the
        entry of an actor that died between any two reads (a hexists, then a hget that found nothing)."""
        raw = r.hget(f"{run_id}:members", actor)
        return None if raw is None else json.loads(raw)["pid"]

    try:
        # every actor has reported (a slow one on a loaded machine may not have by step 2: the learner needs
        # only one of them to train)
        job.wait(lambda: job.step() >= 2 and r.hlen(f"{run_id}:members") >= 2, "training, every actor reporting")
        st = json.loads(cli("cluster.status", "--run-dir", str(run), "--json", timeout=30))
        assert sorted(st["actors"]) == ["actor-0", "actor-1"]
        assert all(a["alive"] and a["engine"] == "hf" for a in st["actors"].values())
        assert st["learner"]["step"] >= 2 and st["buffer"]["deadletter"] == 0
        text = cli("cluster.status", "--run-dir", str(run), timeout=30)
        assert "actor-1" in text and "learner  step" in text
        scale(4)
        job.wait(lambda: r.hlen(members) == 4, "four actors in the weight group")
        exported = cli("cluster.export", "--run-dir", str(run))
        s = job.step()
        job.wait_step(s + 3)
        scale(2)  # drains the newest: actor-3, actor-2
        job.wait(lambda: r.hlen(members) == 2 and not {"actor-2", "actor-3"} & {a.decode() for a in r.hkeys(members)},
                 "actor-2 and actor-3 to leave")
        victim = job.pid_of("actor-0")
        os.kill(victim, signal.SIGKILL)
        job.wait(lambda: pid("actor-0") != victim, "actor-0's death to be handled")
        job.wait(lambda: pid("actor-0") not in (None, victim), "actor-0 to be restarted")
        s = job.step()
        job.wait_step(s + 3)  # steps after the replacement joined
        scale(1)  # drains actor-1: the restarted actor-0 is left
        job.wait(lambda: r.hlen(members) == 1, "one actor left")
        s = job.step()
        assert s < STEPS - 10, "the run should still be learning with one actor"
        assert job.finish() == 0, job.err[-3000:]
    finally:
        job.kill()
    out = job.out
    assert "actor-0 died" in out and "restarting (1/3)" in out and "actor-3 drained" in out
    assert out.count("drained") == 3
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == STEPS
    assert max(m[M.WS_MEMBERS] for m in lines) == 4 and lines[-1][M.WS_MEMBERS] == 1
    # a publication that met a dead member failed fast and was retried: bounded by the timeouts
    assert max(m[M.WS_PUBLISH_S] for m in lines) < 2 * TIMEOUT_S + 5
    # it learned through all of it
    first = sum(m[M.REWARD_MEAN] for m in lines[:WINDOW]) / WINDOW
    last = sum(m[M.REWARD_MEAN] for m in lines[-WINDOW:]) / WINDOW
    assert last > first + 0.1, (first, last)
    assert lines[-1][M.VAL_REWARD] > lines[0][M.VAL_REWARD_INITIAL] + 0.1
    status = json.loads((run / "status.json").read_text())
    final = status["checksums"][str(STEPS)]
    assert set(status["members"]) == {"actor-0"}  # actor-0 restarted, no new id; the others drained
    for actor, m in status["members"].items():
        assert m["pid"] != victim and (m["version"], m["checksum"]) == (STEPS, final), actor
    check_ledger(r, run_id, run, steps=STEPS)
    # the on-demand export is a Hugging Face folder transformers loads
    from transformers import AutoModelForCausalLM

    assert exported.startswith(str(run / "policy-step-"))
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.vocab_size > 0


def test_actors_drained_before_their_engine_is_built_exit_without_building_it(tmp_path, redis_url, r, run_id):
    """Scaled up and down again at once (an operator's typo put right): the added actors see their drain before
    building an engine and exit (an engine built first would cost seconds to minutes, and GPU memory, for
    nothing, and the job's end would wait for it), and the job goes on with the books balanced."""
    run = tmp_path / "run"
    steps = 80   # ~20 s on 2 cores: the drained actors exit within seconds of their start
    job = JobUnderTest(run, r, run_id, "--actors", "1", f"trainer.total_steps={steps}", redis_url=redis_url)
    try:
        job.wait_step(2)
        launcher_log = run / "logs" / "launcher.log"
        r.set(f"{run_id}:scale_target", 3)   # as cluster.scale does, without its start-up time
        job.wait(lambda: "started actor-2" in launcher_log.read_text(), "actor-1 and actor-2 to be started")
        r.set(f"{run_id}:scale_target", 1)   # the launcher drains them within a tick, before their engines exist
        job.wait(lambda: "actor-2 drained" in launcher_log.read_text(), "actor-2 to be drained")
        assert job.finish() == 0, job.err[-3000:]
    finally:
        job.kill()
    assert "actor-1 drained" in job.out and "actor-2 drained" in job.out
    marks = {k.decode() for k in r.hkeys(f"{run_id}:startup")}
    assert "actor-0:engine" in marks and not {"actor-1:engine", "actor-2:engine"} & marks, marks
    for a in ("actor-1", "actor-2"):
        assert "drained before its engine was built" in (run / "logs" / f"{a}.log").read_text()
    check_ledger(r, run_id, run, steps=steps)
