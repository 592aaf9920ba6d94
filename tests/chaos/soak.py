"""A soak: one job under a seeded random schedule of faults until it has trained its steps, checked as it goes.

    python tests/chaos/soak.py --steps 6000 --seed 1 [--every 20] [--out DIR] [-- job overrides...]
    make soak STEPS=6000                        # about two hours of the embedded job on 2 cores

Faults, one every `--every` seconds on average (exponential gaps), in a seeded random order that runs through
every kind before it repeats one:
  kill_actor   SIGKILL of a live rollout actor (Ray restarts it; its leases go back to the queue)
  kill_ingest  SIGKILL of the ingest (restarted on a new port; actors resend what was not acked)
  kill_redis   SIGKILL of the job's own redis-server (restarted from its AOF)
  pause        SIGSTOP of an actor or the ingest for PAUSE_S, then SIGCONT
  scale        the actor count moved up or down by one (`cluster.scale`), between 1 and MAX_ACTORS
Each process's restarts are capped by `cluster.max_restarts`, set high here so a long soak does not use them up.

Checked: the books balance at the end (tests/chaos/ledger.py: every group issued was trained once, is waiting,
was dropped with a reason, or went back to the queue); no gap between two trained steps is longer than
`--stall-s`; each process's RSS and open file descriptors, sampled every SAMPLE_S, do not grow after the warm-up
(slopes reported per process, and bounded); the weights' publication time at the end is not a multiple of the
one at the start; the held-out reward at the end beats step 0. Writes `soak.json` (faults by kind, the books,
the longest stall, the slopes, publication first vs last quarter, held-out start and end) and prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

from jobs import JobUnderTest  # noqa: E402 - after the path set-up above: this folder's helpers
from ledger import check_ledger, counted_steps  # noqa: E402

from cluster.redis_local import LocalRedis  # noqa: E402
from learner import metric_names as M  # noqa: E402
from runbase.keys import connect  # noqa: E402

FAULTS = ("kill_actor", "kill_ingest", "kill_redis", "pause", "scale")
PAUSE_S = 2.0          # a SIGSTOP long enough to miss heartbeats and acks, short of ACTOR_SILENT_S (a kill)
MAX_ACTORS = 4         # the scale fault keeps the actor count in 1..MAX_ACTORS
SAMPLE_S = 5.0         # how often each process's RSS and open files are sampled
WARMUP_S = 30.0        # a process's first seconds are its warm-up (imports, model load, caches, allocators)
MIN_JUDGED = 6         # samples after its warm-up a process needs to be judged (one started late is not)
RESTARTS = 1000        # cluster.max_restarts for the soak: faults, not the cap, decide what dies
FD_GROWTH = 64         # open files a process may gain after warm-up (sockets of restarted peers come and go)
RSS_GROWTH = 1.5       # RSS after warm-up may reach this multiple of the warm-up's largest
PUBLISH_GROWTH = 3.0   # the last quarter's mean publication time may be this multiple of the first's (+ 0.2 s)


def role_pid(run_dir: Path, role: str) -> int | None:
    """The pid of the role's latest incarnation, from its log's start line."""
    log = run_dir / "logs" / f"{role}.log"
    found = re.findall(rf"pid=(\d+) INFO proc: {re.escape(role)} started", log.read_text()) if log.exists() else []
    return int(found[-1]) if found else None


class Sampler:
    """RSS and open files of every process of the job's tree, every SAMPLE_S, by (pid, name)."""

    def __init__(self, root_pid: int):
        self.root, self.samples, self.stop = root_pid, {}, threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(SAMPLE_S):
            try:
                procs = [psutil.Process(self.root), *psutil.Process(self.root).children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    key = f"{p.pid}:{p.name()}"
                    self.samples.setdefault(key, []).append((time.monotonic() - t0, p.memory_info().rss,
                                                             p.num_fds()))
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue

    def growth(self) -> dict:
        """Per process sampled long enough after its warm-up: slope of RSS (MB/min) and fds (/min) after the
        warm-up, and whether each stayed within its bound against the warm-up's largest."""
        out = {}
        for key, s in self.samples.items():
            warm = [x for x in s if x[0] - s[0][0] <= WARMUP_S]
            rest = s[len(warm):]
            if len(rest) < MIN_JUDGED:
                continue
            out[key] = {"rss_mb_per_min": round(_slope([(t, rss / 2**20) for t, rss, _ in rest]) * 60, 3),
                        "fds_per_min": round(_slope([(t, fds) for t, _, fds in rest]) * 60, 3),
                        "rss_ok": max(x[1] for x in rest) <= RSS_GROWTH * max(x[1] for x in warm),
                        "fds_ok": max(x[2] for x in rest) <= FD_GROWTH + max(x[2] for x in warm)}
        return out


def _slope(points) -> float:
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    den = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / den if den else 0.0


class Chaos:
    """The seeded fault schedule against one running job."""

    def __init__(self, job: JobUnderTest, run_id: str, rng: random.Random, actors: int):
        self.job, self.run_id, self.rng, self.actors = job, run_id, rng, actors
        self.done: dict[str, int] = {k: 0 for k in FAULTS}
        self.bag: list[str] = []

    def inject(self) -> str | None:
        if not self.bag:   # every kind once, in a seeded order, before any repeats: a short soak sees them all
            self.bag = self.rng.sample(FAULTS, len(FAULTS))
        kind = self.bag.pop()
        if getattr(self, kind)():
            self.done[kind] += 1
            return kind
        return None

    def _live_actor_pid(self) -> int | None:
        members = self.job.r.hgetall(f"{self.run_id}:members")
        pids = sorted(json.loads(v)["pid"] for v in members.values())
        return self.rng.choice(pids) if pids else None

    def kill_actor(self) -> bool:
        return _signal(self._live_actor_pid(), signal.SIGKILL)

    def kill_ingest(self) -> bool:
        return _signal(role_pid(self.job.run_dir, "ingest"), signal.SIGKILL)

    def kill_redis(self) -> bool:
        server = next((p for p in psutil.Process(self.job.proc.pid).children(recursive=True)
                       if p.name().startswith("redis-server")), None)
        return _signal(server.pid if server else None, signal.SIGKILL)

    def pause(self) -> bool:
        pid = self._live_actor_pid() if self.rng.random() < 0.5 else role_pid(self.job.run_dir, "ingest")
        if not _signal(pid, signal.SIGSTOP):
            return False
        time.sleep(PAUSE_S)
        return _signal(pid, signal.SIGCONT) or True

    def scale(self) -> bool:
        n = min(MAX_ACTORS, max(1, self.actors + self.rng.choice((-1, 1))))
        if n == self.actors:
            return False
        subprocess.run([sys.executable, "-m", "cluster.scale", "--run-dir", str(self.job.run_dir), "--actors",
                        str(n)], capture_output=True, timeout=60, cwd=ROOT)
        self.actors = n
        return True


def _signal(pid: int | None, sig) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def verdicts(job, r, run_id: str, stall_s: float, sampler: Sampler) -> dict:
    """What the soak checks once the job has ended (see the module docstring); `ok` is all of them."""
    lines = counted_steps(job.run_dir)
    books = check_ledger(r, run_id, job.run_dir, steps=len(lines))
    times = [m[M.TIME] for m in lines if M.TIME in m]
    longest = max((b - a for a, b in zip(times, times[1:])), default=0.0)
    pub = [m[M.WS_PUBLISH_S] for m in lines if M.WS_PUBLISH_S in m]   # the publisher's own time per version
    q = max(1, len(pub) // 4)
    first, last = sum(pub[:q]) / q, sum(pub[-q:]) / q
    growth = sampler.growth()
    val = [m for m in lines if M.VAL_REWARD in m]
    start, end = lines[0].get(M.VAL_REWARD_INITIAL), (val[-1][M.VAL_REWARD] if val else None)
    checks = {"books": True, "stall": longest <= stall_s,
              "memory": all(g["rss_ok"] and g["fds_ok"] for g in growth.values()),
              "publication": last <= PUBLISH_GROWTH * first + 0.2,
              "learned": start is not None and end is not None and end > start}
    return {"ok": all(checks.values()), "checks": checks, "steps": len(lines), "books": books,
            "longest_stall_s": round(longest, 2), "publish_s_first_last_quarter": [round(first, 4), round(last, 4)],
            "val_reward_start_end": [start, end], "processes": growth}


def soak(out: Path, *, steps: int, seed: int, every_s: float, stall_s: float, overrides: list[str]) -> dict:
    run_id = f"soak-{seed}-{int(time.time())}"
    rng = random.Random(seed)
    job = JobUnderTest(out / "run", None, run_id, "--actors", "2", f"trainer.total_steps={steps}",
                       f"cluster.max_restarts={RESTARTS}", "weightsync.timeout_s=5", *overrides)
    sampler = Sampler(job.proc.pid)
    threading.Thread(target=sampler.run, daemon=True).start()
    chaos, log = Chaos(job, run_id, rng, 2), []
    t0 = time.monotonic()
    try:
        job.connect()
        job.wait_step(1)
        while job.proc.poll() is None:
            time.sleep(rng.expovariate(1.0 / every_s))
            if job.proc.poll() is None and job.step() < steps - 2:   # the last steps end the job undisturbed
                if kind := chaos.inject():
                    log.append((round(time.monotonic() - t0, 1), kind))
                    print(f"{log[-1][0]:8.1f} s  step {job.step():6d}  {kind}", flush=True)
        code = job.finish()
    finally:
        sampler.stop.set()
        job.kill()
    assert code == 0, f"the job exited {code}: {job.err[-3000:]}"
    again = LocalRedis(job.run_dir / "redis")   # the job stopped its server: its AOF holds the books
    try:
        books = verdicts(job, connect(again.url), run_id, stall_s, sampler)
    finally:
        again.stop()
    result = {"seed": seed, "minutes": round((time.monotonic() - t0) / 60, 1), "faults": chaos.done, **books}
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tests/chaos/soak.py", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6000, help="learner steps the job trains (its length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=float, default=20.0, help="mean seconds between faults")
    p.add_argument("--stall-s", type=float, default=120.0, help="the longest gap allowed between two steps")
    p.add_argument("--out", default="runs/soak")
    p.add_argument("overrides", nargs="*", help="job overrides (key=value), after --")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = soak(out, steps=a.steps, seed=a.seed, every_s=a.every, stall_s=a.stall_s, overrides=a.overrides)
    print(json.dumps({k: v for k, v in result.items() if k != "processes"}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
