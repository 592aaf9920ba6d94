"""A job: the local Redis, Ray, and every process of the system, supervised until done.

The launcher only controls: trajectories and weights never pass through it or through
Ray's object store. Any process failing fails the job with the process named, and
`close()` always stops everything it started (Ray actors, Ray itself if local, Redis).
"""
from __future__ import annotations

import dataclasses
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
from cluster.cpu import CpuLog
from cluster.errors import JobError
from cluster.memory import MemoryPlanError, check_job
from cluster.placement import actor_gpu
from cluster.proc import Proc
from cluster.progress import Progress
from cluster.redis_local import LocalRedis
from cluster.rundir import check_resume, check_resume_redis, last_checkpoint, lock_run_dir, write_whole
from data.tiny_model import resolve_model_path
from learner.loggers import forwarded_env
from runbase import net
from runbase.configload import dump_yaml
from runbase.devices import cuda_refusal
from runbase.keys import Keys, connect, mark_startup
from weightsync.backends import resolve

log = logging.getLogger("cluster")

SPAWN_PER_TICK = 8           # actors cluster.scale may start per monitor tick (the progress line stays live)
CHECK_REPLY_S = 5.0          # --redis-url must answer PING within this (a port that accepts and never answers)
MONITOR_POLL_S = 0.5        # how often the launcher checks processes and refreshes the progress line
DRAIN_TIMEOUT_S = 30.0      # how long actors and the ingest get to exit after the learner is done
# cluster.profile: an interrupted job's processes see the stop keys and return within a step or a poll, and
# only a run() that returns writes its profile; this long before they are killed (a profile is seconds to write).
PROFILE_GRACE_S = 20.0
# An actor whose weight subscriber (a thread that beats every 0.5 s, whatever the engine is doing)
# has been silent this long is stopped or hung: it is killed and handled like a dead one.
ACTOR_SILENT_S = 15.0
ALL_REJECTED_FATAL = 64     # groups rejected with none accepted: the job cannot train, so it fails (not starves)
REDIS_WATCH_S = 0.2         # how often the launcher checks its local Redis server is alive
WHERE_WAIT_S = 1.0          # a process's where() answer for the status: one that is dead or busy is left out
# Ray's answers to the run() we queue right after a death or our own kill, when it reaches the
# process before or during its restart: not a new death, the restart is already counted.
# "is restarting" always; "was restarted", or "temporarily unavailable" (the call reached the old process before
# Ray noticed it died, as after our own kill of a silent actor), only within RESPAWN_RACE_S of our respawn.
RESUBMITTED_TOO_EARLY = ("The actor is restarting", "The actor was restarted",
                         "The actor is temporarily unavailable")
# "was restarted" can also describe a later, real death; within this long of our respawn it is ours
# (Ray restarts a process in about a second; seen on the H200 one second after the kill).
RESPAWN_RACE_S = 10.0
# A placement group not ready by then cannot be satisfied by the cluster as it is (wrong resources).
PLACEMENT_TIMEOUT_S = 120.0
# Per-process settings that a local Ray's workers inherit from the launcher but a cluster's do not.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# Ray's dashboard runs whatever jobs it is sent: it listens on loopback only (reach it with ssh -L).
DASHBOARD_HOST = "127.0.0.1"


def local_ray_kwargs(c) -> dict:
    """ray.init's arguments for the job's own Ray (cluster.address empty). "local" always starts one: a
    RAY_ADDRESS in the environment, or a cluster someone else started on this machine, is joined only when
    asked for (cluster.address). The dashboard only with cluster.dashboard, and only on loopback."""
    kwargs = {"address": "local", "num_cpus": c.num_cpus or os.cpu_count(), "include_dashboard": c.dashboard,
              "log_to_driver": False, "logging_level": logging.WARNING, "_temp_dir": None}
    if c.dashboard:
        kwargs.update(dashboard_host=DASHBOARD_HOST, dashboard_port=c.dashboard_port)
    return kwargs


def ray_start_error(e: OSError) -> str:
    """Why a local Ray could not start, with what to change: its Unix sockets live in its session folder under
    RAY_TMPDIR, else TMPDIR (a scheduler's or CI's may be long), and a socket path has AF_UNIX's ~107 bytes at most;
    Ray's own OSError names the socket, not the variable to shorten. A local Ray also writes its auth token to
    ~/.ray/auth_token: a read-only or missing HOME failed with a bare "[Errno 20] Not a directory: '/dev/null/.ray'"."""
    ray_home = Path.home() / ".ray"
    if e.filename and Path(e.filename).is_relative_to(ray_home):
        return (f"Ray could not start: {e}. A local Ray writes its auth token to {ray_home}, which cannot be "
                f"written: set HOME to a writable directory")
    if "AF_UNIX path length" not in str(e):
        return f"Ray could not start: {e}"
    var = "RAY_TMPDIR" if "RAY_TMPDIR" in os.environ else "TMPDIR"
    where = os.environ.get(var, "")
    return (f"Ray could not start: {e}. Ray keeps its sockets under {var}={where} ({len(where.encode())} bytes), "
            f"too long for them: set RAY_TMPDIR to a short directory (e.g. RAY_TMPDIR=/tmp; Ray's files only)")


