"""A soak: one job under a seeded random schedule of faults until it has trained its steps, checked as it goes.

    python tests/chaos/soak.py --minutes 120 --seed 1 [--every 20] [--out DIR] [--kinds a,b] [-- job overrides...]
    python tests/chaos/soak.py --steps 9000 ...  # a length in steps instead
    make soak MINUTES=120                        # two hours of the embedded job on 2 cores

With --minutes the run's length follows the clock: each time a learner fault ends a job, the soak resumes it with
a `trainer.total_steps` re-planned from the pace so far (restarts included) and the minutes left (`planned_steps`),
so the soak ends within a few minutes of its budget however loaded the machine is; --steps is then the first job's
length, should no learner fault come.

The soak starts the run's Redis itself (tests/chaos/soaknet.py) and gives the job `--redis-url` pointing at a
loopback proxy in front of it; another proxy takes the place of each ingest shard's announced address. Faults, one
every `--every` seconds on average (exponential gaps), in a seeded random order that runs through every kind (of
`--kinds`, default all) before it repeats one:
  kill_actor        SIGKILL of a live rollout actor (Ray restarts it; its leases go back to the queue)
  kill_ingest       SIGKILL of the ingest (restarted on a new port; actors resend what was not acked)
  kill_redis        SIGKILL of the soak's redis-server, started again on its port from its AOF
  pause             SIGSTOP of an actor or the ingest for PAUSE_S, then SIGCONT
  scale             the actor count moved up or down by one (`cluster.scale`), between 1 and MAX_ACTORS
  drop_redis        every process's Redis connections cut at once by the proxy (clients reconnect and retry)
  drop_ingest_link  every actor's connection to the ingest cut by its proxy (ZeroMQ reconnects; what was not
                    acked is resent)
  kill_learner      SIGKILL of the learner: the job fails; the soak starts it again with `--resume`
  unwritable_checkpoint  a regular file where the learner's next checkpoint folder goes: the save fails with
                    the file system's own error, the job fails naming the path, the soak removes the file and
                    resumes
The last two end an incarnation of the run; with either in the mix the job checkpoints every CHECKPOINT_EVERY
steps, and the run goes on, resumed, until it has trained its steps. Each process's restarts are capped by
`cluster.max_restarts`, set high here so a long soak does not use them up.

Checked: the books balance at the end over every incarnation (tests/chaos/ledger.py: every step counted once,
every group issued trained once, waiting, dropped with a reason, or gone back to the queue); no gap between two
trained steps of one incarnation is longer than `--stall-s` (a restart's gap is reported apart, `restart_gaps_s`);
each process's RSS and open file descriptors, sampled every SAMPLE_S, do not grow after the warm-up (slopes
reported per process, and bounded); the weights' publication time at the end is not a multiple of the one at the
start; the held-out reward at the end beats step 0. Writes `soak.json` (faults by kind, incarnations, connections
cut, the books, the longest stall, the slopes, publication first vs last quarter and by hour, held-out start and
end) and prints it, and plots the run's course (soak_plot.py: `soak_reward.png`).
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
sys.path[:0] = [str(HERE), str(ROOT), str(ROOT / "tests")]

from jobs import JobUnderTest  # noqa: E402 - after the path set-up above: this folder's helpers
from ledger import check_ledger, counted_steps  # noqa: E402
from soak_plot import plot  # noqa: E402
from soaknet import SoakNet  # noqa: E402

from learner import metric_names as M  # noqa: E402
from runbase import checkpoints  # noqa: E402

FAULTS = ("kill_actor", "kill_ingest", "kill_redis", "pause", "scale", "drop_redis", "drop_ingest_link",
          "kill_learner", "unwritable_checkpoint")
RESTARTING = ("kill_learner", "unwritable_checkpoint")   # faults that end the job: the soak resumes it
ACTORS = 2             # each incarnation starts with this many actors (scale moves it)
CHECKPOINT_EVERY = 5   # with a learner fault in the mix: a resume redoes at most this many steps
# the newest checkpoints kept (trainer.keep_checkpoints): one every 5 steps, never pruned, filled the 2-core VM's
# disk 74 minutes into a 2-hour soak (1.8 MB each: 13 GB by 37,000 steps); a resume needs only the newest
KEEP_CHECKPOINTS = 3
MAX_INCARNATIONS = 100  # a run that dies this often without finishing is failing, not being soaked
PAUSE_S = 2.0          # a SIGSTOP long enough to miss heartbeats and acks, short of ACTOR_SILENT_S (a kill)
MAX_ACTORS = 4         # the scale fault keeps the actor count in 1..MAX_ACTORS
SAMPLE_S = 5.0         # how often each process's RSS and open files are sampled
END_POLL_S = 1.0       # how soon the end of a job is seen between two faults
WARMUP_S = 30.0        # a process's first seconds are its warm-up (imports, model load, caches, allocators)
MIN_JUDGED = 6         # samples after its warm-up a process needs to be judged (one started late is not)
RESTARTS = 1000        # cluster.max_restarts for the soak: faults, not the cap, decide what dies
FD_GROWTH = 64         # open files a process may gain after warm-up (sockets of restarted peers come and go)
RSS_GROWTH = 1.5       # RSS after warm-up may reach this multiple of the warm-up's largest
PUBLISH_GROWTH = 3.0   # the last quarter's mean publication time may be this multiple of the first's (+ 0.2 s)
MIN_LEFT_STEPS = CHECKPOINT_EVERY + 5   # a resumed job's least length: past its first checkpoint, then its end


def role_pid(run_dir: Path, role: str) -> int | None:
    """The pid of the role's latest incarnation, from its log's start line."""
    log = run_dir / "logs" / f"{role}.log"
    found = re.findall(rf"pid=(\d+) INFO proc: {re.escape(role)} started", log.read_text()) if log.exists() else []
    return int(found[-1]) if found else None


class Sampler:
    """RSS and open files of every process of the trees under `roots()` (the job's launcher, the soak's Redis
    server: both change as incarnations and restarts come), every SAMPLE_S, by (pid, name)."""

    def __init__(self, roots):
        self.roots, self.samples, self.stop = roots, {}, threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(SAMPLE_S):
            procs = []
            for root in self.roots():
                try:
                    procs += [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
                except psutil.NoSuchProcess:   # between two incarnations, or a server being restarted
                    continue
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
    """The seeded fault schedule against a run, one incarnation (a job) after another."""

    def __init__(self, net: SoakNet, run_dir: Path, run_id: str, rng: random.Random, *, kinds, steps: int,
                 max_restarts: float):
        self.net, self.run_dir, self.run_id, self.rng, self.kinds, self.steps = net, run_dir, run_id, rng, kinds, steps
        self.max_restarts = max_restarts   # learner faults at most (each costs a job's start-up)
        self.done: dict[str, int] = {k: 0 for k in kinds}
        self.bag: list[str] = []
        self.job: JobUnderTest | None = None
        self.actors = ACTORS
        self.floor = 0                     # the step from which a learner fault may end this incarnation
        self.learner_killed = False        # by this incarnation's kill_learner: the job fails for it
        self.blocked: Path | None = None   # the file in the way of a checkpoint (unwritable_checkpoint)

    def begin(self, job: JobUnderTest) -> None:
        """A new incarnation: faults start once its learner has trained a step; a learner fault only after its
        first checkpoint (floor), so each incarnation leaves the run further on than the one before."""
        metrics = self.run_dir / "metrics.jsonl"
        lines = metrics.read_text().count("\n") if metrics.exists() else 0
        job.wait(lambda: metrics.exists() and metrics.read_text().count("\n") > lines, "a step of the new job")
        first = json.loads(metrics.read_text().splitlines()[lines])[M.STEP]
        self.job, self.actors, self.floor = job, ACTORS, first + CHECKPOINT_EVERY + 1
        self.learner_killed = False

    def ended(self, code: int) -> None:
        """The job failed before its steps: by a learner fault of the soak's, and said so; then the way is cleared
        for `--resume` (the file in the checkpoint's way removed, as an operator would)."""
        err = self.job.err
        if self.blocked is not None and f"checkpoint {self.blocked} could not be written" in err:
            self.blocked.unlink()
            self.blocked = None
        elif not self.learner_killed:
            raise AssertionError(f"the job exited {code} with no learner fault of the soak's to explain it: "
                                 f"{err[-3000:]}{self.job.log_tails()}")
        assert code == 1 and "learner-0 failed" in err, f"the job exited {code}, not naming the learner: {err[-3000:]}"

    def inject(self) -> str | None:
        if not self.bag:   # every kind once, in a seeded order, before any repeats: a short soak sees them all
            self.bag = self.rng.sample(self.kinds, len(self.kinds))
        kind = self.bag.pop()
        if kind in RESTARTING and sum(self.done[k] for k in RESTARTING) >= self.max_restarts:
            return None
        if getattr(self, kind)():
            self.done[kind] += 1
            return kind
        if kind in RESTARTING:   # not possible yet (no checkpoint in this incarnation): tried again after the others
            self.bag.insert(0, kind)   # in the bag, not dropped, or a slow start-up spends the restarts on one kind
        return None

    def _live_actor_pid(self) -> int | None:
        members = self.net.r.hgetall(f"{self.run_id}:members")
        pids = sorted(json.loads(v)["pid"] for v in members.values())
        return self.rng.choice(pids) if pids else None

    def kill_actor(self) -> bool:
        return _signal(self._live_actor_pid(), signal.SIGKILL)

    def kill_ingest(self) -> bool:
        return _signal(role_pid(self.run_dir, "ingest"), signal.SIGKILL)

    def kill_redis(self) -> bool:
        self.net.kill_redis()
        return True

    def pause(self) -> bool:
        pid = self._live_actor_pid() if self.rng.random() < 0.5 else role_pid(self.run_dir, "ingest")
        if not _signal(pid, signal.SIGSTOP):
            return False
        time.sleep(PAUSE_S)
        return _signal(pid, signal.SIGCONT) or True

    def scale(self) -> bool:
        n = min(MAX_ACTORS, max(1, self.actors + self.rng.choice((-1, 1))))
        if n == self.actors:
            return False
        subprocess.run([sys.executable, "-m", "cluster.scale", "--run-dir", str(self.run_dir), "--actors",
                        str(n)], capture_output=True, timeout=60, cwd=ROOT)
        self.actors = n
        return True

    def drop_redis(self) -> bool:
        return self.net.redis_proxy.drop() > 0

    def drop_ingest_link(self) -> bool:
        return self.net.ingest.drop() > 0

    def kill_learner(self) -> bool:
        if self.job.step() < self.floor:
            return False
        pid = self.net.r.hget(f"{self.run_id}:learner", "pid")
        self.learner_killed = _signal(int(pid) if pid else None, signal.SIGKILL)
        return self.learner_killed

    def unwritable_checkpoint(self) -> bool:
        """A regular file where the checkpoint after next goes (the next may be being written already): root
        ignores permissions, but no one can make a folder where a file is (FileExistsError from the save)."""
        step = (max(self.job.step(), self.floor) // CHECKPOINT_EVERY + 2) * CHECKPOINT_EVERY
        path = checkpoints.folder(self.run_dir, step)
        if self.blocked is not None or step >= self.steps - 2 or path.exists():
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("not a checkpoint: a file in the way of the learner's save (tests/chaos/soak.py)\n")
        self.blocked = path
        return True


def planned_steps(done: int, elapsed_s: float, left_s: float) -> int:
    """A timed soak's run length for its next job: the steps done plus what the pace so far (`done` over
    `elapsed_s`, restarts included) fits in the `left_s` seconds left, and at least MIN_LEFT_STEPS more."""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    return done + max(MIN_LEFT_STEPS, round(rate * max(left_s, 0.0)))


def publish_by_hour(lines: list[dict]) -> list[list]:
    """The publisher's mean time per version in each hour of the run, counted from the first step line that
    carries one, as [hour, mean seconds, step lines, seconds of the hour the lines span]: a 2-hour soak's first
    and last hour side by side, the span telling a short last hour (hours without a publication left out)."""
    pub = [(m[M.TIME], m[M.WS_PUBLISH_S]) for m in lines if M.WS_PUBLISH_S in m and M.TIME in m]
    if not pub:
        return []
    t0, hours = min(t for t, _ in pub), {}
    for t, s in pub:
        hours.setdefault(int((t - t0) // 3600), []).append((t, s))
    return [[h, round(sum(s for _, s in v) / len(v), 4), len(v), round(max(t for t, _ in v) - min(t for t, _ in v))]
            for h, v in sorted(hours.items())]


def _signal(pid: int | None, sig) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def run_incarnation(job: JobUnderTest, chaos: Chaos, rng: random.Random, every_s: float, steps: int,
                    log: list, t0: float) -> int:
    """Faults against one job until it ends (logged as (seconds since t0, kind)); its exit code."""
    try:
        chaos.begin(job)
        while job.proc.poll() is None:
            due = time.monotonic() + rng.expovariate(1.0 / every_s)
            while job.proc.poll() is None and time.monotonic() < due:   # an end is seen at once, whatever --every
                time.sleep(min(END_POLL_S, max(0.0, due - time.monotonic())))
            if job.proc.poll() is None and job.step() < steps - 2:   # the last steps end the job undisturbed
                if kind := chaos.inject():
                    log.append((round(time.monotonic() - t0, 1), kind))
                    print(f"{log[-1][0]:8.1f} s  step {job.step():6d}  {kind}", flush=True)
        return job.finish()
    finally:
        job.kill()


def verdicts(run_dir: Path, r, run_id: str, stall_s: float, sampler: Sampler) -> dict:
    """What the soak checks once the run has ended (see the module docstring); `ok` is all of them."""
    lines = counted_steps(run_dir)
    books = check_ledger(r, run_id, run_dir, steps=len(lines))
    # A resumed incarnation's first line (it carries val/reward_initial) follows a restart, not a stall of
    # training: between the learner's death and that line no learner runs at all, and the gap is the job's
    # start-up (Ray, the model, the engines) plus the steps redone since the last checkpoint, which the soak
    # cannot bound without bounding the machine. Those gaps are reported apart; the stall check is for a
    # running job that stops training.
    gaps, restarts = [], []
    for a, b in zip(lines, lines[1:]):
        if M.TIME in a and M.TIME in b:
            (restarts if M.VAL_REWARD_INITIAL in b else gaps).append(round(b[M.TIME] - a[M.TIME], 2))
    longest = max(gaps, default=0.0)
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
            "longest_stall_s": round(longest, 2), "restart_gaps_s": restarts,
            "publish_s_first_last_quarter": [round(first, 4), round(last, 4)],
            "publish_s_by_hour": publish_by_hour(lines),
            "val_reward_start_end": [start, end], "processes": growth,
            "checkpoints_left": len(checkpoints.complete(run_dir)), "run_dir_mb": megabytes(run_dir)}


def megabytes(folder: Path) -> float:
    """What a run left on disk (the soak reports it: a run's footprint must not grow with its length)."""
    return round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20, 1)


def soak(out: Path, *, steps: int, seed: int, every_s: float, stall_s: float, overrides: list[str],
         kinds: tuple[str, ...] = FAULTS, max_restarts: float = float("inf"), own_ray: bool = True,
         minutes: float | None = None) -> dict:
    """The soak (module docstring); `max_restarts` bounds the learner faults (a short soak's length is mostly the
    start-ups of the jobs they end). `own_ray=False`: the jobs join the test process's shared Ray
    (tests/ray_shared.py), whose processes the sampler does not see (it follows the launcher's tree)."""
    assert kinds and set(kinds) <= set(FAULTS), f"fault kinds are {FAULTS}, not {kinds}"
    out = out.resolve()   # the job names paths absolute (a blocked checkpoint's error): `--out runs/soak` must match
    run_id, run_dir = f"soak-{seed}-{int(time.time())}", out / "run"
    rng = random.Random(seed)
    net = SoakNet(out / "redis", run_id)
    args = ["--actors", str(ACTORS), f"cluster.max_restarts={RESTARTS}",
            "weightsync.timeout_s=5", *([f"trainer.checkpoint_every={CHECKPOINT_EVERY}",
                                          f"trainer.keep_checkpoints={KEEP_CHECKPOINTS}"] * bool(
                set(kinds) & set(RESTARTING))), *overrides]
    lengths: list[int] = []   # each job's trainer.total_steps
    chaos, log, t0 = Chaos(net, run_dir, run_id, rng, kinds=kinds, steps=steps,
                                                   max_restarts=max_restarts), [], time.monotonic()
    sampler = Sampler(lambda: [p for p in (chaos.job and chaos.job.proc.pid, net.server.proc.pid) if p])
    threading.Thread(target=sampler.run, daemon=True).start()
    try:
        for incarnation in range(1, MAX_INCARNATIONS + 1):
            if minutes and incarnation > 1:   # the run's length re-planned on the clock (planned_steps)
                elapsed = time.monotonic() - t0
                steps = chaos.steps = planned_steps(len(counted_steps(run_dir)), elapsed, 60 * minutes - elapsed)
            lengths.append(steps)
            job = JobUnderTest(run_dir, net.r, run_id, *(["--resume"] if incarnation > 1 else []), *args,
                               f"trainer.total_steps={steps}", redis_url=net.url, own_ray=own_ray)
            if (code := run_incarnation(job, chaos, rng, every_s, steps, log, t0)) == 0:
                break
            chaos.ended(code)
        else:
            raise AssertionError(f"the run did not finish in {MAX_INCARNATIONS} incarnations")
        assert net.ingest.error is None, f"the soak's ingest proxying stopped: {net.ingest.error!r}"
        books = verdicts(run_dir, net.r, run_id, stall_s, sampler)
        cut = {"redis": net.redis_proxy.dropped, "ingest": net.ingest.cut()}
    finally:
        sampler.stop.set()
        net.close()
    result = {"seed": seed, "minutes": round((time.monotonic() - t0) / 60, 1), "minutes_planned": minutes,
              "faults": chaos.done, "lengths": lengths,
              "incarnations": incarnation, "connections_cut": cut, **books}
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(run_dir, out / "soak_reward.png", title=f"soak of {result['minutes']} min, seed {seed}")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tests/chaos/soak.py", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=35000,
                   help="learner steps the job trains (its length; with --minutes, the first job's)")
    p.add_argument("--minutes", type=float, default=None,
                   help="the soak's length on the clock: the run's steps re-planned at each learner fault")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=float, default=20.0, help="mean seconds between faults")
    p.add_argument("--stall-s", type=float, default=120.0, help="the longest gap allowed between two steps")
    p.add_argument("--out", default="runs/soak")
    p.add_argument("--kinds", default=",".join(FAULTS), help="the fault kinds to inject, comma-separated")
    p.add_argument("overrides", nargs="*", help="job overrides (key=value), after --")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    kinds = tuple(a.kinds.split(","))
    if a.minutes is not None and (a.minutes <= 0 or not set(kinds) & set(RESTARTING)):
        p.error(f"--minutes needs a positive length and a learner fault among the kinds ({', '.join(RESTARTING)}): "
                "the run's length is re-planned when one ends a job")
    result = soak(out, steps=a.steps, seed=a.seed, every_s=a.every, stall_s=a.stall_s, overrides=a.overrides,
                  kinds=kinds, minutes=a.minutes)
    print(json.dumps({k: v for k, v in result.items() if k != "processes"}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
