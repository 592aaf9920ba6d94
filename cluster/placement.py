"""Where a job's processes sit.

`actor_gpu` (pure): on one host's GPUs, learner rank r on GPU r; actors on the GPUs the learners leave free,
round-robin, or all on GPU 0 beside learner rank 0 when none is free. The weight backend follows from it
(weightsync/backends.py): actors on rank 0's GPU get cuda_ipc (NCCL refuses two ranks on one device), actors
on other GPUs nccl, CPU actors gloo.

`Placement`: Ray's side of it (Ray imported on use): Ray started or joined, where servers listen and what
every process is given (its environment, set as it starts: cluster.proc.Proc), placement groups with
cluster.placement=groups, and the Ray options that put each role where it belongs.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal

from cluster.context import JobContext
from cluster.errors import JobError
from cluster.preflight import dashboard_missing, join_ray_kwargs, local_ray_kwargs, ray_on_loopback, ray_start_error
from learner.loggers import forwarded_env
from runbase import faults, net
from weightsync.backends import resolve

log = logging.getLogger("cluster")

# A placement group not ready by then cannot be satisfied by the cluster as it is (wrong resources).
PLACEMENT_TIMEOUT_S = 120.0
# Per-process settings that a local Ray's workers inherit from the launcher but a cluster's do not.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def actor_gpu(index: int, n_gpus: int, learners: int) -> int:
    if n_gpus <= 0:
        raise ValueError("actor_gpu needs at least one GPU")
    free = n_gpus - learners
    return learners + index % free if free > 0 else 0


class Placement:
    """Ray and the places of a job's processes; `release()` gives back what it took."""

    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        self.groups = False       # processes in placement groups (cluster.placement; `auto` on a joined cluster)
        self.ray_started = False  # a local Ray of the job's own: shut down with the job
        self.pgs: dict[str, object] = {}   # "learners"/"actors" -> Ray placement group (placement=groups)
        self.env: dict[str, str] = {}      # set in every process as it starts (Proc): worker settings, run secrets

    def start_ray(self) -> None:
        import ray

        # Workers inherit these: one intra-op thread each unless a component says otherwise,
        # and no tokenizer thread pools fighting over 2 cores.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        # Processes are placed on devices by config (learner rank r on GPU r, actors.device), not by
        # Ray's GPU accounting, so Ray must not hide GPUs from processes that asked for none.
        os.environ.setdefault("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
        c = self.ctx.cfg.cluster
        self.groups = c.placement == "groups" or (c.placement == "auto" and bool(c.address))
        if self.groups:  # bundles own their GPUs: Ray sets CUDA_VISIBLE_DEVICES per process
            os.environ.pop("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", None)
            self.env.update(WORKER_ENV)
        # ray.init installs a SIGTERM handler of its own (sys.exit); the launcher's stops the job cleanly
        sigterm = signal.getsignal(signal.SIGTERM)
        if c.address:
            with ray_on_loopback():
                ctx = ray.init(**join_ray_kwargs(c.address))
            self.env.update(forwarded_env(os.environ))  # trainer.logger's settings: other nodes lack our env
            if faults.ENV in os.environ:   # fault points named from outside reach every process of the job
                self.env[faults.ENV] = os.environ[faults.ENV]
        else:
            if c.dashboard and (missing := dashboard_missing()):
                raise JobError(f"cluster.dashboard=true: Ray's dashboard packages are missing ({missing}); "
                               "install them with pip install -e '.[dashboard]'")
            try:
                with ray_on_loopback():
                    ctx = ray.init(**local_ray_kwargs(c))
            except OSError as e:
                raise JobError(ray_start_error(e)) from e
            self.ray_started = True
        if sigterm is not None and signal.getsignal(signal.SIGTERM) is not sigterm:
            signal.signal(signal.SIGTERM, sigterm)
        if dashboard := getattr(ctx, "dashboard_url", None):
            # a local Ray signs its dashboard in with a token of its own (Ray >= 2.5x enables token auth)
            token = " (sign in with the token `ray get-auth-token` prints)" \
                if self.ray_started and os.environ.get("RAY_AUTH_MODE") == "token" else ""
            print(f"Ray dashboard: http://{dashboard}{token}", flush=True)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        log.info("Ray: %d node(s), resources %s", len(nodes), ray.cluster_resources())

    def network(self) -> str:
        """Decide where servers listen (cluster.bind_host) and, off loopback, make the run's secrets.
        Processes get the resolved setting in their config and the secrets in their environment."""

        import ray

        cfg = self.ctx.cfg
        c = cfg.cluster
        bind = net.resolve_bind_host(c.bind_host, len([n for n in ray.nodes() if n["Alive"]]))
        host = net.local_host(bind)
        if net.needs_auth(host, c.insecure):
            made = net.new_secrets()
            if c.redis_url:  # not our server: its password, if any, is the operator's (same variable)
                made.pop(net.ENV_REDIS_PASSWORD)
            os.environ.update(made)  # this process's own clients; never logged, never in a file
            log.info("servers listen on %s: Redis password and ZeroMQ CURVE keys generated for this run", host)
        elif not net.is_loopback(host):
            net.warn_insecure(host)
        self.env.update(net.run_secrets())
        self.env.update(net.interface_env(host, os.environ))  # gloo/NCCL sockets on loopback on one node
        self.ctx.cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(c, bind_host=bind),
                                           weightsync=self.weight_backend())
        return host

    def weight_backend(self):
        """weightsync with `auto` resolved once, here, for every process (weightsync/backends.py): the
        launcher sees where they all sit (placement-group bundles never share a GPU, maybe not a node)."""
        import ray

        cfg = self.ctx.cfg
        ws = cfg.weightsync
        n_gpus = int(ray.cluster_resources().get("GPU", 0))
        backend = resolve(ws.backend, learner_on_cuda=cfg.learner.on_cuda(n_gpus > 0),
                          actors_on_cuda=cfg.actors.device.startswith("cuda"), n_gpus=n_gpus,
                          learners=cfg.cluster.learners, spread=self.groups)
        return dataclasses.replace(ws, backend=backend)

    def place(self) -> None:
        """One placement group for the learners (a bundle per rank, cluster.learner_strategy) and one
        for the actors (a bundle per actor, cluster.actor_strategy); waits until the cluster grants them."""
        if not self.groups:
            return
        import ray
        from ray.util.placement_group import placement_group

        cfg = self.ctx.cfg
        c, a = cfg.cluster, cfg.actors
        learner_cuda = cfg.learner.on_cuda(ray.cluster_resources().get("GPU", 0) > 0)
        plan = {"learners": ("cluster.learner_resources", [_bundle(c.learner_resources, int(learner_cuda))]
                             * c.learners, c.learner_strategy),
                "actors": ("cluster.actor_resources", [_bundle(c.actor_resources, a.tensor_model_parallel_size
                                                               if a.device.startswith("cuda") else 0)]
                           * c.actors, c.actor_strategy)}
        for name, (key, bundles, strategy) in plan.items():
            if not bundles:
                continue
            pg = placement_group(bundles, strategy=strategy, name=f"{self.ctx.run_id}:{name}")
            self.pgs[name] = pg
            ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise JobError(f"the Ray cluster cannot place {len(bundles)} x {bundles[0]} ({strategy}) for the "
                               f"{name} within {PLACEMENT_TIMEOUT_S:.0f}s; cluster resources: "
                               f"{ray.cluster_resources()}; see {key} and {key.replace('resources', 'strategy')}")
            log.info("%s placed: bundles on nodes %s", name,
                     ray.util.placement_group_table(pg)["bundles_to_node_id"])

    def learner_endpoint(self) -> tuple[str, int]:
        """torch.distributed rendezvous of the learner group: on the node of learner rank 0, at that
        node's address (cluster.bind_host) and a port free there."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        bind, ranks = self.ctx.cfg.cluster.bind_host, self.ctx.cfg.cluster.learners
        if not self.groups:
            return _endpoint(bind, ranks)
        node = ray.util.placement_group_table(self.pgs["learners"])["bundles_to_node_id"][0]
        probe = ray.remote(num_cpus=0)(_endpoint).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
        return tuple(ray.get(probe.remote(bind, ranks), timeout=PLACEMENT_TIMEOUT_S))

    def actor_gpu(self, index: int):
        """The GPU of actor `index` when actors run on CUDA without a fixed index (None: Ray's bundle or CPU)."""
        import ray

        cfg = self.ctx.cfg
        if cfg.actors.device == "cuda" and not self.groups:  # in groups, Ray gives each bundle its GPUs
            n_gpus = int(ray.cluster_resources().get("GPU", 0))
            return actor_gpu(index, n_gpus, cfg.cluster.learners) if n_gpus else None
        return None

    def options(self, role: str) -> dict:
        """Ray options that put a process where cluster.placement says (nothing with placement=local)."""
        if not self.groups:
            return {}
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        kind, _, index = role.partition("-")
        c = self.ctx.cfg.cluster
        if kind == "ingest":
            if c.ingest_resources:
                return _resource_options(c.ingest_resources)
            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False)}
        pg = self.pgs["learners" if kind == "learner" else "actors"]
        if kind == "evaluator":  # an actor's resources, beside them
            return {**_resource_options(pg.bundle_specs[0]), "scheduling_strategy": "SPREAD"}
        if int(index) < pg.bundle_count:
            return {**_resource_options(pg.bundle_specs[int(index)]),
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=int(index))}
        # an actor added by cluster.scale beyond the group's bundles: same resources, spread over nodes
        return {**_resource_options(pg.bundle_specs[0]), "scheduling_strategy": "SPREAD"}

    def release(self) -> None:
        """The placement groups back to the cluster now (not at driver exit), and a Ray of our own stopped."""
        import ray

        for pg in self.pgs.values():
            ray.util.remove_placement_group(pg)
        if self.ray_started:
            _stop_autoscaler_monitor()
            ray.shutdown()


