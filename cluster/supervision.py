"""A job's supervision until learner rank 0 returns: processes that die or raise are restarted within
cluster.max_restarts (an actor's leases go back to the queue first), silent or stalled actors killed, the actor
count kept at cluster.scale's target, a learner stuck in one phase reported, and the local Redis server kept up.
Learner or ingest failures end the job; the job goes on while any actor is left."""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import threading
import time
from pathlib import Path

from buffer.store import reclaim_leases
from cluster.context import JobContext
from cluster.cpu import CpuLog
from cluster.errors import JobError
from cluster.processes import Processes
from cluster.progress import Progress
from cluster.redis_local import LocalRedis

log = logging.getLogger("cluster")

SPAWN_PER_TICK = 8           # actors cluster.scale may start per monitor tick (the progress line stays live)
MONITOR_POLL_S = 0.5        # how often the launcher checks processes and refreshes the progress line
ALL_REJECTED_FATAL = 64     # groups rejected with none accepted: the job cannot train, so it fails (not starves)
REDIS_WATCH_S = 0.2         # how often the launcher checks its local Redis server is alive
# Ray's answers to the run() we queue right after a death or our own kill, when it reaches the
# process before or during its restart: not a new death, the restart is already counted.
# "is restarting" always; "was restarted", or "temporarily unavailable" (the call reached the old process before
# Ray noticed it died, as after our own kill of a silent actor), only within RESPAWN_RACE_S of our respawn.
RESUBMITTED_TOO_EARLY = ("The actor is restarting", "The actor was restarted",
                         "The actor is temporarily unavailable")
# "was restarted" can also describe a later, real death; within this long of our respawn it is ours
# (Ray restarts a process in about a second; seen on the H200 one second after the kill).
RESPAWN_RACE_S = 10.0


