"""CPU time of every process of a job on the launcher's node, by role, in `<run_dir>/cpu.jsonl`.

Each line: {"time": unix seconds, "cores": CPUs this node gives us, "cpu": {role: CPU seconds used
so far}}. Roles are the job's own (learner-0, actor-1, ingest, ...) where the launcher knows the
process id, `redis` for the local Redis server, `launcher` for this process, and `other` for every
other descendant of the launcher (Ray's raylet, GCS and idle workers). A process's CPU includes
that of its children it has reaped, so work of exited helpers stays counted. Differences between
two lines are what each role burned in between: the experiment tools turn them into the work per
step and per batch that `experiments.simulate` is calibrated with, and they show where a
machine's cores went. Linux only (read from /proc); elsewhere nothing is written. Processes on
other nodes are not seen. Accounting never fails a job: a sampling error is logged once and
sampling stops.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

CPU_SAMPLE_S = 1.0  # one /proc scan (~1 ms per 100 processes) a second: cheap, and a 50-step run has tens of lines
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MANY = ("launcher", "other")  # roles of many processes: a falling total is an exit, not a restart


def proc_table(root: str = "/proc") -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds of the process and its reaped children) of every process we
    can read; one that vanishes or cannot be parsed mid-scan is left out."""
    out = {}
    for name in os.listdir(root):
        if not name.isdigit():
            continue
        try:
            stat = Path(root, name, "stat").read_bytes()
            # the command name (field 2) may hold anything, spaces and ')' included: fields restart after the last ')'
            rest = stat[stat.rindex(b")") + 2:].split()
            ticks = sum(int(x) for x in rest[11:15])  # utime, stime, cutime, cstime
            out[int(name)] = (int(rest[1]), ticks / _TICK)
        except (OSError, ValueError, IndexError):
            continue
    return out


def attribute(table: dict[int, tuple[int, float]], root_pid: int, roles: dict[int, str]) -> dict[str, float]:
    """CPU seconds by role over root_pid and its descendants, and over the role processes outside
    that tree (workers of a Ray cluster started before the job). A process takes the role of its
    nearest ancestor-or-self named in `roles` (a role's helper processes count as the role); the
    root is `launcher`; the rest of its tree is `other`."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[str, float] = {}
    seen: set[int] = set()
    starts = [(root_pid, "launcher")] + [(pid, role) for pid, role in roles.items()]
    for start in starts:
        stack = [start]
        while stack:
            pid, inherited = stack.pop()
            if pid not in table or pid in seen:
                continue
            seen.add(pid)
            role = roles.get(pid, inherited if pid == root_pid or inherited != "launcher" else "other")
            out[role] = out.get(role, 0.0) + table[pid][1]
            stack.extend((c, role) for c in children.get(pid, ()))
    return out


def quota_cores(cpu_max: str) -> float | None:
    """Cores a cgroup v2 `cpu.max` line ("QUOTA PERIOD", or "max PERIOD" for no limit) allows."""
    quota, _, period = cpu_max.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def cgroup_quota(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The tightest CPU quota on this process's cgroup v2 path (its own group and every parent:
    systemd's CPUQuota, a Slurm job or a pod may set it at any level), or None without one."""
    rel = "/"
    try:
        for line in Path(proc_cgroup).read_text().splitlines():
            if line.startswith("0::"):  # the v2 hierarchy; v1 controllers are not read
                rel = line[3:].strip() or "/"
    except OSError:
        pass
    here, quotas = Path(cgroup_root) / rel.lstrip("/"), []
    for d in (here, *here.parents):
        try:
            if (q := quota_cores((d / "cpu.max").read_text())) is not None:
                quotas.append(q)
        except (OSError, ValueError):
            pass  # no cpu controller here, or unreadable
        if d == Path(cgroup_root):
            break
    return min(quotas) if quotas else None


def node_cores(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float:
    """CPUs this process may use: its affinity, capped by a CPU quota (a container limited to 2 CPUs
    on a 64-core host must count 2, or every utilisation figure reads 32x too low). A quota of 1.5
    CPUs is 1.5: the simulator treats cores as capacity."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    q = cgroup_quota(cgroup_root, proc_cgroup)
    return n if q is None else min(n, q)


class CpuLog:
    """Appends one line per CPU_SAMPLE_S to `<run_dir>/cpu.jsonl` (see the module docstring)."""

    def __init__(self, run_dir, root_pid: int | None = None):
        self.path = Path(run_dir) / "cpu.jsonl"
        self.root = root_pid or os.getpid()
        self.enabled = Path("/proc/self/stat").exists()
        self.cores = node_cores()
        self.last = 0.0

    def sample(self, roles, *, force: bool = False) -> dict[str, float] | None:
        """Record one line if CPU_SAMPLE_S has passed (or force); returns what it recorded. `roles`:
        {pid: role}, or a function returning it (called only when a line is due)."""
        now = time.time()
        if not self.enabled or (not force and now - self.last < CPU_SAMPLE_S):
            return None
        self.last = now
        try:
            cpu = attribute(proc_table(), self.root, roles() if callable(roles) else roles)
            with self.path.open("a") as f:
                f.write(json.dumps({"time": now, "cores": self.cores, "cpu": cpu}) + "\n")
        except Exception as e:  # accounting must never end a job
            log.warning("CPU accounting stopped: %s: %s", type(e).__name__, e)
            self.enabled = False
            return None
        return cpu


def read(run_dir) -> list[dict]:
    p = Path(run_dir) / "cpu.jsonl"
    if not p.exists():
        raise FileNotFoundError(f"{p} not found: runs record it since cluster/cpu.py (Linux only)")
    return [json.loads(x) for x in p.read_text().splitlines()]


def used_between(lines: list[dict], t0: float, t1: float) -> tuple[dict[str, float], float]:
    """CPU seconds by role between the samples nearest t0 and t1, and the wall seconds between
    those samples. A single-process role restarted in between (its counter went down) counts from
    its restart; a many-process role (launcher, other) whose total fell lost exited processes that
    nobody reaped into it: its difference is floored at 0."""
    if len(lines) < 2:
        raise ValueError("cpu.jsonl has fewer than 2 samples: the run was too short to measure CPU")
    a = min(lines, key=lambda x: abs(x["time"] - t0))
    b = min(lines, key=lambda x: abs(x["time"] - t1))
    if b["time"] <= a["time"]:
        raise ValueError(f"no CPU samples between {t0:.1f} and {t1:.1f}")
    out = {}
    for role, c in b["cpu"].items():
        before = a["cpu"].get(role, 0.0)
        out[role] = c - before if c >= before else (0.0 if role in MANY else c)
    return out, b["time"] - a["time"]
