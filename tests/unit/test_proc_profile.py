"""cluster.proc.Proc, what hosts every component: its environment given as it starts, and cluster.profile (a process's
run() under cProfile leaves a readable summary and a pstats file)."""
from __future__ import annotations

import os
import pstats

import pytest

from cluster.proc import Proc
from runbase import net

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


class Environ:
    def __init__(self, keys: list[str]):
        self.keys = keys

    def run(self) -> dict:
        return {k: os.environ.get(k) for k in self.keys}


def test_a_process_is_given_its_environment_before_its_component_and_logs_no_secret(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "environ", {})   # Proc sets the process's own: this test's is left alone
    env = {"GLOO_SOCKET_IFNAME": "lo", net.ENV_REDIS_PASSWORD: "s3cret", "WANDB_API_KEY": "k3y"}
    proc = Proc("learner-0", str(tmp_path), f"{__name__}:Environ", {"keys": list(env)}, env=env)
    assert proc.run() == env   # the component (built in run()) sees every variable
    log = (tmp_path / "logs" / "learner-0.log").read_text()
    assert f"environment given: {net.ENV_REDIS_PASSWORD} GLOO_SOCKET_IFNAME=lo WANDB_API_KEY\n" in log, log
    assert "s3cret" not in log and "k3y" not in log
