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
    # a role process outside the launcher's tree (a Ray cluster started before the job) still counts
    assert cpu.attribute(table, 1, {3: "actor-0", 9: "learner-0"})["learner-0"] == 100.0


def test_proc_table_survives_odd_names_and_counts_reaped_children(tmp_path):
    def stat(pid, comm: bytes, ppid, ut, st, cut, cst):
        d = tmp_path / str(pid)
        d.mkdir()
        fields = [b"S", str(ppid).encode()] + [b"0"] * 9 + [str(x).encode() for x in (ut, st, cut, cst)] + [b"0"] * 30
        (d / "stat").write_bytes(f"{pid} (".encode() + comm + b") " + b" ".join(fields))

    tick = cpu._TICK
    stat(10, b"ray::Proc.run", 1, tick, tick, 2 * tick, 0)       # 4 s: 2 own + 2 of reaped children
    stat(11, b"a) b (\xff\xfe", 10, tick, 0, 0, 0)              # spaces, parentheses, not UTF-8
    (tmp_path / "12").mkdir()                                     # vanished: no stat file
    (tmp_path / "13").mkdir()
    (tmp_path / "13" / "stat").write_bytes(b"13 (broken")          # truncated
    assert cpu.proc_table(str(tmp_path)) == {10: (1, 4.0), 11: (10, 1.0)}


def test_used_between_takes_differences_and_survives_a_restart():
    lines = [{"time": 10.0, "cores": 2, "cpu": {"learner-0": 1.0, "actor-0": 5.0}},
             {"time": 11.0, "cores": 2, "cpu": {"learner-0": 1.5, "actor-0": 5.2}},
             {"time": 12.0, "cores": 2, "cpu": {"learner-0": 2.0, "actor-0": 0.3, "actor-1": 0.4}}]
    used, wall = cpu.used_between(lines, 10.1, 11.9)
    assert wall == 2.0
    assert used == {"learner-0": 1.0, "actor-0": 0.3, "actor-1": 0.4}  # actor-0 restarted: counts from 0
    # a many-process role whose total fell lost an exited process: floored at 0, not its whole total
    falling = [{"time": 0.0, "cores": 2, "cpu": {"other": 5.0}}, {"time": 1.0, "cores": 2, "cpu": {"other": 4.0}}]
    assert cpu.used_between(falling, 0, 1)[0] == {"other": 0.0}
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
        broken = cpu.CpuLog(tmp_path / "missing-dir")  # cannot write: accounting stops, the caller goes on
        assert broken.sample(lambda: {busy.pid: "actor-7"}, force=True) is None and not broken.enabled
    finally:
        busy.kill()
        busy.wait()


def test_node_cores_honours_a_cpu_quota_anywhere_on_the_cgroup_path(tmp_path):
    from cluster import cpu

    assert cpu.quota_cores("max 100000\n") is None
    assert cpu.quota_cores("150000 100000\n") == 1.5
    root, own = tmp_path / "cg", tmp_path / "cg" / "job.slice" / "step.scope"
    own.mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job.slice/step.scope\n")
    affinity = cpu.node_cores(str(root), str(tmp_path / "absent"))  # nothing readable: the affinity
    assert affinity >= 1 and cpu.node_cores(str(root), str(proc)) == affinity
    (root / "cpu.max").write_text("max 100000\n")
    (root / "job.slice" / "cpu.max").write_text("garbage")
    (own / "cpu.max").write_text("max 100000\n")
    assert cpu.node_cores(str(root), str(proc)) == affinity
    (root / "job.slice" / "cpu.max").write_text("50000 100000\n")  # a parent's quota binds its children
    assert cpu.node_cores(str(root), str(proc)) == 0.5
    (own / "cpu.max").write_text("20000 100000\n")  # the tightest level wins
    assert cpu.node_cores(str(root), str(proc)) == 0.2
    (root / "job.slice" / "cpu.max").write_text(f"{100000 * (affinity + 4)} 100000\n")
    (own / "cpu.max").write_text("max 100000\n")
    assert cpu.node_cores(str(root), str(proc)) == affinity  # a quota above the affinity changes nothing
