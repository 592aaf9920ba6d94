"""A job: the local Redis, Ray, and every process of the system, supervised until done.

The launcher only controls: trajectories and weights never pass through it or through
Ray's object store. Any process failing fails the job with the process named, and
`close()` always stops everything it started (Ray actors, Ray itself if local, Redis).

`Job` composes the parts: the preflight checks and the run directory's claim (cluster/preflight.py), where
processes go (cluster/placement.py) and their Ray actors (cluster/processes.py), their supervision
(cluster/supervision.py) and the job's end (cluster/shutdown.py).
"""
from __future__ import annotations

import json
import logging
import os
import time

from buffer.store import reclaim_leases
from cluster.context import JobContext
from cluster.errors import JobError
from cluster.memory import MemoryPlanError, check_job
from cluster.placement import Placement
from cluster.preflight import check_before_ray, check_devices, claim_run_dir, ingest_limits
from cluster.processes import Processes
from cluster.redis_local import LocalRedis
from cluster.rundir import check_resume_redis, write_whole
from cluster.shutdown import Shutdown
# RESPAWN_RACE_S: the launcher's bound as the fault tests (tests/chaos) read it here
from cluster.supervision import RESPAWN_RACE_S, RedisWatch, Supervisor  # noqa: F401
from runbase import net
from runbase.keys import Keys, connect, mark_startup

log = logging.getLogger("cluster")