class Supervisor:
    """The monitor loop over a started job's processes, and what it does about each failure."""

    def __init__(self, ctx: JobContext, procs: Processes, redis_watch: RedisWatch | None = None):
        self.ctx, self.procs, self.redis_watch = ctx, procs, redis_watch
        c = ctx.cfg.cluster
        self.stall = LearnerStall(ctx.r, ctx.keys, ctx.run_dir, c.learner_stall_s)

    def redis_failed(self) -> str | None:
        """Why the job's own Redis server is down for good (its watchdog gave up), or None."""
        return self.redis_watch.failed if self.redis_watch is not None else None

    def _pids(self) -> dict[int, str]:
        return self.procs.pids(self.redis_watch.redis if self.redis_watch is not None else None)

    def run(self) -> tuple[dict, dict]:
        """Until learner rank 0 returns: its summary, and the runs still going (ref -> role) to drain."""
        import ray

        cfg, r, keys = self.ctx.cfg, self.ctx.r, self.ctx.keys
        progress = Progress(cfg, r, keys)
        cpu = CpuLog(self.ctx.run_dir)
        summary = None
        pending = dict(self.procs.refs)
        while summary is None:
            if failed := self.redis_failed():
                raise JobError(failed)
            done, _ = ray.wait(list(pending), timeout=MONITOR_POLL_S)
            for ref in done:
                role = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except Exception as e:
                    self.failed(role, f"died: {root_message(e)}", pending, process_died=is_death(e))
                    continue
                if role == "learner-0":
                    summary = result
                elif role.startswith("actor") and r.exists(keys.drain(role)):
                    self._actor_gone(role, "drained")
                elif not role.startswith("learner"):
                    raise JobError(f"{role} exited before the learner finished (log: {self.ctx.run_dir}/logs/{role}.log)")
            if summary is None:
                self._kill_silent(pending)
                self.stall.check()
                self._scale(pending)
                replaying = bool(cfg.buffer.replay_dir)
                if not replaying and not any(role.startswith("actor") for role in pending.values()):
                    raise JobError("no rollout actor is left; the learner would wait forever")
                self._check_rejections()
            progress.update()
            cpu.sample(self._pids)
        cpu.sample(self._pids, force=True)
        progress.finish()
        return summary, pending

    def _check_rejections(self) -> None:
        """Every group rejected so far, and ALL_REJECTED_FATAL of them: the data, model and limits do not
        fit together (e.g. prompts longer than the model's positions), so fail with the reason, not starve."""
        r, keys = self.ctx.r, self.ctx.keys
        accepted, rejected = r.hmget(keys.ingest, ["accepted", "rejected"])  # this launch's counts
        if int(accepted or 0) or int(rejected or 0) < ALL_REJECTED_FATAL:
            return
        counts = {k.decode(): int(v) for k, v in r.hgetall(keys.rejected).items()}
        last = r.xrevrange(keys.deadletter, count=1)
        example = last[0][1].get(b"error", b"").decode(errors="replace") if last else ""
        raise JobError(f"the job rejected all of the first {int(rejected)} groups and accepted none (the ingest "
                       f"judges their values; actors refuse prompts their engine cannot take and groups whose reward "
                       f"function fails) (reasons {counts}); e.g. {example!r}. Nothing can be trained: fix the data "
                       f"or the limits (dead letters in Redis stream {keys.deadletter})")

    def failed(self, role: str, why: str, pending: dict, *, process_died: bool) -> None:
        """A process died or raised. Actors and the ingest are restarted while restarts are left
        (an actor's leases go back to the queue first); otherwise an actor is dropped and
        anything else fails the job."""
        import ray

        procs, max_restarts = self.procs, self.ctx.cfg.cluster.max_restarts
        n = procs.restarts.get(role, 0)
        since = time.time() - procs.respawned.get(role, -math.inf)
        if not role.startswith("learner") and resubmitted_too_early(why, since):
            if (pid := procs.new_incarnation(role)) is None:
                procs.respawned.pop(role, None)  # forgiven once per relaunch: a second answer is a new death
                # Not a new death: our run() for the restarted process reached Ray before the process was
                # back, or the old process as it went. Ask again; the restart is already counted.
                log.info("%s: the call queued for its restart reached it before it was back (%s); asking again",
                         role, why)
                pending[procs.run(role)] = role
                return
            # the restarted process (pid `pid`) had answered: it died too, a death of its own to count
            why = f"died again {since:.1f} s after its restart (pid {pid}): {why}"
        if role.startswith("learner") or (n >= max_restarts and not role.startswith("actor")):
            raise JobError(f"{role} failed: {why} (log: {self.ctx.run_dir}/logs/{role}.log)")
        if n >= max_restarts:
            ray.kill(procs.handles[role], no_restart=True)
            self._actor_gone(role, why)
            self._retire_actor_slot(role)
            return
        procs.restarts[role] = n + 1
        if role.startswith("actor"):
            self._actor_gone(role, why, restarting=f"restarting ({n + 1}/{max_restarts})")
        else:
            log.warning("%s %s; restarting (%d/%d)", role, why, n + 1, max_restarts)
            print(f"\n{role} {why}; restarting ({n + 1}/{max_restarts})", flush=True)
        handle = procs.handles[role]
        procs.forget_incarnation(role)   # the process that failed: its restart is told apart by its pid
        if not process_died:  # it raised: replace the process too, so nothing of its state survives
            ray.kill(handle, no_restart=False)
        procs.spawned[role] = procs.respawned[role] = time.time()
        pending[procs.run(role)] = role  # queued until Ray has restarted the process

    def _actor_gone(self, role: str, why: str, restarting: str = "") -> None:
        r, keys = self.ctx.r, self.ctx.keys
        n = reclaim_leases(r, keys, role)
        r.hdel(keys.members, role)
        r.hdel(keys.ws_members, role)
        if not restarting:
            self.procs.handles.pop(role, None)
        tail = f"; {restarting}" if restarting else ""
        level = logging.INFO if why == "drained" else logging.WARNING   # a drain is the operator's own wish
        log.log(level, "%s %s; %d leased prompt groups returned to the queue%s", role, why, n, tail)
        print(f"\n{role} {why}; {n} leased groups returned to the queue{tail}", flush=True)

    def _retire_actor_slot(self, role: str) -> None:
        """An actor that used up its restarts is not replaced: with a scale target set, the target drops by one
        (else _scale would start a fresh actor in its place with a fresh restart budget, and a crash-looping
        actor would respawn forever)."""
        r, keys = self.ctx.r, self.ctx.keys
        if r.get(keys.scale_target) is not None:
            target = r.decr(keys.scale_target)
            log.warning("%s used up its restarts: actor target lowered to %d", role, target)
            print(f"{role} used up its restarts: actor target lowered to {target}", flush=True)

    def _kill_silent(self, pending: dict) -> None:
        """Kill and restart an actor gone silent (its weight-sync thread's beat older than cluster.actor_silent_s:
        a stopped or hung process) or stalled (its loop's heartbeat older than cluster.actor_stall_s while that
        thread still beats: a reward function or an engine call that hangs). Only beats of the incarnation
        Ray runs now count (an actor loading its engine has not beaten yet)."""
        r, keys, spawned = self.ctx.r, self.ctx.keys, self.procs.spawned
        now, stall_s, silent_s = time.time(), self.ctx.cfg.cluster.actor_stall_s, self.ctx.cfg.cluster.actor_silent_s
        beats = {a.decode(): float(t) for a, t in r.hgetall(keys.ws_members).items()}
        members = {a.decode(): json.loads(m) for a, m in r.hgetall(keys.members).items()}
        for ref, role in list(pending.items()):
            if not role.startswith("actor"):
                continue
            info = members.get(role, {})
            beat, loop = beats.get(role, 0.0), float(info.get("heartbeat", 0.0))
            if beat > spawned[role] and now - beat > silent_s:
                why = f"went silent for {now - beat:.0f}s (killed)"
            elif stall_s and loop > spawned[role] and now - loop > stall_s:
                why = (f"made no progress for {now - loop:.0f}s (cluster.actor_stall_s={stall_s:g}: a reward "
                       f"function or an engine call that hangs?), killed; its stacks at the stall are in "
                       f"{self.ctx.run_dir}/logs/{role}.log")
            else:
                continue
            killed = False
            if info.get("host") == socket.gethostname():  # a stopped process cannot answer Ray's kill RPC
                try:
                    os.kill(info["pid"], signal.SIGKILL)
                    killed = True
                except ProcessLookupError:
                    pass
            pending.pop(ref)
            self.failed(role, why, pending, process_died=killed)

    def _scale(self, pending: dict) -> None:
        """Start or drain actors to reach `<run>:scale_target` (set by `python -m cluster.scale`)."""
        r, keys = self.ctx.r, self.ctx.keys
        target = r.get(keys.scale_target)
        actors = sorted((a for a in pending.values() if a.startswith("actor")), key=lambda a: int(a.split("-")[1]))
        live = [a for a in actors if not r.exists(keys.drain(a))]
        if target is None:
            return
        target = int(target)
        for _ in range(min(target - len(live), SPAWN_PER_TICK)):
            role, ref = self.procs.spawn_actor(self.procs.next_actor)
            self.procs.next_actor += 1
            pending[ref] = role
            log.info("scaled up: started %s", role)
        for role in live[target:] if target < len(live) else []:
            r.set(keys.drain(role), 1)
            log.info("scaled down: draining %s", role)


