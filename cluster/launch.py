"""A job: the local Redis, Ray, and every process of the system, supervised until done.

The launcher only controls: trajectories and weights never pass through it or through
Ray's object store. Any process failing fails the job with the process named, and
`close()` always stops everything it started (Ray actors, Ray itself if local, Redis).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

from cluster.configload import dump_yaml
from cluster.progress import Progress

log = logging.getLogger("cluster")

MONITOR_POLL_S = 0.5        # how often the launcher checks processes and refreshes the progress line
DRAIN_TIMEOUT_S = 30.0      # how long actors and the ingest get to exit after the learner is done
# An actor whose weight subscriber (a thread that beats every 0.5 s, whatever the engine is doing)
# has been silent this long is stopped or hung: it is killed and handled like a dead one.
ACTOR_SILENT_S = 15.0
REDIS_WATCH_S = 0.2         # how often the launcher checks its local Redis server is alive


class JobError(RuntimeError):
    pass


class Job:
    def __init__(self, cfg):
        self.cfg = cfg
        c = cfg.cluster
        previous = {}
        if c.resume:  # same run id (Redis namespace) and, unless given, the same Redis data
            job = Path(c.run_dir) / "job.json"
            if not job.exists():
                raise JobError(f"--resume: {job} not found; is {c.run_dir} the directory of an earlier run?")
            previous = json.loads(job.read_text())
        self.run_id = previous.get("run_id") or c.run_id or time.strftime("run-%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        self.run_dir = Path(c.run_dir or Path("runs") / self.run_id).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_yaml(cfg, self.run_dir / "config.yaml")
        self.redis = None
        self.r = None
        self.ray_started = False
        self.procs: dict[str, object] = {}
        self.spawned: dict[str, float] = {}
        self.refs: dict[object, str] = {}
        self.restarts: dict[str, int] = {}
        self._closing = threading.Event()

    def start(self) -> None:
        from buffer.store import Keys, connect
        from cluster.redis_local import LocalRedis, free_port
        from data.tiny_model import resolve_model_path

        c = self.cfg.cluster
        self.model_path = resolve_model_path(self.cfg.model.path, self.cfg.task)
        if c.redis_url:
            self.redis_url = c.redis_url
        else:
            self.redis = LocalRedis(self.run_dir / "redis", fsync=c.redis_fsync)
            self.redis_url = self.redis.url
            threading.Thread(target=self._watch_redis, name="redis-watch", daemon=True).start()
        self.keys = Keys(self.run_id)
        self.r = connect(self.redis_url)
        # left by an earlier run of this id (a resumed job): its stop flags, its actors' membership and
        # its weight-sync rendezvous (new actors must wait for the new learner's address, not dial the dead one)
        self.r.delete(self.keys.stop, self.keys.stop_ingest, self.keys.members, self.keys.ws_members,
                      self.keys.ws, self.keys.ws_announce, self.keys.ingest)
        if c.resume:
            from buffer.store import reclaim_leases

            n = reclaim_leases(self.r, self.keys, None)
            log.info("resuming run %s: %d leases of the previous actors returned to the queue", self.run_id, n)
        self._start_ray()
        vocab = json.loads((Path(self.model_path) / "config.json").read_text())["vocab_size"]
        common = self.common = {"cfg": self.cfg, "run_id": self.run_id, "redis_url": self.redis_url}
        self.next_actor = c.actors
        (self.run_dir / "job.json").write_text(json.dumps({"run_id": self.run_id, "redis_url": self.redis_url}))
        self._spawn("ingest", "buffer.ingest_proc:IngestProcess", {**common, "vocab_size": vocab})
        port = free_port()
        for rank in range(c.learners):
            self._spawn(f"learner-{rank}", "learner.train:LearnerProcess",
                        {**common, "rank": rank, "world": c.learners, "master_addr": "127.0.0.1",
                         "master_port": port, "run_dir": str(self.run_dir), "model_path": self.model_path})
        for i in range(c.actors):
            self._spawn_actor(i)

    def _start_ray(self) -> None:
        import ray

        # Workers inherit these: one intra-op thread each unless a component says otherwise,
        # and no tokenizer thread pools fighting over 2 cores.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        # Processes are placed on devices by config (learner rank r on GPU r, actors.device), not by
        # Ray's GPU accounting, so Ray must not hide GPUs from processes that asked for none.
        os.environ.setdefault("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
        c = self.cfg.cluster
        if c.address:
            ray.init(address=c.address, log_to_driver=False, logging_level=logging.WARNING)
        else:
            ray.init(num_cpus=c.num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING, _temp_dir=None)
            self.ray_started = True

    def _watch_redis(self) -> None:
        """Restart a local Redis server that died (from its AOF, same port): every process rides
        out the outage by retrying (buffer.store.REDIS_OUTAGE_S)."""
        while not self._closing.wait(REDIS_WATCH_S):
            if self.redis.alive():
                continue
            if self.redis.restarts >= self.cfg.cluster.max_restarts:
                log.error("local redis-server died %d times; not restarting it", self.redis.restarts + 1)
                return
            log.warning("local redis-server died (code %s); restarting it from its AOF", self.redis.proc.returncode)
            print(f"\nredis-server died; restarting from its AOF ({self.redis.restarts + 1}/"
                  f"{self.cfg.cluster.max_restarts})", flush=True)
            self.redis.restart()

    def _spawn_actor(self, index: int):
        """An actor on its GPU (cluster/placement.py) when actors run on CUDA without a fixed index."""
        import ray

        from cluster.placement import actor_gpu

        gpu = None
        if self.cfg.actors.device == "cuda":
            n_gpus = int(ray.cluster_resources().get("GPU", 0))
            gpu = actor_gpu(index, n_gpus, self.cfg.cluster.learners) if n_gpus else None
        role = f"actor-{index}"
        return role, self._spawn(role, "actors.rollout:RolloutWorker",
                                 {**self.common, "index": index, "model_path": self.model_path, "gpu": gpu})

    def _spawn(self, role: str, target: str, kwargs: dict):
        import ray

        from cluster.proc import Proc

        # num_cpus=0: processes are placed by us, and their threads are capped by config. Ray
        # restarts a dead process (max_restarts=-1); the launcher counts and caps restarts itself.
        restartable = not role.startswith("learner")
        actor = ray.remote(num_cpus=0, max_restarts=-1 if restartable else 0)(Proc).options(
            name=f"{self.run_id}:{role}").remote(role, str(self.run_dir), target, kwargs)
        self.procs[role] = actor
        self.spawned[role] = time.time()
        ref = actor.run.remote()
        self.refs[ref] = role
        return ref

    def monitor(self) -> dict:
        """Supervise until learner rank 0 returns. Learner or ingest failures end the job; an actor
        that dies is removed (its leased prompts go back to the queue) and the job goes on while
        any actor is left; the actor count follows `cluster.scale`."""
        import ray

        progress = Progress(self.cfg, self.r, self.keys)
        summary = None
        pending = dict(self.refs)
        while summary is None:
            done, _ = ray.wait(list(pending), timeout=MONITOR_POLL_S)
            for ref in done:
                role = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except Exception as e:
                    self._failed(role, f"died: {_root_message(e)}", pending, process_died=_is_death(e))
                    continue
                if role == "learner-0":
                    summary = result
                elif role.startswith("actor") and self.r.exists(self.keys.drain(role)):
                    self._actor_gone(role, "drained")
                elif not role.startswith("learner"):
                    raise JobError(f"{role} exited before the learner finished (log: {self.run_dir}/logs/{role}.log)")
            if summary is None:
                self._kill_silent(pending)
                self._scale(pending)
                replaying = bool(self.cfg.buffer.replay_dir)
                if not replaying and not any(role.startswith("actor") for role in pending.values()):
                    raise JobError("no rollout actor is left; the learner would wait forever")
            progress.update()
        progress.finish()
        # Drain in order: actors finish their batch (the ingest still acks it), then the ingest.
        self.r.set(self.keys.stop, 1)
        actors = {ref: role for ref, role in pending.items() if role.startswith("actor")}
        self._drain(actors)
        self.r.set(self.keys.stop_ingest, 1)
        self._drain({ref: role for ref, role in pending.items() if ref not in actors})
        self.write_status()
        return summary

    def _failed(self, role: str, why: str, pending: dict, *, process_died: bool) -> None:
        """A process died or raised. Actors and the ingest are restarted while restarts are left
        (an actor's leases go back to the queue first); otherwise an actor is dropped and
        anything else fails the job."""
        import ray

        n = self.restarts.get(role, 0)
        if role.startswith("learner") or (n >= self.cfg.cluster.max_restarts and not role.startswith("actor")):
            raise JobError(f"{role} failed: {why} (log: {self.run_dir}/logs/{role}.log)")
        if n >= self.cfg.cluster.max_restarts:
            ray.kill(self.procs[role], no_restart=True)
            self._actor_gone(role, why)
            return
        self.restarts[role] = n + 1
        if role.startswith("actor"):
            self._actor_gone(role, why, restarting=f"restarting ({n + 1}/{self.cfg.cluster.max_restarts})")
        else:
            log.warning("%s %s; restarting (%d/%d)", role, why, n + 1, self.cfg.cluster.max_restarts)
            print(f"\n{role} {why}; restarting ({n + 1}/{self.cfg.cluster.max_restarts})", flush=True)
        handle = self.procs[role]
        if not process_died:  # it raised: replace the process too, so nothing of its state survives
            ray.kill(handle, no_restart=False)
        self.spawned[role] = time.time()
        ref = handle.run.remote()  # queued until Ray has restarted the process
        pending[ref] = role

    def _actor_gone(self, role: str, why: str, restarting: str = "") -> None:
        from buffer.store import reclaim_leases

        n = reclaim_leases(self.r, self.keys, role)
        self.r.hdel(self.keys.members, role)
        self.r.hdel(self.keys.ws_members, role)
        if not restarting:
            self.procs.pop(role, None)
        tail = f"; {restarting}" if restarting else ""
        log.warning("%s %s; %d leased prompt groups returned to the queue%s", role, why, n, tail)
        print(f"\n{role} {why}; {n} leased groups returned to the queue{tail}", flush=True)

    def _kill_silent(self, pending: dict) -> None:
        import ray

        now = time.time()
        beats = {a.decode(): float(t) for a, t in self.r.hgetall(self.keys.ws_members).items()}
        for ref, role in list(pending.items()):
            # only beats of this incarnation count (an actor loading its engine has not beaten yet)
            beat = beats.get(role, 0.0)
            if role.startswith("actor") and beat > self.spawned[role] and now - beat > ACTOR_SILENT_S:
                info = json.loads(self.r.hget(self.keys.members, role) or "{}")
                killed = False
                if info.get("host") == socket.gethostname():  # a stopped process cannot answer Ray's kill RPC
                    try:
                        os.kill(info["pid"], signal.SIGKILL)
                        killed = True
                    except ProcessLookupError:
                        pass
                pending.pop(ref)
                self._failed(role, f"went silent for {now - beat:.0f}s (killed)", pending, process_died=killed)

    def _scale(self, pending: dict) -> None:
        """Start or drain actors to reach `<run>:scale_target` (set by `python -m cluster.scale`)."""
        target = self.r.get(self.keys.scale_target)
        actors = sorted((r for r in pending.values() if r.startswith("actor")), key=lambda r: int(r.split("-")[1]))
        live = [a for a in actors if not self.r.exists(self.keys.drain(a))]
        if target is None:
            return
        target = int(target)
        for _ in range(target - len(live)):
            role, ref = self._spawn_actor(self.next_actor)
            self.next_actor += 1
            pending[ref] = role
            log.info("scaled up: started %s", role)
        for role in live[target:] if target < len(live) else []:
            self.r.set(self.keys.drain(role), 1)
            log.info("scaled down: draining %s", role)

    def write_status(self) -> None:
        """Final state of the run, readable after Redis is gone: who held which weights, what was rejected."""
        k, r = self.keys, self.r
        status = {
            "version": int(r.get(k.version) or 0),
            "checksums": {int(v): c.decode() for v, c in r.hgetall(k.checksums).items()},
            "members": {a.decode(): json.loads(m) for a, m in r.hgetall(k.members).items()},
            "rejected": {a.decode(): int(n) for a, n in r.hgetall(k.rejected).items()},
            "ingest": {a.decode(): b.decode() for a, b in r.hgetall(k.ingest).items()},
            "val_reward": {int(v): float(x) for v, x in r.hgetall(k.val).items()},
        }
        (self.run_dir / "status.json").write_text(json.dumps(status, indent=1))

    def _drain(self, refs: dict) -> None:
        import ray

        if not refs:
            return
        done, not_done = ray.wait(list(refs), num_returns=len(refs), timeout=DRAIN_TIMEOUT_S)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:
                log.warning("%s failed while draining: %s", refs[ref], _root_message(e))
        if not_done:
            log.warning("%s did not exit within %ss; stopping them", [refs[r] for r in not_done], DRAIN_TIMEOUT_S)

    def close(self) -> None:
        self._closing.set()
        try:
            if self.r is not None:
                self.r.set(self.keys.stop, 1)
                self.r.set(self.keys.stop_ingest, 1)
        except Exception:
            pass
        try:
            import ray

            if ray.is_initialized():
                for actor in self.procs.values():
                    ray.kill(actor)
                if self.ray_started:
                    ray.shutdown()
        finally:
            if self.redis is not None:
                self.redis.stop()


def _is_death(e: BaseException) -> bool:
    """The process itself died (Ray restarts it), as opposed to the component raising."""
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError)


def _root_message(e: BaseException) -> str:
    """The innermost useful line of a Ray task error."""
    text = str(e).strip().splitlines()
    for line in reversed(text):
        if "failed:" in line or "Error" in line:
            return line.strip()
    return text[-1] if text else type(e).__name__
