"""bench/learner.py runs on CPU for every batch kind, and packing removes the padding it reports."""
from __future__ import annotations

import json
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def no_default_group():
    """The benches set up torch.distributed's default group in this process; one an earlier test on this worker
    left up would make that fail ("trying to initialize the default process group twice", seen in a full run). A
    vLLM engine built in this process earlier (the in-process engine tests) holds its groups on it: they are taken
    down through vLLM, or the next such engine on this worker would reuse vLLM's record of groups that are gone
    ("Invalid process group specified")."""
    import torch.distributed as dist

    vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
    if getattr(vllm_groups, "_WORLD", None) is not None:
        vllm_groups.destroy_model_parallel()
        vllm_groups.destroy_distributed_environment()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def test_learner_bench_runs_on_cpu(tmp_path, capsys):
    """Rows a quarter as long as the bench's (--scale 0.25): every kind's plumbing and padding are the same, and a
    packed micro-batch's attention on the CPU grows with the square of its length (42 s a step at full length on a
    loaded 2-core machine, two steps a kind)."""
    from bench.learner import main

    out = tmp_path / "bl.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--gpus", "1", "--steps", "1", "--batch", "all",
                 "--ckpt", "off", "--scale", "0.25", "--json", str(out)]) == 0
    rows = {r["batch"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "rl", "rl-packed"}
    assert rows["dense"]["padding_waste"] == 0 and rows["rl-packed"]["padding_waste"] == 0
    assert rows["rl"]["padding_waste"] > 0.1  # long-tailed responses in right-padded micro-batches
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert "| rl-packed |" in capsys.readouterr().out


def test_learner_step_bench_profiles_variants_on_cpu(tmp_path, capsys):
    """bench/learner_step.py: each variant timed and profiled, an unknown one refused before anything runs. Two
    prompt groups of the SmolLM2 batch's sixteen: the CPU's packed varlen attention grows with the square of a
    micro-batch's tokens (36 s a step at sixteen on a loaded 2-core machine, four steps a variant)."""
    from bench.learner_step import main

    out = tmp_path / "ls.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--steps", "1", "--groups", "2", "--variants",
                 "fsdp-mb128,fsdp-packed-varlen", "--profile", str(tmp_path / "prof"), "--json", str(out)]) == 0
    res = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(res) == {"fsdp-mb128", "fsdp-packed-varlen"}
    assert all("error" not in r and r["step_s"] > 0 for r in res.values()), res
    assert (tmp_path / "prof" / "fsdp-packed-varlen.txt").read_text().startswith("wall ")
    assert "| fsdp-packed-varlen |" in capsys.readouterr().out
    for bad in (["--variants", "no-such-variant"], ["--groups", "0"]):
        with pytest.raises(SystemExit):
            main(["--device", "cpu", *bad])
