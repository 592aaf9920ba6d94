"""bench/e2e.py's driver: a row that fails is reported and the rows around it are kept."""
from __future__ import annotations

import json

import pytest

from bench import e2e
from learner import metric_names as M

pytestmark = pytest.mark.unit


def fake_row(name: str) -> dict:
    return {"name": name, "wall_s": 2.0, "train_wall_s": 2.0, "samples": 64, "rewards": [0.1, 0.7, 0.7, 0.7, 0.7, 0.7],
            "times": [0.2, 0.4, 0.6, 0.8, 1.0, 1.2], "val_start": 0.4, "val_end": 0.7,
            "lines": [{M.TIME: 0.0, M.WAIT_S: 0.1, M.TRAIN_S: 0.1, M.WS_PUBLISH_S: 0.01},
                      {M.TIME: 0.5, M.WAIT_S: 0.2, M.TRAIN_S: 0.2, M.WS_PUBLISH_S: 0.05}]}


def test_a_failed_row_keeps_the_others(tmp_path, monkeypatch, capsys):
    def run_ours(name, out, steps, overrides):
        if name == "ours_s0":
            raise RuntimeError("ours_s0 failed: learner died")
        return fake_row(name)

    def run_trl(out, steps, overrides, vllm=False):
        if vllm:
            return fake_row("trl_vllm")
        raise ValueError("cannot pickle MonthDayNano")

    monkeypatch.setattr(e2e, "run_ours", run_ours)
    monkeypatch.setattr(e2e, "run_trl", run_trl)
    rc = e2e.main(["--steps", "6", "--only", "sync,ours_s0,trl,trl_vllm,ours_async", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    # the rows before and after the failures were measured, saved one by one and tabled
    assert json.loads((tmp_path / "sync.json").read_text())["samples"] == 64
    assert [r["name"] for r in json.loads((tmp_path / "e2e.json").read_text())] == ["sync", "trl_vllm", "ours_async"]
    # the 5-step mean first reaches 0.6 over steps 2-6 (0.58 over steps 1-5), at t=1.2 s
    assert "| sync | 64 | 2.0 s | 32.0 | 1.2 s |" in out
    assert "| trl | failed |" in out and "| ours_s0 | failed |" in out
    # each failure leaves its whole traceback, named in the output
    assert "cannot pickle MonthDayNano" in (tmp_path / "trl.error.txt").read_text()
    assert "Traceback" in (tmp_path / "ours_s0.error.txt").read_text()
    assert not (tmp_path / "trl.json").exists()
    assert "| weight publication | 0.050 |" in out   # the async row's profile still printed


@pytest.mark.parametrize("only", ["sync,verl", "sync,trl,sync"])
def test_unknown_or_repeated_rows_are_refused(tmp_path, only):
    with pytest.raises(SystemExit) as e:
        e2e.main(["--only", only, "--out", str(tmp_path)])
    assert e.value.code == 2


def test_the_trl_vllm_row_needs_a_gpu(tmp_path):
    """TRL's colocated vLLM runs on CUDA only: on a CPU config the row says so before importing TRL."""
    with pytest.raises(ValueError, match="trl_vllm row needs a CUDA GPU"):
        e2e.run_trl(tmp_path, 2, ["learner.device=cpu"], vllm=True)