def _stop_autoscaler_monitor() -> None:
    """SIGKILL our local Ray's autoscaler monitor before ray.shutdown(). Left to ray.shutdown(), the monitor answers
    its SIGTERM by reporting its own end to Ray's GCS, stopped just before it: it sat out Ray's one-second grace
    before a SIGKILL at every job's end. A Ray of the job's own scales nothing; the monitor keeps no state to save.
    (Ray's record of the processes it started is internal: where it is missing, ray.shutdown() stops it as before.)"""
    from ray._private import ray_constants, worker

    processes = getattr(getattr(worker, "_global_node", None), "all_processes", None) or {}
    for info in processes.get(ray_constants.PROCESS_TYPE_MONITOR, []):
        if info.process.poll() is None:
            info.process.kill()
            info.process.wait()


def _bundle(given: dict, gpus: int) -> dict:
    return dict(given) if given else ({"GPU": gpus} if gpus else {"CPU": 1})


def _endpoint(bind_host: str, ranks: int) -> tuple[str, int]:
    """Runs on learner rank 0's node: the address it should listen on and a port free there (0 for a
    one-rank group, which nobody dials: its store binds a free port itself, with no race for it)."""

    host = net.local_host(bind_host)
    return host, 0 if ranks == 1 else net.free_port(host)


def _resource_options(resources: dict) -> dict:
    """A bundle's resources as Ray actor options (a process in a bundle must claim what it uses)."""
    rest = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0), **({"resources": rest} if rest else {})}
