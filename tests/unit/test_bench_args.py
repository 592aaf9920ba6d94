"""Benchmarks' arguments: a name or value they cannot run is a usage error naming it, not a traceback."""
from __future__ import annotations

import argparse

import pytest


def test_eval_speed_variants_are_checked():
    from bench.eval_speed import variant

    assert variant("no_logprobs") == {"seeded": True, "behavior_logprobs": False}
    assert variant("ngram_3")["vllm_kwargs"]["speculative_config"]["num_speculative_tokens"] == 3
    for bad in ("bogus", "ngram_0", "ngram_x", "ngram"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            variant(bad)


def test_actor_stream_vllm_kwargs_must_be_a_json_object():
    from bench.actor_stream import json_object

    assert json_object('{"async_scheduling": true}') == {"async_scheduling": True}
    with pytest.raises(argparse.ArgumentTypeError, match="got list"):
        json_object("[1]")
    with pytest.raises(argparse.ArgumentTypeError, match="not JSON"):
        json_object("{a")


@pytest.mark.parametrize("gpu", ["h100", "h200", "gpu"])
def test_a_gpu_sweeps_runs_and_parquet_are_tracked_on_any_card(gpu):
    """bench/gpu_staleness.sh names a sweep smollm2_staleness_<gpu>_<date>; its finished runs travel to the next
    device call through the repo and its parquet is the committed result, whatever the card (an ignore rule
    naming one card would lose another card's runs with its machine)."""
    import shutil
    import subprocess
    from pathlib import Path

    git = shutil.which("git")
    root = Path(__file__).resolve().parents[2]
    if git is None or not (root / ".git").exists():
        pytest.fail("the test needs git and the project's checkout")
    folder = f"experiments/results/smollm2_staleness_{gpu}_20270101"
    paths = [f"{folder}/runs/s0-seed0/metrics.jsonl", f"{folder}/results.parquet"]
    res = subprocess.run([git, "check-ignore", "--no-index", *paths], cwd=root, capture_output=True, text=True)
    assert res.returncode == 1 and not res.stdout, f"ignored: {res.stdout}"   # 1: none of them is ignored
    other = subprocess.run([git, "check-ignore", "--no-index", "experiments/results/cpu_sweep/runs/x/metrics.jsonl"],
                           cwd=root, capture_output=True, text=True)
    assert other.returncode == 0   # a CPU sweep's run folders stay local
