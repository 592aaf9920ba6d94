"""learner/profiling.py StepProfiler: profiles exactly the loop iterations asked for, once, and writes
a summary and a trace; nothing at all without a window."""
from __future__ import annotations

import gzip
import json

import pytest
import torch

from learner.profiling import StepProfiler

pytestmark = pytest.mark.unit


def test_profiles_the_window_once_and_writes_summary_and_trace(tmp_path):
    p = StepProfiler([2, 3], tmp_path, rank=0, cuda=False)
    active = []
    for step in range(6):
        p.step(step)
        active.append(p.prof is not None)
        torch.ones(64, 64).matmul(torch.ones(64, 64))
    p.close()
    assert active == [False, False, True, True, False, False]
    text = (tmp_path / "learner-rank0-steps-2-3.txt").read_text()
    assert text.startswith("learner loop iterations 2-3: wall") and "aten::mm" in text
    with gzip.open(tmp_path / "learner-rank0-steps-2-3.trace.json.gz") as f:
        assert any(e.get("name") == "aten::mm" for e in json.load(f)["traceEvents"])
    p.step(2)  # a retried step number after the window: never again
    assert p.prof is None


def test_window_the_run_ends_inside_is_closed_by_close(tmp_path):
    p = StepProfiler([1, 9], tmp_path, rank=1, cuda=False)
    p.step(0)
    p.step(1)
    torch.ones(8).sum()
    p.close()
    assert (tmp_path / "learner-rank1-steps-1-9.txt").exists() and p.prof is None


def test_no_window_no_profiler(tmp_path):
    p = StepProfiler([], tmp_path, rank=0, cuda=False)
    for step in range(3):
        p.step(step)
        assert p.prof is None
    p.close()
    assert not list(tmp_path.iterdir())
