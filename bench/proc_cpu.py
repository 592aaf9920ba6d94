"""Where a command's CPU time goes, by kind of process: `make test`'s, or a job's.

    python -m bench.proc_cpu --out cpu.json --logs '/tmp/pytest-of-*/pytest-*/**/logs/*.log' -- make test

Runs the command, reads every process's CPU time (user + system, from /proc) every SAMPLE_S until it ends, and
prints the CPU seconds per kind of process: a job's Ray processes by role (learner, actor, ingest, evaluator: the
pid each wrote into its log lines, `<role> pid=<pid>`, found under --logs), the launchers, Ray's own daemons, Redis,
pytest's workers, everything else by its program. Linux only. A process that lived less than SAMPLE_S may be
missed, and the last SAMPLE_S of each one's time is: the totals are a floor.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import time

SAMPLE_S = 0.5   # /proc read this often: ~2% of a core with 500 processes alive, a process's last 0.5 s missed
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
LOG_PID = re.compile(r"\S+ \S+ (\S+) pid=(\d+) ")   # runbase's log format: date time role pid=N level ...
RAY_DAEMONS = ("raylet", "gcs_server", "dashboard", "autoscaler", "log_monitor", "runtime_env", "monitor.py")


def cpu_seconds(pid: str) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rpartition(")")[2].split()
    return (int(rest[11]) + int(rest[12])) / TICK   # utime, stime


def cmdline(pid: str) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()


def run_sampled(cmd: list[str]) -> tuple[int, float, dict[str, list]]:
    """Run `cmd` to its end: (exit code, wall seconds, pid -> [command line when first seen, CPU seconds since])."""
    base, seen = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            base[pid] = cpu_seconds(pid)
        except OSError:
            pass
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    while True:
        done = proc.poll() is not None
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cpu = cpu_seconds(pid) - base.get(pid, 0.0)
                if pid not in seen:   # the command line once, when first seen
                    seen[pid] = [cmdline(pid), 0.0]
                seen[pid][1] = cpu
            except OSError:   # gone between the listing and the read
                pass
        if done:
            return proc.returncode, time.monotonic() - t0, seen
        time.sleep(SAMPLE_S)


def roles_from_logs(pattern: str) -> dict[str, str]:
    """pid -> role ("learner", "actor", ...: the index dropped) from the first line of each log under `pattern`."""
    roles = {}
    for path in glob.glob(pattern, recursive=True):
        try:
            with open(path, errors="replace") as f:
                m = next(filter(None, map(LOG_PID.match, f)), None)   # the first line in our format
        except OSError:
            continue
        if m:
            roles[m.group(2)] = re.sub(r"-\d+$", "", m.group(1))
    return roles


def kind(pid: str, cmd: str, roles: dict[str, str]) -> str:
    """The kind of process a command line is (a Ray worker's by the role its log gave its pid)."""
    head = " ".join(cmd.split(" ", 3)[:3])   # the program and its script (a raylet's arguments name the worker's)
    if "/ray/" in head and any(d in head for d in RAY_DAEMONS):
        return "ray daemons"
    if "default_worker.py" in cmd or cmd.startswith("ray::"):
        return f"ray worker: {roles.get(pid, 'no log found')}"
    if "cluster.start" in cmd:
        return "launcher (cluster.start)"
    if "redis-server" in cmd:
        return "redis-server"
    if re.search(r"(-m |/)pytest( |$)", cmd) or "exec(eval(sys.stdin.readline()))" in cmd:   # xdist's workers so
        return "pytest (workers: in-process tests)"
    if m := re.search(r" -m (\S+)", cmd):
        return f"python -m {m.group(1)}"
    if m := re.search(r" -c ([^\n;]{1,48})", cmd):   # its first statement: a build, a multiprocessing child
        return f"python -c {m.group(1)}"
    return os.path.basename(cmd.split(" ", 1)[0]) or "no command line (kernel threads)"


def by_kind(seen: dict[str, list], roles: dict[str, str]) -> list[tuple[str, float, int]]:
    """(kind, CPU seconds, processes) for every kind, most CPU first (ties by name)."""
    cpu, count = collections.Counter(), collections.Counter()
    for pid, (cmd, secs) in seen.items():
        k = kind(pid, cmd, roles)
        cpu[k] += secs
        count[k] += 1
    return [(k, cpu[k], count[k]) for k in sorted(cpu, key=lambda k: (-cpu[k], k))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write every process's command line and CPU seconds here (JSON)")
    p.add_argument("--logs", default="", help="glob (** allowed) of the jobs' process logs: pid -> role")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given (after --)")
    code, wall, seen = run_sampled(cmd)
    rows = by_kind(seen, roles_from_logs(args.logs) if args.logs else {})
    total = sum(c for _, c, _ in rows)
    print(f"\n{wall:.1f} s wall, {total:.1f} CPU-s in {len(seen)} processes ({os.cpu_count()} cores), exit {code}")
    for k, c, n in rows[:args.top]:
        print(f"{c:9.1f} CPU-s {100 * c / total if total else 0:5.1f}% {n:5d} processes  {k}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cmd": cmd, "exit": code, "wall_s": wall, "cores": os.cpu_count(),
                       "kinds": rows, "processes": seen}, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