class LearnerStall:
    """Says once per stall that learner rank 0 has been in one phase other than waiting for groups for longer
    than cluster.learner_stall_s (0: never), naming the phase and where its stacks are; the job goes on (a
    learner cannot be restarted without losing its state since the last checkpoint: the user decides). A phase
    is timed by this process's clock from when it is first seen here (rank 0 may be on a node whose clock is
    skewed against ours)."""

    def __init__(self, r, keys, run_dir: Path, stall_s: float):
        self.r, self.keys, self.run_dir, self.stall_s = r, keys, run_dir, stall_s
        self.phase: list = [None, 0.0, False]   # learner rank 0's phase as seen here, when first, reported

    def check(self) -> None:
        stall_s = self.stall_s
        at = {k.decode(): v.decode() for k, v in self.r.hgetall(self.keys.learner_phase).items()} if stall_s else {}
        if not at or at["phase"] == "wait":
            return
        seen = (at["phase"], at["version"], at["since"])
        if self.phase[0] != seen:
            self.phase = [seen, time.monotonic(), False]
        stalled = time.monotonic() - self.phase[1]
        if self.phase[2] or stalled <= stall_s:
            return
        self.phase[2] = True
        why = (f"learner-0 has been in its {at['phase']} phase (weights version {at['version']}) for {stalled:.0f}s "
               f"(cluster.learner_stall_s={stall_s:g}: a held-out reward function or a file system that hangs?); "
               f"its stacks are in {self.run_dir}/logs/learner-0.log unless the process is stopped. The job goes "
               f"on; if it stays stuck, stop it (Ctrl-C) and continue it with --resume --run-dir {self.run_dir}")
        log.warning("%s", why)
        print(f"\n{why}", flush=True)


