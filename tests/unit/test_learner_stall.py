"""The launcher's report of a learner stuck in one phase (cluster/launch.py Job._report_learner_stall): once per
stall, by the launcher's own clock from when it first sees the phase, never while the learner waits for groups."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster import launch
from cluster.launch import Job
from runbase.keys import Keys

pytestmark = pytest.mark.unit
STALL_S = 60.0


class FakeRedis:   # hgetall only: the one read the report makes
    def __init__(self):
        self.phase = {}

    def hgetall(self, key):
        return {k.encode(): str(v).encode() for k, v in self.phase.items()}


@pytest.fixture
def job(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(launch.time, "monotonic", lambda: clock[0])
    j = SimpleNamespace(r=FakeRedis(), keys=Keys("t"), run_dir=tmp_path, learner_phase=[None, 0.0, False],
                        cfg=SimpleNamespace(cluster=SimpleNamespace(learner_stall_s=STALL_S)))
    j.clock = clock
    return j


def reports(job, capsys, after_s: float) -> list[str]:
    job.clock[0] += after_s
    Job._report_learner_stall(job)
    return [ln for ln in capsys.readouterr().out.splitlines() if "learner-0 has been in" in ln]


def test_a_phase_is_reported_once_by_the_launchers_clock(job, capsys):
    # `since` from a learner whose clock is an hour behind ours: the report counts from when the phase was seen
    job.r.phase = {"phase": "evaluate", "version": 3, "since": 1.0}
    assert reports(job, capsys, 0) == [] and reports(job, capsys, STALL_S - 1) == []
    said = reports(job, capsys, 2)
    assert len(said) == 1 and "its evaluate phase (weights version 3) for 61s" in said[0]
    assert "learner_stall_s=60" in said[0] and f"{job.run_dir}/logs/learner-0.log" in said[0]
    assert reports(job, capsys, STALL_S) == []                      # once per stall
    job.r.phase = {"phase": "train", "version": 4, "since": 2.0}   # the next phase is a new stall
    assert reports(job, capsys, 0) == [] and len(reports(job, capsys, STALL_S + 1)) == 1


def test_waiting_for_groups_and_a_zero_bound_are_never_reported(job, capsys):
    job.r.phase = {"phase": "wait", "version": 3, "since": 1.0}
    assert reports(job, capsys, 0) == [] and reports(job, capsys, 10 * STALL_S) == []
    job.r.phase = {"phase": "checkpoint", "version": 3, "since": 1.0}
    job.cfg.cluster.learner_stall_s = 0
    assert reports(job, capsys, 0) == [] and reports(job, capsys, 10 * STALL_S) == []