class Job:
    """One run of the system: `start()`, then `monitor()` until learner rank 0 returns; `close()` always."""

    def __init__(self, cfg):
        run_id, run_dir, self._lock = claim_run_dir(cfg)
        self.ctx = JobContext(cfg=cfg, run_id=run_id, run_dir=run_dir)
        self.redis: LocalRedis | None = None         # the job's own Redis server (none with --redis-url)
        self.redis_watch: RedisWatch | None = None   # and its watchdog
        self.placement = Placement(self.ctx)
        self.procs = Processes(self.ctx, self.placement)
        self.shutdown = Shutdown(self.ctx, self.procs, self.placement)
        self.launched = time.time()          # the start-up timeline's zero (status.json `startup`)

    @property
    def cfg(self):
        return self.ctx.cfg

    @property
    def run_id(self) -> str:
        return self.ctx.run_id

    @property
    def run_dir(self):
        return self.ctx.run_dir

    def start(self) -> None:
        """Checks, Ray, the run's Redis, then every process: the ingest shards, the learner ranks, the actors
        and the evaluator."""
        self.ctx.model_path = check_before_ray(self.cfg, self.run_id)   # before Ray starts: costs nothing
        self.placement.start_ray()
        check_devices(self.cfg)
        self._check_gpu_memory()
        host = self.placement.network()   # the config as it resolved cluster.bind_host and weightsync from here on
        self._open_redis(host)
        self._spawn_all()

    def _check_gpu_memory(self) -> None:
        """Every process's share of each GPU, estimated from the model and the config (cluster/memory.py):
        logged, and a job that cannot fit refused now rather than by an engine or a learner out of memory."""
        import ray

        try:
            lines = check_job(self.cfg, self.ctx.model_path, int(ray.cluster_resources().get("GPU", 0)),
                              self.placement.weight_backend().backend)
        except MemoryPlanError as e:
            raise JobError(str(e)) from e
        for line in lines:
            log.info("GPU memory plan, %s", line)

    def _open_redis(self, host: str) -> None:
        """The run's Redis (--redis-url, or a local server under a watchdog), cleared of what an earlier job of
        this run id left, with the launch marked."""
        ctx, c = self.ctx, self.cfg.cluster
        if c.redis_url:
            ctx.redis_url = c.redis_url
        else:
            self.redis = LocalRedis(self.run_dir / "redis", fsync=c.redis_fsync, host=host,
                                    password=os.environ.get(net.ENV_REDIS_PASSWORD))
            ctx.redis_url = self.redis.url
            self.redis_watch = RedisWatch(self.redis, c.max_restarts)
            self.redis_watch.start()
        keys = ctx.keys = Keys(self.run_id)
        r = ctx.r = connect(ctx.redis_url)
        # left by an earlier run of this id (a resumed job): its stop flags, its actors' membership and
        # its weight-sync rendezvous (new actors must wait for the new learner's address, not dial the dead one)
        # and the newest version it began to send (the new learner's versions bound what the ingest accepts)
        r.delete(keys.stop, keys.stop_ingest, keys.members, keys.ws_members,
                 keys.ws, keys.ws_announce, keys.ingest, keys.ws_begun, keys.startup,
                 keys.ended, keys.scale_target,   # a resumed job runs --actors, not the old target
                 keys.learner_phase)   # the last phase of the job resumed: no new learner's yet
        r.hset(keys.startup, "launcher:launched", repr(self.launched))
        mark_startup(r, keys, "launcher", "redis")
        if c.resume:
            check_resume_redis(r, keys, self.run_dir)
            if r.type(keys.seen) in (b"set", "set"):  # written before `seen` became a zset: the ids
                r.delete(keys.seen)                    # of actors gone with the old job never come back
            n = reclaim_leases(r, keys, None)
            log.info("resuming run %s: %d leases of the previous actors returned to the queue", self.run_id, n)

    def _spawn_all(self) -> None:
        ctx, c, procs = self.ctx, self.cfg.cluster, self.procs
        limits = ingest_limits(self.cfg, ctx.model_path)
        common = procs.common()
        procs.next_actor = c.actors
        write_whole(self.run_dir / "job.json", json.dumps({"run_id": self.run_id, "redis_url": ctx.redis_url}))
        shards = self.cfg.buffer.ingest_shards
        for i in range(shards):  # one shard keeps the role name `ingest`
            procs.spawn("ingest" if shards == 1 else f"ingest-{i}", "buffer.ingest_proc:IngestProcess",
                        {"buffer": self.cfg.buffer, "bind_host": c.bind_host, "run_id": self.run_id,
                         "redis_url": ctx.redis_url, **limits, "shard": i})
        self.placement.place()
        master_addr, port = self.placement.learner_endpoint()
        for rank in range(c.learners):
            procs.spawn(f"learner-{rank}", "learner.train:LearnerProcess",
                        {**common, "rank": rank, "world": c.learners, "master_addr": master_addr,
                         "master_port": port, "run_dir": str(self.run_dir), "model_path": ctx.model_path})
        for i in range(c.actors):
            procs.spawn_actor(i)
        if self.cfg.trainer.val_engine == "vllm":  # held-out evaluation off the learner's loop
            procs.spawn("evaluator", "actors.evaluator:EvaluatorProcess",
                        {**common, "model_path": ctx.model_path, "gpu": self.placement.actor_gpu(0)})
        mark_startup(ctx.r, ctx.keys, "launcher", "spawned")

    def redis_failed(self) -> str | None:
        """Why the job's own Redis server is down for good (its watchdog gave up), or None."""
        return self.redis_watch.failed if self.redis_watch is not None else None

    def monitor(self) -> dict:
        """Supervise until learner rank 0 returns (cluster/supervision.py), then drain the rest in order;
        learner rank 0's summary."""
        import redis

        try:
            supervisor = Supervisor(self.ctx, self.procs, self.redis_watch)
            summary, pending = supervisor.run()
            self.shutdown.drain(pending, supervisor)
            return summary
        except redis.ConnectionError as e:   # every client's retries (REDIS_OUTAGE_S) ran out
            raise JobError(self.redis_failed() or f"Redis at {self.ctx.redis_url} stopped answering ({e})") from e

    def close(self) -> None:
        if self.redis_watch is not None:
            self.redis_watch.closing.set()
        self.shutdown.close(self.redis, self._lock)