class RedisWatch:
    """Restarts the job's local Redis server when it dies (from its AOF, same port): every process rides out
    the outage by retrying (runbase.keys.REDIS_OUTAGE_S). `failed` says why once it gives up."""

    def __init__(self, redis: LocalRedis, max_restarts: int):
        self.redis, self.max_restarts = redis, max_restarts
        self.closing = threading.Event()   # set when the job closes: no restart after that
        self.failed: str | None = None     # why the local Redis is down for good (set whole, once)

    def start(self) -> None:
        threading.Thread(target=self.run, name="redis-watch", daemon=True).start()

    def run(self) -> None:
        failed = None   # set whole, once: the monitor thread reads `failed` while this runs
        while not self.closing.wait(REDIS_WATCH_S):
            if self.redis.alive():
                continue
            if self.redis.restarts >= self.max_restarts:
                failed = f"local redis-server died {self.redis.restarts + 1} times; not restarting it"
                break
            log.warning("local redis-server died (code %s); restarting it from its AOF", self.redis.proc.returncode)
            print(f"\nredis-server died; restarting from its AOF ({self.redis.restarts + 1}/"
                  f"{self.max_restarts})", flush=True)
            try:
                self.redis.restart()
            except (OSError, RuntimeError, TimeoutError) as e:   # e.g. its AOF on a full disk: it exits at once
                failed = f"local redis-server could not be restarted: {str(e).splitlines()[0]}"
                break
        if failed:
            self.failed = f"{failed} ({self.redis.why_down()})"
            log.error("%s", self.failed)
        # A server this thread restarted dies with it: PR_SET_PDEATHSIG fires when the *thread* that started it
        # ends, not the process. Stay until the launcher exits, or close() loses Redis (SIGTERM) before it is
        # done with it (seen: an interrupted job after a Redis restart wrote no status.json and took 30 s more).
        threading.Event().wait()


def resubmitted_too_early(why: str, since_spawn_s: float) -> bool:
    """Whether a failed run() is Ray refusing or cutting short the call we queued for a process we
    are restarting, rather than a new death to count."""
    restarting, *racing = RESUBMITTED_TOO_EARLY
    return restarting in why or (since_spawn_s < RESPAWN_RACE_S and any(a in why for a in racing))


def is_death(e: BaseException) -> bool:
    """The process itself died (Ray restarts it), as opposed to the component raising."""
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError)


def root_message(e: BaseException) -> str:
    """The innermost useful line of a Ray task error."""
    text = str(e).strip().splitlines()
    for line in reversed(text):
        if "failed:" in line or "Error" in line:
            return line.strip()
    return text[-1] if text else type(e).__name__
