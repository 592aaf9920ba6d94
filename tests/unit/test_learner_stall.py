"""The launcher's report of a learner stuck in one phase (cluster/supervision.py LearnerStall): once per
stall, by the launcher's own clock from when it first sees the phase, never while the learner waits for groups."""
from __future__ import annotations

import pytest

from cluster import supervision
from cluster.supervision import LearnerStall
from runbase.keys import Keys

pytestmark = pytest.mark.unit
STALL_S = 60.0


class FakeRedis:   # hgetall only: the one read the report makes
    def __init__(self):
        self.phase = {}

    def hgetall(self, key):
        return {k.encode(): str(v).encode() for k, v in self.phase.items()}


@pytest.fixture
def stall(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(supervision.time, "monotonic", lambda: clock[0])
    stall = LearnerStall(FakeRedis(), Keys("t"), tmp_path, STALL_S)
    stall.clock = clock
    return stall


def reports(stall, capsys, after_s: float) -> list[str]:
    stall.clock[0] += after_s
    stall.check()
    return [ln for ln in capsys.readouterr().out.splitlines() if "learner-0 has been in" in ln]


def test_a_phase_is_reported_once_by_the_launchers_clock(stall, capsys):
    # `since` from a learner whose clock is an hour behind ours: the report counts from when the phase was seen
    stall.r.phase = {"phase": "evaluate", "version": 3, "since": 1.0}
    assert reports(stall, capsys, 0) == [] and reports(stall, capsys, STALL_S - 1) == []
    said = reports(stall, capsys, 2)
    assert len(said) == 1 and "its evaluate phase (weights version 3) for 61s" in said[0]
    assert "learner_stall_s=60" in said[0] and f"{stall.run_dir}/logs/learner-0.log" in said[0]
    assert reports(stall, capsys, STALL_S) == []                      # once per stall
    stall.r.phase = {"phase": "train", "version": 4, "since": 2.0}   # the next phase is a new stall
    assert reports(stall, capsys, 0) == [] and len(reports(stall, capsys, STALL_S + 1)) == 1


def test_waiting_for_groups_and_a_zero_bound_are_never_reported(stall, capsys):
    stall.r.phase = {"phase": "wait", "version": 3, "since": 1.0}
    assert reports(stall, capsys, 0) == [] and reports(stall, capsys, 10 * STALL_S) == []
    stall.r.phase = {"phase": "checkpoint", "version": 3, "since": 1.0}
    stall.stall_s = 0
    assert reports(stall, capsys, 0) == [] and reports(stall, capsys, 10 * STALL_S) == []
