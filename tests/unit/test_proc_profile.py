"""cluster.profile: a process's run() under cProfile leaves a readable summary and a pstats file."""
from __future__ import annotations

import pstats

import pytest

from cluster.proc import Proc

pytestmark = pytest.mark.unit


def busy_work_of_the_profiled_job(n: int) -> int:
    return sum(i * i for i in range(n))


class Job:
    def __init__(self, n: int):
        self.n = n

    def run(self) -> int:
        return busy_work_of_the_profiled_job(self.n)


def test_a_profiled_process_writes_its_profile(tmp_path):
    proc = Proc("actor-7", str(tmp_path), f"{__name__}:Job", {"n": 20000}, profile=True)
    assert proc.run() == busy_work_of_the_profiled_job(20000)  # the result is the component's own
    text = (tmp_path / "profiles" / "actor-7.txt").read_text()
    assert "busy_work_of_the_profiled_job" in text and "cumulative" in text
    stats = pstats.Stats(str(tmp_path / "profiles" / "actor-7.prof"))
    assert any(name == "busy_work_of_the_profiled_job" for (_f, _l, name) in stats.stats)


def test_an_unprofiled_process_writes_none(tmp_path):
    assert Proc("actor-0", str(tmp_path), f"{__name__}:Job", {"n": 10}).run() == busy_work_of_the_profiled_job(10)
    assert not (tmp_path / "profiles").exists()
