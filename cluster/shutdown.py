"""How a job ends: a finished one drains in order (actors finish their last groups while the ingest still acks
them, then the ingest), an interrupted or failed one is stopped at once; both leave status.json behind, and
`close()` always stops everything the job started (Ray actors, Ray itself if local, Redis)."""
from __future__ import annotations

import json
import logging
import time

from cluster.context import JobContext
from cluster.errors import JobError
from cluster.placement import Placement
from cluster.processes import Processes
from cluster.rundir import write_whole
from cluster.supervision import MONITOR_POLL_S, Supervisor, is_death, root_message

log = logging.getLogger("cluster")

DRAIN_TIMEOUT_S = 30.0      # how long actors and the ingest get to exit after the learner is done
# cluster.profile: an interrupted job's processes see the stop keys and return within a step or a poll, and
# only a run() that returns writes its profile; this long before they are killed (a profile is seconds to write).
PROFILE_GRACE_S = 20.0


class Shutdown:
    """The end of a job, finished or not. `status_written`: status.json is there (the drain's, or close's)."""

    def __init__(self, ctx: JobContext, procs: Processes, placement: Placement):
        self.ctx, self.procs, self.placement = ctx, procs, placement
        self.status_written = False

    def drain(self, pending: dict, supervisor: Supervisor) -> None:
        """After learner rank 0 returned: the processes still running (`pending`, ref -> role) end in order,
        then status.json is written."""
        r, keys = self.ctx.r, self.ctx.keys
        # Drain in order: actors finish their batch (the ingest still acks it), then the ingest.
        r.set(keys.stop, 1)
        # (the evaluator also ends on the stop key; learner ranks past 0 are returning)
        actors = {ref: role for ref, role in pending.items() if role.startswith("actor") or role == "evaluator"}
        ingests = {ref: role for ref, role in pending.items() if role.startswith("ingest")}
        others = {ref: role for ref, role in pending.items() if ref not in actors and ref not in ingests}
        self._drain_actors(actors, ingests, supervisor)   # (updates ingests with the refs of any it restarted)
        r.set(keys.stop_ingest, 1)
        self._drain(others | ingests)
        self.write_status()

    def _drain_actors(self, actors: dict, ingests: dict, supervisor: Supervisor) -> None:
        """Wait for the actors to finish their last batch while still restarting an ingest (shard)
        that dies meanwhile: its actors are waiting for acks, and their groups must reach the stream
        or the books do not balance. `ingests` is updated with the restarted processes' refs."""
        import ray

        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while actors and time.monotonic() < deadline:
            done, _ = ray.wait([*actors, *ingests], timeout=MONITOR_POLL_S)
            for ref in done:
                if ref in actors:
                    role = actors.pop(ref)
                    try:
                        ray.get(ref)
                    except Exception as e:
                        log.warning("%s failed while draining: %s", role, root_message(e))
                    continue
                role = ingests.pop(ref)
                try:
                    ray.get(ref)
                    log.warning("%s exited before the actors drained", role)
                except Exception as e:
                    try:
                        supervisor.failed(role, f"died: {root_message(e)}", ingests, process_died=is_death(e))
                    except JobError as gave_up:  # the learner is done: report, do not fail the finished job
                        log.error("%s", gave_up)
        if actors:
            log.warning("%s did not exit within %ss; stopping them", sorted(actors.values()), DRAIN_TIMEOUT_S)

    def _drain(self, refs: dict) -> None:
        import ray

        if not refs:
            return
        done, not_done = ray.wait(list(refs), num_returns=len(refs), timeout=DRAIN_TIMEOUT_S)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:
                log.warning("%s failed while draining: %s", refs[ref], root_message(e))
        if not_done:
            log.warning("%s did not exit within %ss; stopping them", [refs[r] for r in not_done], DRAIN_TIMEOUT_S)

    def write_status(self) -> None:
        """Final state of the run, readable after Redis is gone: who held which weights, what was rejected."""
        k, r = self.ctx.keys, self.ctx.r
        status = {
            "version": int(r.get(k.version) or 0),
            "checksums": {int(v): c.decode() for v, c in r.hgetall(k.checksums).items()},
            "members": {a.decode(): json.loads(m) for a, m in r.hgetall(k.members).items()},
            "rejected": {a.decode(): int(n) for a, n in r.hgetall(k.rejected).items()},
            "ingest": {a.decode(): b.decode() for a, b in r.hgetall(k.ingest).items()},
            "val_reward": {int(v): float(x) for v, x in r.hgetall(k.val).items()},
            "placement": self.procs.located(),
            "startup": startup_timeline(r.hgetall(k.startup)),
        }
        write_whole(self.ctx.run_dir / "status.json", json.dumps(status, indent=1))
        self.status_written = True

    def _status_before_kill(self) -> None:
        """An interrupted or failed job's status.json (a finished one wrote it after the drain): the members'
        last heartbeats (each actor's groups and seconds holding leases) outlive Redis, best effort. (Named
        for what it saves: it runs once the processes are killed, while Redis still answers.)"""
        if self.status_written:
            return
        try:
            self.write_status()
        except Exception as e:  # Redis may still be what failed
            log.warning("no status.json: %s", e)

    def _await_profiles(self) -> None:
        """The processes' own exits, each up to PROFILE_GRACE_S, once stop is set (killed at once, an interrupted
        profiled job lost every profile: seen on the H200): the ingest last, so the actors' last groups are
        acked (an actor waits for its acks before it returns)."""
        import ray

        def wait(refs: list) -> list:   # the refs still running after the grace
            return ray.wait(refs, num_returns=len(refs), timeout=PROFILE_GRACE_S)[1] if refs else []

        refs = self.procs.refs
        ingest = [ref for ref, role in refs.items() if role.partition("-")[0] == "ingest"]
        left = wait([ref for ref in refs if ref not in ingest])
        self.ctx.r.set(self.ctx.keys.stop_ingest, 1)
        left += wait(ingest)
        if left:
            log.warning("%s did not exit within %ss of the stop: no profile from them",
                        sorted(refs[r] for r in left), PROFILE_GRACE_S)

    def _tell_stop(self) -> bool:
        """The stop keys set (and the job marked over, for operator commands); whether Redis answered."""
        r, keys = self.ctx.r, self.ctx.keys
        try:
            if r is not None:
                r.set(keys.stop, 1)
                r.set(keys.ended, repr(time.time()))   # operator commands: the job is over
                if not self.ctx.cfg.cluster.profile:   # profiled: the ingest acks the actors' last groups first
                    r.set(keys.stop_ingest, 1)
                return True
        except Exception:
            pass
        return False

    def close(self, local_redis, lock) -> None:
        """Stop every process, give Ray's resources back, stop the job's own Redis and free the run directory."""
        redis_up = self._tell_stop()
        try:
            import ray

            if ray.is_initialized():
                if redis_up and self.ctx.cfg.cluster.profile:
                    try:
                        self._await_profiles()
                    except (KeyboardInterrupt, Exception) as e:   # a second Ctrl-C, Redis gone: the kill follows
                        log.warning("not waiting for the profiles: %s", type(e).__name__)
                for actor in self.procs.handles.values():
                    ray.kill(actor)
                # after the kill (a second Ctrl-C while it is written cannot leave processes behind), before
                # Redis stops; a Redis that is gone already cost its retries above: not twice
                if redis_up:
                    self._status_before_kill()
                self.placement.release()   # the cluster's resources back now, not at driver exit
        finally:
            if local_redis is not None:
                local_redis.stop()
            lock.close()   # the run directory is free for a --resume


def startup_timeline(marks: dict) -> dict:
    """The start-up marks (runbase.keys.mark_startup) as seconds after launch, in the order they happened."""
    at = {f.decode(): float(t) for f, t in marks.items()}
    zero = at.get("launcher:launched")
    if zero is None:
        return {}
    return {f: round(t - zero, 3) for f, t in sorted(at.items(), key=lambda ft: ft[1])}