def check_redis(url: str):
    """A Redis given by --redis-url answers now, or the job stops naming it (a few quick retries, not the
    run's outage allowance: nothing has started yet); the client that asked."""
    import redis

    r = connect(url, outage_s=0, socket_timeout_s=CHECK_REPLY_S)
    try:
        r.ping()
    except redis.RedisError as e:
        raise JobError(f"--redis-url {url}: no Redis answers there ({e})") from e
    return r


def check_run_id_free(r, url: str, run_id: str) -> None:
    """A fresh job on a Redis that already holds its run id (every launcher records its start there) would share
    that run's queue, stream, counters and control flags: a job of that id running now lost its ingest to the
    new one's start-up and its actors' membership, and the two trained each other's groups. Refused before
    anything starts; a --resume continues the run that is there."""
    launched = r.hget(Keys(run_id).startup, "launcher:launched")
    if launched is not None:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(launched)))
        raise JobError(f"cluster.run_id {run_id}: the Redis at {url} already holds a run of that id (launched "
                       f"{at}; it may still be running); a new job there would mix with it: give another "
                       f"cluster.run_id, or --resume that run's --run-dir")


def check_ingest_ports(port: int, shards: int) -> None:
    """buffer.ingest_port fixed and already taken: refused before anything starts, naming the key (the ingest used
    to fail to bind, be restarted cluster.max_restarts times to the same error, then end the job naming no key).
    Bound and closed at once, never listened on."""
    for p in range(port, port + shards) if port else ():
        with socket.socket() as s:
            try:
                s.bind(("", p))
            except OSError as e:
                raise JobError(f"buffer.ingest_port={port}: port {p} (ingest shard {p - port}) is taken on this node "
                               f"({e.strerror}); choose another, or 0 for any free port") from None


