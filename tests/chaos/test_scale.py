"""Scale a running job 2 -> 6 -> 1 actors while it learns, and export the policy on demand:
reward keeps rising, the job exits 0, and the books balance."""
from __future__ import annotations

import json
import subprocess
import sys

from jobs import JobUnderTest
from ledger import check_ledger
from learner import metric_names as M

STEPS = 300  # long enough that 4 actors can start (and 5 drain) on 2 loaded cores before the end
WINDOW = 20  # steps averaged at each end of the run to say the reward rose


def cli(module: str, *args: str) -> str:
    res = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_scale_2_to_6_to_1_while_learning(tmp_path, redis_url, r, run_id):
    run = tmp_path / "run"
    members = f"{run_id}:ws:members"
    job = JobUnderTest(run, r, run_id, "--actors", "2", f"trainer.total_steps={STEPS}", redis_url=redis_url)
    try:
        job.wait_step(5)
        cli("cluster.scale", "--run-dir", str(run), "--actors", "6")
        job.wait(lambda: r.hlen(members) == 6, "six actors in the weight group")
        exported = cli("cluster.export", "--run-dir", str(run))
        s = job.step()
        job.wait_step(s + 5)
        cli("cluster.scale", "--run-dir", str(run), "--actors", "1")
        job.wait(lambda: r.hlen(members) == 1, "one actor left")
        s = job.step()
        assert s < STEPS - 10, "the run should still be learning with one actor"
        assert job.finish() == 0, job.err[-3000:]
    finally:
        job.kill()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(m[M.WS_MEMBERS] for m in lines) == 6 and lines[-1][M.WS_MEMBERS] == 1
    first = sum(m[M.REWARD_MEAN] for m in lines[:WINDOW]) / WINDOW
    last = sum(m[M.REWARD_MEAN] for m in lines[-WINDOW:]) / WINDOW
    assert last > first + 0.1, (first, last)
    assert lines[-1][M.VAL_REWARD] > lines[0][M.VAL_REWARD_INITIAL] + 0.1
    assert job.out.count("drained") == 5
    check_ledger(r, run_id, run, steps=STEPS)
    # the on-demand export is a Hugging Face folder transformers loads
    from transformers import AutoModelForCausalLM

    assert exported.startswith(str(run / "policy-step-"))
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.vocab_size > 0
