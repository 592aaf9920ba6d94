"""The TCP listeners of a running `cluster.start` job, by process, split into ours and Ray's.

Ours: the launcher, its Redis server, and every process hosting a role (it holds the run's
logs/<role>.log open), except the one gRPC port Ray's core worker opens inside each of them (read from
its python-core-*_<pid>.log, "listening on port N"). Everything else under the launcher is Ray's own
(gcs_server, raylet, agents, monitors, idle workers).
"""
from __future__ import annotations

import ipaddress
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

POLL_S = 1.0  # how often the job's sockets are listed: our stores and groups live for the whole run
RAY_PORT = re.compile(rb"listening on port (\d+)")
CORE_LOG = re.compile(r"python-core-(worker|driver)-\w+_(\d+)\.log$")
ENV_KEYS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # where gloo and NCCL open their sockets
GIVEN_ENV = re.compile(r"environment given: (.*)$", re.M)   # cluster.proc.Proc's line: what the job set as it started


def given_env(log: Path) -> dict[str, str]:
    """The values of ENV_KEYS a job's process was given as it started (its log; the launcher and Redis get none)."""
    m = GIVEN_ENV.search(log.read_text()) if log.exists() else None
    pairs = (kv.partition("=") for kv in (m.group(1).split() if m else []))
    return {k: v for k, _, v in pairs if k in ENV_KEYS}


@dataclass(frozen=True, order=True)
class Listener:
    owner: str  # our role ("launcher", "redis", "learner-0", ...) or "ray:<process name>"
    ip: str
    port: int


def _owner(p: psutil.Process, root: int, logs: Path) -> tuple[str, set[int]]:
    """Who owns `p`'s listeners, and the ports in it that are Ray's core worker's."""
    if p.pid == root:
        role = "launcher"
    elif p.name().startswith("redis-server"):
        role = "redis"
    else:
        role = None
    ray_ports: set[int] = set()
    for f in p.open_files():
        path = Path(f.path)
        if path.parent == logs and path.suffix == ".log":
            role = role or path.stem
        elif (m := CORE_LOG.search(f.path)) and int(m.group(2)) == p.pid:
            ray_ports |= {int(x) for x in RAY_PORT.findall(path.read_bytes())}
    if role is None:  # Ray's own: a Python one by its script (monitor.py, dashboard.py, ...)
        script = next((Path(a).name for a in p.cmdline() if a.endswith(".py")), None)
        role = f"ray:{script if p.name().startswith('python') and script else p.name()}"
    return role, ray_ports


def snapshot(root: int, run_dir: Path, env: dict[str, dict]) -> set[Listener]:
    """Every listening TCP socket of the job's process tree now, Ray's core-worker ports marked as Ray's;
    records in `env` each of our roles' values of `env_keys`."""
    out = set()
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            owner, ray_ports = _owner(p, root, Path(run_dir) / "logs")
            if not owner.startswith("ray:") and not env.get(owner):   # set once as it starts: read until seen
                env[owner] = given_env(Path(run_dir) / "logs" / f"{owner}.log")
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    who = f"ray:core-worker in {owner}" if c.laddr.port in ray_ports else owner
                    out.add(Listener(who, c.laddr.ip, c.laddr.port))
        except (psutil.Error, OSError):  # exited meanwhile
            continue
    return out


def run_watched(cmd: list[str], run_dir: Path, timeout: float):
    """Run the job to its end, listing its listeners every POLL_S: its result, every listener seen, and
    each of our roles' values of ENV_KEYS."""
    seen: set[Listener] = set()
    env: dict[str, dict] = {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    res = {}
    reader = threading.Thread(target=lambda: res.update(zip(("out", "err"), proc.communicate())), daemon=True)
    reader.start()
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            break
        seen |= snapshot(proc.pid, run_dir, env)
        time.sleep(POLL_S)
    reader.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, res.get("out", ""), res.get("err", "")), seen, env


def on_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4 loopback address on an IPv6 socket (::ffff:127.0.0.1: how Ray's gRPC
    servers bind 127.0.0.1)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    return addr.is_loopback or bool(getattr(addr, "ipv4_mapped", None) and addr.ipv4_mapped.is_loopback)


def ours_off_loopback(seen: set[Listener]) -> list[Listener]:
    return sorted(x for x in seen if not x.owner.startswith("ray:") and not on_loopback(x.ip))


def any_off_loopback(seen: set[Listener]) -> list[Listener]:
    """Every listener off loopback, Ray's own included (its gcs_server, raylet, agents, monitors, core workers)."""
    return sorted(x for x in seen if not on_loopback(x.ip))