def dashboard_missing() -> str | None:
    """Why Ray's dashboard cannot start here (the packages of ray[default] are missing), or None."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401  (the import Ray itself judges them by)
    except ImportError as e:
        return str(e)
    return None


class Job:
    def __init__(self, cfg):
        self.cfg = cfg
        c = cfg.cluster
        previous = {}
        if c.resume:  # same run id (Redis namespace) and, unless given, the same Redis data
            job = Path(c.run_dir) / "job.json"
            if not job.exists():
                raise JobError(f"--resume: {job} not found; is {c.run_dir} the directory of an earlier run?")
            previous = _read_job(job)
            if last_checkpoint(Path(c.run_dir)) is None:
                # the run's Redis holds its versions, admission counts and groups: step 0 would train on them
                raise JobError(f"--resume: no complete checkpoint in {Path(c.run_dir) / 'checkpoints'} (the run "
                               "saved none: trainer.checkpoint_every); start a new run with another --run-dir")
        self.run_id = previous.get("run_id") or c.run_id or time.strftime("run-%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        self.run_dir = Path(c.run_dir or Path("runs") / self.run_id).resolve()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._lock = lock_run_dir(self.run_dir)   # held until close(): one launcher per directory
        except OSError as e:
            raise JobError(f"run directory {self.run_dir}: {e.strerror or e}") from e
        try:
            self._claim_run_dir(cfg)
        except BaseException:
            self._lock.close()
            raise
        self.redis = None
        self.r = None
        self._status_written = False   # write_status ran (the drain's, or close's for an interrupted job)
        self.ray_started = False
        self.procs: dict[str, object] = {}
        self.spawned: dict[str, float] = {}
        self.respawned: dict[str, float] = {}  # when the launcher last restarted each role itself
        self.refs: dict[object, str] = {}
        self.restarts: dict[str, int] = {}
        self.where: dict[str, object] = {}   # role -> ref of its Proc.where() (node, IP, pid)
        self.pgs: dict[str, object] = {}     # "learners"/"actors" -> Ray placement group (placement=groups)
        self.env: dict[str, str] = {}        # given to every process (runtime_env): worker settings, run secrets
        self._closing = threading.Event()
        self.redis_failed: str | None = None   # why the local Redis is down for good (the watchdog gave up)
        self.learner_phase: list = [None, 0.0, False]   # learner rank 0's phase as seen here, when first, reported
        self.launched = time.time()          # the start-up timeline's zero (status.json `startup`)

    def _claim_run_dir(self, cfg) -> None:
        """A fresh job in an unused directory, or a resume that continues the run there; config.yaml written."""
        if not cfg.cluster.resume and (self.run_dir / "job.json").exists():
            # a second fresh job here would append to the first one's metrics and share its checkpoints
            raise JobError(f"{self.run_dir} already holds run {_read_job(self.run_dir / 'job.json').get('run_id')}: "
                           f"--resume continues it; for a new job give another --run-dir or remove this one")
        try:
            if cfg.cluster.resume and (changed := check_resume(cfg, self.run_dir)):
                # a resume takes only its own overrides: one the first run was given and this one was not is
                # back at its default, silently before (a s=8 tis run resumed as s=2 ppo_clip, no checkpoints)
                msg = (f"--resume: the config differs from the run's ({self.run_dir}/config-before-resume-*.yaml, "
                       f"the newest) in {len(changed)} setting(s); overrides not given again are back at their "
                       "defaults: " + "; ".join(changed))
                log.warning("%s", msg)
            dump_yaml(cfg, self.run_dir / "config.yaml")
        except OSError as e:
            raise JobError(f"run directory {self.run_dir}: {e.strerror or e}") from e

    def start(self) -> None:
        try:
            self.model_path = resolve_model_path(self.cfg.model.path, self.cfg.task)
        except (OSError, ValueError) as e:  # missing folder, unknown builtin:, unreadable config.json
            raise JobError(str(e)) from e
        if self.cfg.cluster.redis_url:  # before Ray starts: a wrong URL costs nothing
            r = check_redis(self.cfg.cluster.redis_url)
            if not self.cfg.cluster.resume:
                check_run_id_free(r, self.cfg.cluster.redis_url, self.run_id)
        check_ingest_ports(self.cfg.buffer.ingest_port, self.cfg.buffer.ingest_shards)
        if warning := self.cfg.buffer.narrow_reward_bounds():
            log.warning("%s", warning)
        self._start_ray()
        self._check_devices()
        self._check_gpu_memory()
        host = self._network()
        c = self.cfg.cluster  # as _network resolved it
        if c.redis_url:
            self.redis_url = c.redis_url
        else:
            self.redis = LocalRedis(self.run_dir / "redis", fsync=c.redis_fsync, host=host,
                                    password=os.environ.get(net.ENV_REDIS_PASSWORD))
            self.redis_url = self.redis.url
            threading.Thread(target=self._watch_redis, name="redis-watch", daemon=True).start()
        self.keys = Keys(self.run_id)
        self.r = connect(self.redis_url)
        # left by an earlier run of this id (a resumed job): its stop flags, its actors' membership and
        # its weight-sync rendezvous (new actors must wait for the new learner's address, not dial the dead one)
        # and the newest version it began to send (the new learner's versions bound what the ingest accepts)
        self.r.delete(self.keys.stop, self.keys.stop_ingest, self.keys.members, self.keys.ws_members,
                      self.keys.ws, self.keys.ws_announce, self.keys.ingest, self.keys.ws_begun, self.keys.startup,
                      self.keys.ended, self.keys.scale_target,   # a resumed job runs --actors, not the old target
                      self.keys.learner_phase)   # the last phase of the job resumed: no new learner's yet
        self.r.hset(self.keys.startup, "launcher:launched", repr(self.launched))
        mark_startup(self.r, self.keys, "launcher", "redis")
        if c.resume:
            check_resume_redis(self.r, self.keys, self.run_dir)
            if self.r.type(self.keys.seen) in (b"set", "set"):  # written before `seen` became a zset: the ids
                self.r.delete(self.keys.seen)                    # of actors gone with the old job never come back
            n = reclaim_leases(self.r, self.keys, None)
            log.info("resuming run %s: %d leases of the previous actors returned to the queue", self.run_id, n)
        limits = self._ingest_limits()
        common = self.common = {"cfg": self.cfg, "run_id": self.run_id, "redis_url": self.redis_url}
        self.next_actor = c.actors
        write_whole(self.run_dir / "job.json", json.dumps({"run_id": self.run_id, "redis_url": self.redis_url}))
        shards = self.cfg.buffer.ingest_shards
        for i in range(shards):  # one shard keeps the role name `ingest`
            self._spawn("ingest" if shards == 1 else f"ingest-{i}", "buffer.ingest_proc:IngestProcess",
                        {"buffer": self.cfg.buffer, "bind_host": c.bind_host, "run_id": self.run_id,
                         "redis_url": self.redis_url, **limits, "shard": i})
        self._place_learners_and_actors()
        master_addr, port = self._learner_endpoint()
        for rank in range(c.learners):
            self._spawn(f"learner-{rank}", "learner.train:LearnerProcess",
                        {**common, "rank": rank, "world": c.learners, "master_addr": master_addr,
                         "master_port": port, "run_dir": str(self.run_dir), "model_path": self.model_path})
        for i in range(c.actors):
            self._spawn_actor(i)
        if self.cfg.trainer.val_engine == "vllm":  # held-out evaluation off the learner's loop
            self._spawn("evaluator", "actors.evaluator:EvaluatorProcess",
                        {**common, "model_path": self.model_path, "gpu": self._actor_gpu(0)})
        mark_startup(self.r, self.keys, "launcher", "spawned")

    def _ingest_limits(self) -> dict:
        """The job's own bounds on what the ingest accepts, as plain numbers: the model's vocabulary, the
        longest prompt (data.max_prompt_length) and response (actors.max_tokens), the samples of a group
        (actors.n: another size would break the learner ranks' equal shares), and the positions an
        engine enforces: actors.max_model_len, else with vLLM the model's (config.json). The HF engine runs
        rotary models past max_position_embeddings (nothing refuses it there), so it bounds only the parts."""
        model = json.loads((Path(self.model_path) / "config.json").read_text())
        a = self.cfg.actors
        own = model.get("max_position_embeddings") or model.get("n_positions")
        positions = a.max_model_len or (own if a.engine == "vllm" else None)
        longest = self.cfg.data.max_prompt_length + a.max_tokens
        if a.engine == "hf" and self.cfg.data.train_files and not a.max_model_len and own and longest > own:
            log.warning("data.max_prompt_length + actors.max_tokens = %d tokens is past the model's %d positions "
                        "(max_position_embeddings): the HF engine runs a sample that long all the same, on positions "
                        "the model never saw in training; actors.max_model_len=%d would refuse it", longest, own, own)
        return {"vocab_size": model["vocab_size"], "max_prompt_tokens": self.cfg.data.max_prompt_length,
                "max_response_tokens": a.max_tokens, "max_positions": positions, "group_size": a.n}

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
        self.groups = c.placement == "groups" or (c.placement == "auto" and bool(c.address))
        if self.groups:  # bundles own their GPUs: Ray sets CUDA_VISIBLE_DEVICES per process
            os.environ.pop("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", None)
            self.env.update(WORKER_ENV)
        # ray.init installs a SIGTERM handler of its own (sys.exit); the launcher's stops the job cleanly
        sigterm = signal.getsignal(signal.SIGTERM)
        if c.address:
            ctx = ray.init(address=c.address, log_to_driver=False, logging_level=logging.WARNING)
            self.env.update(forwarded_env(os.environ))  # trainer.logger's settings: other nodes lack our env
        else:
            if c.dashboard and (missing := dashboard_missing()):
                raise JobError(f"cluster.dashboard=true: Ray's dashboard packages are missing ({missing}); "
                               "install them with pip install -e '.[dashboard]'")
            try:
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

    def _check_devices(self) -> None:
        """CUDA asked for where Ray sees no GPU, or a GPU index past the ones it sees: refused now, naming the key."""
        import ray

        if why := cuda_refusal(self.cfg.learner.device, self.cfg.actors.device,
                               int(ray.cluster_resources().get("GPU", 0))):
            raise JobError(why)

    def _check_gpu_memory(self) -> None:
        """Every process's share of each GPU, estimated from the model and the config (cluster/memory.py):
        logged, and a job that cannot fit refused now rather than by an engine or a learner out of memory."""
        import ray

        try:
            lines = check_job(self.cfg, self.model_path, int(ray.cluster_resources().get("GPU", 0)),
                              self._weight_backend().backend)
        except MemoryPlanError as e:
            raise JobError(str(e)) from e
        for line in lines:
            log.info("GPU memory plan, %s", line)

    def _network(self) -> str:
        """Decide where servers listen (cluster.bind_host) and, off loopback, make the run's secrets.
        Processes get the resolved setting in their config and the secrets in their environment."""

        import ray

        c = self.cfg.cluster
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
        self.cfg = dataclasses.replace(self.cfg, cluster=dataclasses.replace(c, bind_host=bind),
                                       weightsync=self._weight_backend())
        return host

    def _weight_backend(self):
        """weightsync with `auto` resolved once, here, for every process (weightsync/backends.py): the
        launcher sees where they all sit (placement-group bundles never share a GPU, maybe not a node)."""
        import ray

        ws = self.cfg.weightsync
        n_gpus = int(ray.cluster_resources().get("GPU", 0))
        backend = resolve(ws.backend, learner_on_cuda=self.cfg.learner.on_cuda(n_gpus > 0),
                          actors_on_cuda=self.cfg.actors.device.startswith("cuda"), n_gpus=n_gpus,
                          learners=self.cfg.cluster.learners, spread=self.groups)
        return dataclasses.replace(ws, backend=backend)

    def _bundle(self, given: dict, gpus: int) -> dict:
        return dict(given) if given else ({"GPU": gpus} if gpus else {"CPU": 1})

    def _place_learners_and_actors(self) -> None:
        """One placement group for the learners (a bundle per rank, cluster.learner_strategy) and one
        for the actors (a bundle per actor, cluster.actor_strategy); waits until the cluster grants them."""
        if not self.groups:
            return
        import ray
        from ray.util.placement_group import placement_group

        c, a = self.cfg.cluster, self.cfg.actors
        learner_cuda = self.cfg.learner.on_cuda(ray.cluster_resources().get("GPU", 0) > 0)
        plan = {"learners": ("cluster.learner_resources", [self._bundle(c.learner_resources, int(learner_cuda))]
                             * c.learners, c.learner_strategy),
                "actors": ("cluster.actor_resources", [self._bundle(c.actor_resources, a.tensor_model_parallel_size
                                                                    if a.device.startswith("cuda") else 0)]
                           * c.actors, c.actor_strategy)}
        for name, (key, bundles, strategy) in plan.items():
            if not bundles:
                continue
            pg = placement_group(bundles, strategy=strategy, name=f"{self.run_id}:{name}")
            self.pgs[name] = pg
            ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise JobError(f"the Ray cluster cannot place {len(bundles)} x {bundles[0]} ({strategy}) for the "
                               f"{name} within {PLACEMENT_TIMEOUT_S:.0f}s; cluster resources: "
                               f"{ray.cluster_resources()}; see {key} and {key.replace('resources', 'strategy')}")
            log.info("%s placed: bundles on nodes %s", name,
                     ray.util.placement_group_table(pg)["bundles_to_node_id"])

    def _learner_endpoint(self) -> tuple[str, int]:
        """torch.distributed rendezvous of the learner group: on the node of learner rank 0, at that
        node's address (cluster.bind_host) and a port free there."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        bind, ranks = self.cfg.cluster.bind_host, self.cfg.cluster.learners
        if not self.groups:
            return _endpoint(bind, ranks)
        node = ray.util.placement_group_table(self.pgs["learners"])["bundles_to_node_id"][0]
        probe = ray.remote(num_cpus=0)(_endpoint).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
        return tuple(ray.get(probe.remote(bind, ranks), timeout=PLACEMENT_TIMEOUT_S))

    def _watch_redis(self) -> None:
        """Restart a local Redis server that died (from its AOF, same port): every process rides
        out the outage by retrying (runbase.keys.REDIS_OUTAGE_S)."""
        failed = None   # set whole, once: the monitor thread reads redis_failed while this runs
        while not self._closing.wait(REDIS_WATCH_S):
            if self.redis.alive():
                continue
            if self.redis.restarts >= self.cfg.cluster.max_restarts:
                failed = f"local redis-server died {self.redis.restarts + 1} times; not restarting it"
                break
            log.warning("local redis-server died (code %s); restarting it from its AOF", self.redis.proc.returncode)
            print(f"\nredis-server died; restarting from its AOF ({self.redis.restarts + 1}/"
                  f"{self.cfg.cluster.max_restarts})", flush=True)
            try:
                self.redis.restart()
            except (OSError, RuntimeError, TimeoutError) as e:   # e.g. its AOF on a full disk: it exits at once
                failed = f"local redis-server could not be restarted: {str(e).splitlines()[0]}"
                break
        if failed:
            self.redis_failed = f"{failed} ({self.redis.why_down()})"
            log.error("%s", self.redis_failed)
        # A server this thread restarted dies with it: PR_SET_PDEATHSIG fires when the *thread* that started it
        # ends, not the process. Stay until the launcher exits, or close() loses Redis (SIGTERM) before it is
        # done with it (seen: an interrupted job after a Redis restart wrote no status.json and took 30 s more).
        threading.Event().wait()

    def _spawn_actor(self, index: int):
        """An actor on its GPU (cluster/placement.py) when actors run on CUDA without a fixed index."""
        role = f"actor-{index}"
        return role, self._spawn(role, "actors.rollout:RolloutWorker", {**self.common, "index": index,
                                                                        "model_path": self.model_path,
                                                                        "gpu": self._actor_gpu(index)})

    def _actor_gpu(self, index: int):
        """The GPU of actor `index` when actors run on CUDA without a fixed index (None: Ray's bundle or CPU)."""
        import ray

        if self.cfg.actors.device == "cuda" and not self.groups:  # in groups, Ray gives each bundle its GPUs
            n_gpus = int(ray.cluster_resources().get("GPU", 0))
            return actor_gpu(index, n_gpus, self.cfg.cluster.learners) if n_gpus else None
        return None

    def _spawn(self, role: str, target: str, kwargs: dict):
        import ray

        # num_cpus=0: processes are placed by us, and their threads are capped by config. Ray
        # restarts a dead process (max_restarts=-1); the launcher counts and caps restarts itself.
        restartable = not role.startswith("learner")
        options = {"name": f"{self.run_id}:{role}", **self._placement(role)}
        if self.env:
            options["runtime_env"] = {"env_vars": dict(self.env)}
        actor = ray.remote(num_cpus=0, max_restarts=-1 if restartable else 0)(Proc).options(
            **options).remote(role, str(self.run_dir), target, kwargs, profile=self.cfg.cluster.profile)
        self.procs[role] = actor
        self.spawned[role] = time.time()
        ref = self._run(role)
        self.refs[ref] = role
        return ref

    def _run(self, role: str):
        """Submit the process's run(), asking where() first (its pid and node, for status.json and
        cpu.jsonl): an actor's calls execute in order, and run() never returns."""
        self.where[role] = self.procs[role].where.remote()
        return self.procs[role].run.remote()

    def _placement(self, role: str) -> dict:
        """Ray options that put a process where cluster.placement says (nothing with placement=local)."""
        if not self.groups:
            return {}
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        kind, _, index = role.partition("-")
        c = self.cfg.cluster
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

    def monitor(self) -> dict:
        """Supervise until learner rank 0 returns. Learner or ingest failures end the job; an actor
        that dies is removed (its leased prompts go back to the queue) and the job goes on while
        any actor is left; the actor count follows `cluster.scale`."""
        import redis

        try:
            return self._monitor()
        except redis.ConnectionError as e:   # every client's retries (REDIS_OUTAGE_S) ran out
            raise JobError(self.redis_failed or f"Redis at {self.redis_url} stopped answering ({e})") from e

    def _monitor(self) -> dict:
        import ray

        progress = Progress(self.cfg, self.r, self.keys)
        cpu = CpuLog(self.run_dir)
        summary = None
        pending = dict(self.refs)
        while summary is None:
            if self.redis_failed:
                raise JobError(self.redis_failed)
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
                self._report_learner_stall()
                self._scale(pending)
                replaying = bool(self.cfg.buffer.replay_dir)
                if not replaying and not any(role.startswith("actor") for role in pending.values()):
                    raise JobError("no rollout actor is left; the learner would wait forever")
                self._check_rejections()
            progress.update()
            cpu.sample(self._pids)
        cpu.sample(self._pids, force=True)
        progress.finish()
        # Drain in order: actors finish their batch (the ingest still acks it), then the ingest.
        self.r.set(self.keys.stop, 1)
        # (the evaluator also ends on the stop key; learner ranks past 0 are returning)
        actors = {ref: role for ref, role in pending.items() if role.startswith("actor") or role == "evaluator"}
        ingests = {ref: role for ref, role in pending.items() if role.startswith("ingest")}
        others = {ref: role for ref, role in pending.items() if ref not in actors and ref not in ingests}
        self._drain_actors(actors, ingests)   # (updates ingests with the refs of any it restarted)
        self.r.set(self.keys.stop_ingest, 1)
        self._drain(others | ingests)
        self.write_status()
        return summary

    def _check_rejections(self) -> None:
        """Every group rejected so far, and ALL_REJECTED_FATAL of them: the data, model and limits do not
        fit together (e.g. prompts longer than the model's positions), so fail with the reason, not starve."""
        accepted, rejected = self.r.hmget(self.keys.ingest, ["accepted", "rejected"])  # this launch's counts
        if int(accepted or 0) or int(rejected or 0) < ALL_REJECTED_FATAL:
            return
        counts = {k.decode(): int(v) for k, v in self.r.hgetall(self.keys.rejected).items()}
        last = self.r.xrevrange(self.keys.deadletter, count=1)
        example = last[0][1].get(b"error", b"").decode(errors="replace") if last else ""
        raise JobError(f"the job rejected all of the first {int(rejected)} groups and accepted none (the ingest "
                       f"judges their values; actors refuse prompts their engine cannot take and groups whose reward "
                       f"function fails) (reasons {counts}); e.g. {example!r}. Nothing can be trained: fix the data "
                       f"or the limits (dead letters in Redis stream {self.keys.deadletter})")

    def _failed(self, role: str, why: str, pending: dict, *, process_died: bool) -> None:
        """A process died or raised. Actors and the ingest are restarted while restarts are left
        (an actor's leases go back to the queue first); otherwise an actor is dropped and
        anything else fails the job."""
        import ray

        n = self.restarts.get(role, 0)
        if not role.startswith("learner") and resubmitted_too_early(
                why, time.time() - self.respawned.get(role, -math.inf)):
            self.respawned.pop(role, None)  # forgiven once per relaunch: a second answer is a new death
            # Not a new death: our run() for the restarted process reached Ray before the process was
            # back, or the old process as it went. Ask again; the restart is already counted.
            pending[self._run(role)] = role
            return
        if role.startswith("learner") or (n >= self.cfg.cluster.max_restarts and not role.startswith("actor")):
            raise JobError(f"{role} failed: {why} (log: {self.run_dir}/logs/{role}.log)")
        if n >= self.cfg.cluster.max_restarts:
            ray.kill(self.procs[role], no_restart=True)
            self._actor_gone(role, why)
            self._retire_actor_slot(role)
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
        self.spawned[role] = self.respawned[role] = time.time()
        pending[self._run(role)] = role  # queued until Ray has restarted the process

    def _actor_gone(self, role: str, why: str, restarting: str = "") -> None:
        n = reclaim_leases(self.r, self.keys, role)
        self.r.hdel(self.keys.members, role)
        self.r.hdel(self.keys.ws_members, role)
        if not restarting:
            self.procs.pop(role, None)
        tail = f"; {restarting}" if restarting else ""
        level = logging.INFO if why == "drained" else logging.WARNING   # a drain is the operator's own wish
        log.log(level, "%s %s; %d leased prompt groups returned to the queue%s", role, why, n, tail)
        print(f"\n{role} {why}; {n} leased groups returned to the queue{tail}", flush=True)

    def _retire_actor_slot(self, role: str) -> None:
        """An actor that used up its restarts is not replaced: with a scale target set, the target drops by one
        (else _scale would start a fresh actor in its place with a fresh restart budget, and a crash-looping
        actor would respawn forever)."""
        if self.r.get(self.keys.scale_target) is not None:
            target = self.r.decr(self.keys.scale_target)
            log.warning("%s used up its restarts: actor target lowered to %d", role, target)
            print(f"{role} used up its restarts: actor target lowered to {target}", flush=True)

    def _kill_silent(self, pending: dict) -> None:
        """Kill and restart an actor gone silent (its weight-sync thread's beat older than ACTOR_SILENT_S: a
        stopped or hung process) or stalled (its loop's heartbeat older than cluster.actor_stall_s while that
        thread still beats: a reward function or an engine call that hangs). Only beats of the incarnation
        Ray runs now count (an actor loading its engine has not beaten yet)."""
        now, stall_s = time.time(), self.cfg.cluster.actor_stall_s
        beats = {a.decode(): float(t) for a, t in self.r.hgetall(self.keys.ws_members).items()}
        members = {a.decode(): json.loads(m) for a, m in self.r.hgetall(self.keys.members).items()}
        for ref, role in list(pending.items()):
            if not role.startswith("actor"):
                continue
            info = members.get(role, {})
            beat, loop = beats.get(role, 0.0), float(info.get("heartbeat", 0.0))
            if beat > self.spawned[role] and now - beat > ACTOR_SILENT_S:
                why = f"went silent for {now - beat:.0f}s (killed)"
            elif stall_s and loop > self.spawned[role] and now - loop > stall_s:
                why = (f"made no progress for {now - loop:.0f}s (cluster.actor_stall_s={stall_s:g}: a reward "
                       f"function or an engine call that hangs?), killed; its stacks at the stall are in "
                       f"{self.run_dir}/logs/{role}.log")
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
            self._failed(role, why, pending, process_died=killed)

    def _report_learner_stall(self) -> None:
        """Say once per stall that learner rank 0 has been in one phase other than waiting for groups for longer
        than cluster.learner_stall_s, naming the phase and where its stacks are; the job goes on (a learner
        cannot be restarted without losing its state since the last checkpoint: the user decides). A phase is
        timed by this process's clock from when it is first seen here (rank 0 may be on a node whose clock is
        skewed against ours)."""
        stall_s = self.cfg.cluster.learner_stall_s
        at = {k.decode(): v.decode() for k, v in self.r.hgetall(self.keys.learner_phase).items()} if stall_s else {}
        if not at or at["phase"] == "wait":
            return
        seen = (at["phase"], at["version"], at["since"])
        if self.learner_phase[0] != seen:
            self.learner_phase = [seen, time.monotonic(), False]
        stalled = time.monotonic() - self.learner_phase[1]
        if self.learner_phase[2] or stalled <= stall_s:
            return
        self.learner_phase[2] = True
        why = (f"learner-0 has been in its {at['phase']} phase (weights version {at['version']}) for {stalled:.0f}s "
               f"(cluster.learner_stall_s={stall_s:g}: a held-out reward function or a file system that hangs?); "
               f"its stacks are in {self.run_dir}/logs/learner-0.log unless the process is stopped. The job goes "
               f"on; if it stays stuck, stop it (Ctrl-C) and continue it with --resume --run-dir {self.run_dir}")
        log.warning("%s", why)
        print(f"\n{why}", flush=True)

    def _scale(self, pending: dict) -> None:
        """Start or drain actors to reach `<run>:scale_target` (set by `python -m cluster.scale`)."""
        target = self.r.get(self.keys.scale_target)
        actors = sorted((r for r in pending.values() if r.startswith("actor")), key=lambda r: int(r.split("-")[1]))
        live = [a for a in actors if not self.r.exists(self.keys.drain(a))]
        if target is None:
            return
        target = int(target)
        for _ in range(min(target - len(live), SPAWN_PER_TICK)):
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
            "placement": self._where(),
            "startup": startup_timeline(r.hgetall(k.startup)),
        }
        write_whole(self.run_dir / "status.json", json.dumps(status, indent=1))
        self._status_written = True

    def _status_before_kill(self) -> None:
        """An interrupted or failed job's status.json (a finished one wrote it after the drain): the members'
        last heartbeats (each actor's groups and seconds holding leases) outlive Redis, best effort. (Named
        for what it saves: it runs once the processes are killed, while Redis still answers.)"""
        if self._status_written:
            return
        try:
            self.write_status()
        except Exception as e:  # Redis may still be what failed
            log.warning("no status.json: %s", e)

    def _pids(self) -> dict[int, str]:
        """pid -> role of the processes on this node that have answered where() (never blocks)."""
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
        if self.redis is not None and self.redis.proc is not None:
            out[self.redis.proc.pid] = "redis"
        return out

    def _where(self) -> dict:
        """role -> {node_id, ip, pid} of its (latest known) process; roles that never answered are left out."""
        import ray

        out = {}
        for role, ref in self.where.items():
            try:
                out[role] = ray.get(ref, timeout=WHERE_WAIT_S)
            except Exception:
                pass
        return out

    def _drain_actors(self, actors: dict, ingests: dict) -> None:
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
                        log.warning("%s failed while draining: %s", role, _root_message(e))
                    continue
                role = ingests.pop(ref)
                try:
                    ray.get(ref)
                    log.warning("%s exited before the actors drained", role)
                except Exception as e:
                    try:
                        self._failed(role, f"died: {_root_message(e)}", ingests, process_died=_is_death(e))
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
                log.warning("%s failed while draining: %s", refs[ref], _root_message(e))
        if not_done:
            log.warning("%s did not exit within %ss; stopping them", [refs[r] for r in not_done], DRAIN_TIMEOUT_S)

    def _await_profiles(self) -> None:
        """The processes' own exits, each up to PROFILE_GRACE_S, once stop is set (killed at once, an interrupted
        profiled job lost every profile: seen on the H200): the ingest last, so the actors' last groups are
        acked (an actor waits for its acks before it returns)."""
        import ray

        def wait(refs: list) -> list:   # the refs still running after the grace
            return ray.wait(refs, num_returns=len(refs), timeout=PROFILE_GRACE_S)[1] if refs else []

        ingest = [ref for ref, role in self.refs.items() if role.partition("-")[0] == "ingest"]
        left = wait([ref for ref in self.refs if ref not in ingest])
        self.r.set(self.keys.stop_ingest, 1)
        left += wait(ingest)
        if left:
            log.warning("%s did not exit within %ss of the stop: no profile from them",
                        sorted(self.refs[r] for r in left), PROFILE_GRACE_S)

    def close(self) -> None:
        self._closing.set()
        redis_up = False
        try:
            if self.r is not None:
                self.r.set(self.keys.stop, 1)
                self.r.set(self.keys.ended, repr(time.time()))   # operator commands: the job is over
                if not self.cfg.cluster.profile:   # profiled: the ingest acks the actors' last groups first
                    self.r.set(self.keys.stop_ingest, 1)
                redis_up = True
        except Exception:
            pass
        try:
            import ray

            if ray.is_initialized():
                if redis_up and self.cfg.cluster.profile:
                    try:
                        self._await_profiles()
                    except (KeyboardInterrupt, Exception) as e:   # a second Ctrl-C, Redis gone: the kill follows
                        log.warning("not waiting for the profiles: %s", type(e).__name__)
                for actor in self.procs.values():
                    ray.kill(actor)
                # after the kill (a second Ctrl-C while it is written cannot leave processes behind), before
                # Redis stops; a Redis that is gone already cost its retries above: not twice
                if redis_up:
                    self._status_before_kill()
                for pg in self.pgs.values():  # give the cluster its resources back now, not at driver exit
                    ray.util.remove_placement_group(pg)
                if self.ray_started:
                    ray.shutdown()
        finally:
            if self.redis is not None:
                self.redis.stop()
            self._lock.close()   # the run directory is free for a --resume


