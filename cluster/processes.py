"""A job's processes as Ray actors, by role: each spawned where the placement says, its run() submitted (again
after a restart), and where it runs (pid, node) for status.json and the CPU log."""
from __future__ import annotations

import time

from cluster.context import JobContext
from cluster.placement import Placement
from cluster.proc import Proc

WHERE_WAIT_S = 1.0          # a process's where() answer for the status: one that is dead or busy is left out


class Processes:
    """The job's Ray actors. `refs` maps each submitted run() to its role (what the supervisor waits on)."""

    def __init__(self, ctx: JobContext, placement: Placement):
        self.ctx, self.placement = ctx, placement
        self.handles: dict[str, object] = {}     # role -> its Ray actor
        self.spawned: dict[str, float] = {}      # role -> when its process was (re)started
        self.respawned: dict[str, float] = {}    # when the launcher last restarted each role itself
        self.refs: dict[object, str] = {}
        self.restarts: dict[str, int] = {}
        self.where: dict[str, object] = {}       # role -> ref of its Proc.where() (node, IP, pid)
        self.failed_pid: dict[str, int | None] = {}  # role -> pid of the process that last failed (restarted since)
        self.next_actor = 0                      # the index of the next actor cluster.scale starts

    def common(self) -> dict:
        """What every process of the run is given."""
        return {"cfg": self.ctx.cfg, "run_id": self.ctx.run_id, "redis_url": self.ctx.redis_url}

    def spawn(self, role: str, target: str, kwargs: dict):
        import ray

        # num_cpus=0: processes are placed by us, and their threads are capped by config. Ray
        # restarts a dead process (max_restarts=-1); the launcher counts and caps restarts itself.
        restartable = not role.startswith("learner")
        options = {"name": f"{self.ctx.run_id}:{role}", **self.placement.options(role)}
        actor = ray.remote(num_cpus=0, max_restarts=-1 if restartable else 0)(Proc).options(**options).remote(
            role, str(self.ctx.run_dir), target, kwargs, profile=self.ctx.cfg.cluster.profile,
            env=dict(self.placement.env))
        self.handles[role] = actor
        self.spawned[role] = time.time()
        ref = self.run(role)
        self.refs[ref] = role
        return ref

    def spawn_actor(self, index: int):
        """An actor on its GPU (cluster/placement.py) when actors run on CUDA without a fixed index."""
        role = f"actor-{index}"
        return role, self.spawn(role, "actors.rollout:RolloutWorker", {**self.common(), "index": index,
                                                                       "model_path": self.ctx.model_path,
                                                                       "gpu": self.placement.actor_gpu(index)})

    def run(self, role: str):
        """Submit the process's run(), asking where() first (its pid and node, for status.json and
        cpu.jsonl): an actor's calls execute in order, and run() never returns."""
        self.where[role] = self.handles[role].where.remote()
        return self.handles[role].run.remote()

    def answered_pid(self, role: str) -> int | None:
        """The pid the role's latest where() answered with, or None (not answered yet, or failed); never blocks."""
        import ray

        ref = self.where.get(role)
        if ref is None or not ray.wait([ref], timeout=0)[0]:
            return None
        try:
            return ray.get(ref)["pid"]
        except Exception:  # the process died before answering
            return None

    def forget_incarnation(self, role: str) -> None:
        """Before a restart: remember the failed process's pid."""
        self.failed_pid[role] = self.answered_pid(role)

    def new_incarnation(self, role: str) -> int | None:
        """The pid of a process that started after the role's last failure and answered, or None: a failure
        then is that process's own death, not a call that reached the old one or Ray's restart in progress."""
        pid = self.answered_pid(role)
        return pid if pid is not None and pid != self.failed_pid.get(role) else None

    def pids(self, local_redis=None) -> dict[int, str]:
        """pid -> role of the processes on this node that have answered where() (never blocks); the job's
        own Redis server as `redis`."""
        import ray

        out = {}
        refs = list(self.where.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        me = ray.get_runtime_context().get_node_id()
        for role, ref in self.where.items():
            try:
                w = ray.get(ref) if ref in ready else None
            except Exception:  # a process that died before answering: nothing to attribute
                continue
            if w and w["node_id"] == me:
                out[w["pid"]] = role
        if local_redis is not None and local_redis.proc is not None:
            out[local_redis.proc.pid] = "redis"
        return out

    def located(self) -> dict:
        """role -> {node_id, ip, pid} of its (latest known) process; roles that never answered are left out."""
        import ray

        out = {}
        for role, ref in self.where.items():
            try:
                out[role] = ray.get(ref, timeout=WHERE_WAIT_S)
            except Exception:
                pass
        return out
