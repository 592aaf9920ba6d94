"""cluster/cpu.py: CPU time by role from /proc, attributed through the process tree."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cluster import cpu

pytestmark = pytest.mark.unit


def test_attribute_follows_the_process_tree():
    # launcher 1 -> raylet 2 -> worker 3 (actor-0) -> its helper 4; redis 5; an unrelated process 9
    table = {1: (0, 1.0), 2: (1, 2.0), 3: (2, 3.0), 4: (3, 0.5), 5: (1, 0.25), 9: (0, 100.0)}
    got = cpu.attribute(table, 1, {3: "actor-0", 5: "redis"})
    assert got == {"launcher": 1.0, "other": 2.0, "actor-0": 3.5, "redis": 0.25}


def test_used_between_takes_differences_and_survives_a_restart():
    lines = [{"time": 10.0, "cores": 2, "cpu": {"learner-0": 1.0, "actor-0": 5.0}},
             {"time": 11.0, "cores": 2, "cpu": {"learner-0": 1.5, "actor-0": 5.2}},
             {"time": 12.0, "cores": 2, "cpu": {"learner-0": 2.0, "actor-0": 0.3, "actor-1": 0.4}}]
    used, wall = cpu.used_between(lines, 10.1, 11.9)
    assert wall == 2.0
    assert used == {"learner-0": 1.0, "actor-0": 0.3, "actor-1": 0.4}  # actor-0 restarted: counts from 0
    with pytest.raises(ValueError, match="fewer than 2"):
        cpu.used_between(lines[:1], 0, 1)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_a_busy_child_is_measured_under_its_role(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.5: pass\ntime.sleep(30)"])
    try:
        log = cpu.CpuLog(tmp_path)
        deadline = time.monotonic() + 20
        while True:
            got = log.sample({busy.pid: "actor-7"}, force=True)
            if got.get("actor-7", 0) >= 0.4 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert got["actor-7"] >= 0.4, got
        lines = cpu.read(tmp_path)
        assert lines[-1]["cores"] == cpu.node_cores() and lines[-1]["cpu"]["actor-7"] == got["actor-7"]
        assert log.sample({busy.pid: "actor-7"}) is None  # within CPU_SAMPLE_S of the last: not sampled
    finally:
        busy.kill()
        busy.wait()