def startup_timeline(marks: dict) -> dict:
    """The start-up marks (runbase.keys.mark_startup) as seconds after launch, in the order they happened."""
    at = {f.decode(): float(t) for f, t in marks.items()}
    zero = at.get("launcher:launched")
    if zero is None:
        return {}
    return {f: round(t - zero, 3) for f, t in sorted(at.items(), key=lambda ft: ft[1])}


def _endpoint(bind_host: str, ranks: int) -> tuple[str, int]:
    """Runs on learner rank 0's node: the address it should listen on and a port free there (0 for a
    one-rank group, which nobody dials: its store binds a free port itself, with no race for it)."""

    host = net.local_host(bind_host)
    return host, 0 if ranks == 1 else net.free_port(host)


def _resource_options(resources: dict) -> dict:
    """A bundle's resources as Ray actor options (a process in a bundle must claim what it uses)."""
    rest = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0), **({"resources": rest} if rest else {})}


def _read_job(path: Path) -> dict:
    """A run directory's job.json ({run_id, redis_url}), or a JobError naming it."""
    try:
        job = json.loads(path.read_text())
        if not isinstance(job, dict) or "run_id" not in job:
            raise ValueError("no run_id")
        return job
    except (OSError, ValueError) as e:
        raise JobError(f"{path} is not a job record ({e}); remove it or pick another run dir") from None


def resubmitted_too_early(why: str, since_spawn_s: float) -> bool:
    """Whether a failed run() is Ray refusing or cutting short the call we queued for a process we
    are restarting, rather than a new death to count."""
    restarting, *racing = RESUBMITTED_TOO_EARLY
    return restarting in why or (since_spawn_s < RESPAWN_RACE_S and any(a in why for a in racing))


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
