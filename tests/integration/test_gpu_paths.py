"""GPU twins of paths tested on CPU (`pytest -m gpu`, one GPU): the one-process sync baseline with its
engine and learner sharing the GPU (CPU runs: test_experiments.py), and decoder layers compiled by
inductor (CPU twin with aot_eager: test_fsdp.py)."""
from __future__ import annotations

import json
import multiprocessing as mp
import socket
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_sync_baseline_runs_on_a_gpu(tmp_path):
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "experiments.sync", "--run-dir", str(run), "--actors", "2",
                          "trainer.total_steps=3", "learner.device=cuda", "actors.device=cuda",
                          "learner.param_dtype=bfloat16", "trainer.val_samples=1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert all(m["train_s"] > 0 and m["samples"] > 0 and m["staleness_max"] == 0 for m in lines)
    assert "held-out reward" in res.stdout


def compiled_proc(port: int, out: str) -> None:
    from data.tiny_model import random_tiny_model
    from learner.config import LearnerConfig
    from learner.model import full_state_dict, shard
    from learner.train import init_learner_group, learner_device, train_step
    from test_fsdp import make_rows

    lc = LearnerConfig(lr=1e-2, micro_batch_size_per_gpu=3, device="cuda")
    dev = learner_device(lc, 0)
    group = init_learner_group(dev, f"tcp://127.0.0.1:{port}", 0, 1)
    result = {}
    for backend in ("off", "inductor"):
        model = shard(random_tiny_model(seed=0).to(dev), dev, compile=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=lc.lr)
        rows = make_rows(8)
        stats = train_step(model, opt, rows, rows, lc, temperature=1.0, world=1, pad_id=0, device=dev, group=group)
        result[backend] = {"sd": full_state_dict(model), "loss": stats["loss"]}
    torch.save(result, out)


def test_inductor_compiled_layers_train_as_eager_on_a_gpu(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "compiled.pt")
    p = mp.get_context("spawn").Process(target=compiled_proc, args=(port, out))
    p.start()
    p.join(600)
    assert p.exitcode == 0
    got = torch.load(out)
    assert got["inductor"]["loss"] == pytest.approx(got["off"]["loss"], rel=1e-3)
    for name, t in got["off"]["sd"].items():
        # fp32 on both; fused kernels change the summation order only
        torch.testing.assert_close(got["inductor"]["sd"][name], t, rtol=1e-3, atol=1e-4, msg=name)
