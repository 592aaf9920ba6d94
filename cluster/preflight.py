"""What a job checks before anything starts, each refusal a JobError that names what to change, and the run
directory's claim (one launcher per directory: a fresh job, or a resume of the run there)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path

from cluster.errors import JobError
from cluster.rundir import check_resume, last_checkpoint, lock_run_dir
from data.tiny_model import resolve_model_path
from runbase.configload import dump_yaml
from runbase.devices import cuda_refusal
from runbase.keys import Keys, connect

log = logging.getLogger("cluster")

CHECK_REPLY_S = 5.0          # --redis-url must answer PING within this (a port that accepts and never answers)
# Ray's dashboard runs whatever jobs it is sent: it listens on loopback only (reach it with ssh -L).
DASHBOARD_HOST = "127.0.0.1"
RAY_LOOPBACK = "127.0.0.1"   # the job's own Ray on one node: its daemons listen here alone (ray_on_loopback)
# A local Ray starts one idle Python worker per CPU for its first driver by default: more than a job's processes
# on any machine with more cores than them, each importing Ray (~0.7 CPU-s on 2 cores) while the job's own start.
LOCAL_RAY_CONFIG = {"prestart_worker_first_driver": False}


def claim_run_dir(cfg) -> tuple[str, Path, object]:
    """(run id, run directory, its lock) of a job: a resume continues the run recorded in the directory (same
    run id, Redis namespace), a fresh job takes an unused one. The lock is held until the job closes it."""
    c = cfg.cluster
    previous = {}
    if c.resume:  # same run id (Redis namespace) and, unless given, the same Redis data
        job = Path(c.run_dir) / "job.json"
        if not job.exists():
            raise JobError(f"--resume: {job} not found; is {c.run_dir} the directory of an earlier run?")
        previous = read_job(job)
        if last_checkpoint(Path(c.run_dir)) is None:
            # the run's Redis holds its versions, admission counts and groups: step 0 would train on them
            raise JobError(f"--resume: no complete checkpoint in {Path(c.run_dir) / 'checkpoints'} (the run "
                           "saved none: trainer.checkpoint_every); start a new run with another --run-dir")
    run_id = previous.get("run_id") or c.run_id or time.strftime("run-%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    run_dir = Path(c.run_dir or Path("runs") / run_id).resolve()
    if why := unfit_run_dir(run_dir):
        raise JobError(f"run directory {run_dir}: {why}; give --run-dir a directory on disk")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_run_dir(run_dir)   # held until close(): one launcher per directory
    except OSError as e:
        raise JobError(f"run directory {run_dir}: {e.strerror or e}") from e
    try:
        _claim(cfg, run_dir)
    except BaseException:
        lock.close()
        raise
    return run_id, run_dir, lock


KERNEL_FILE_SYSTEMS = ("/proc", "/sys", "/dev")   # views of the kernel: nothing of a run can be written there


def unfit_run_dir(run_dir: Path) -> str | None:
    """Why `run_dir` cannot hold a run, said for what it is (a file, a kernel file system), or None."""
    if kernel := next((k for k in KERNEL_FILE_SYSTEMS if run_dir.is_relative_to(k)), None):
        return f"is under {kernel}, a kernel file system"
    for p in (run_dir, *run_dir.parents):
        if p.exists():
            return None if p.is_dir() else ("is a file, not a directory" if p == run_dir else f"{p} is a file")
    return None


def _claim(cfg, run_dir: Path) -> None:
    """A fresh job in an unused directory, or a resume that continues the run there; config.yaml written."""
    if not cfg.cluster.resume and (run_dir / "job.json").exists():
        # a second fresh job here would append to the first one's metrics and share its checkpoints
        raise JobError(f"{run_dir} already holds run {read_job(run_dir / 'job.json').get('run_id')}: "
                       f"--resume continues it; for a new job give another --run-dir or remove this one")
    try:
        if cfg.cluster.resume and (changed := check_resume(cfg, run_dir)):
            # a resume takes only its own overrides: one the first run was given and this one was not is
            # back at its default, silently before (a s=8 tis run resumed as s=2 ppo_clip, no checkpoints)
            msg = (f"--resume: the config differs from the run's ({run_dir}/config-before-resume-*.yaml, "
                   f"the newest) in {len(changed)} setting(s); overrides not given again are back at their "
                   "defaults: " + "; ".join(changed))
            log.warning("%s", msg)
        dump_yaml(cfg, run_dir / "config.yaml")
    except OSError as e:
        raise JobError(f"run directory {run_dir}: {e.strerror or e}") from e


def read_job(path: Path) -> dict:
    """A run directory's job.json ({run_id, redis_url}), or a JobError naming it."""
    try:
        job = json.loads(path.read_text())
        if not isinstance(job, dict) or "run_id" not in job:
            raise ValueError("no run_id")
        return job
    except (OSError, ValueError) as e:
        raise JobError(f"{path} is not a job record ({e}); remove it or pick another run dir") from None


def check_before_ray(cfg, run_id: str) -> str:
    """What can be refused before Ray starts (a wrong setting then costs nothing): the model, a --redis-url
    that does not answer or already holds this run id, taken ingest ports. Returns the model's folder."""
    try:
        model_path = resolve_model_path(cfg.model.path, cfg.task)
    except (OSError, ValueError) as e:  # missing folder, unknown builtin:, unreadable config.json
        raise JobError(str(e)) from e
    if cfg.cluster.redis_url:
        r = check_redis(cfg.cluster.redis_url)
        if not cfg.cluster.resume:
            check_run_id_free(r, cfg.cluster.redis_url, run_id)
    check_ingest_ports(cfg.buffer.ingest_port, cfg.buffer.ingest_shards)
    if warning := cfg.buffer.narrow_reward_bounds():
        log.warning("%s", warning)
    return model_path


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


def check_devices(cfg) -> None:
    """CUDA asked for where Ray sees no GPU, or a GPU index past the ones it sees: refused now, naming the key."""
    import ray

    if why := cuda_refusal(cfg.learner.device, cfg.actors.device, int(ray.cluster_resources().get("GPU", 0))):
        raise JobError(why)


def local_ray_kwargs(c) -> dict:
    """ray.init's arguments for the job's own Ray (cluster.address empty). "local" always starts one: a
    RAY_ADDRESS in the environment, or a cluster someone else started on this machine, is joined only when
    asked for (cluster.address). Its node address is loopback (start it inside `ray_on_loopback`). The dashboard
    only with cluster.dashboard, and only on loopback."""
    kwargs = {"address": "local", "num_cpus": c.num_cpus or os.cpu_count(), "include_dashboard": c.dashboard,
              "log_to_driver": False, "logging_level": logging.WARNING, "_temp_dir": None,
              "_node_ip_address": RAY_LOOPBACK, "_system_config": dict(LOCAL_RAY_CONFIG)}
    if c.dashboard:
        kwargs.update(dashboard_host=DASHBOARD_HOST, dashboard_port=c.dashboard_port)
    return kwargs


def join_ray_kwargs(address: str) -> dict:
    """ray.init's arguments to join the Ray at `address` (cluster.address). A Ray on loopback (another job's own,
    the tests' shared one) is joined on loopback, as this node (inside `ray_on_loopback`: Ray would replace
    127.0.0.1 by the reachable IP, where nothing of that Ray listens)."""
    kwargs = {"address": address, "log_to_driver": False, "logging_level": logging.WARNING}
    if address.rpartition(":")[0] == RAY_LOOPBACK:
        kwargs["_node_ip_address"] = RAY_LOOPBACK
    return kwargs


@contextlib.contextmanager
def ray_on_loopback():
    """Keeps a local Ray's node address at 127.0.0.1 while it starts. Ray (2.60) replaces a node address of
    127.0.0.1 by the machine's reachable IP (`ray._private.services.resolve_ip_for_localhost`), and its gcs_server,
    raylet, agents and every core worker then listen on all interfaces; given 127.0.0.1 they listen on loopback
    alone. A job's own Ray is one node that no other joins, so nothing is lost (a cluster is joined by address)."""
    from ray._private import services

    resolve = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host if host == RAY_LOOPBACK else resolve(host)
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = resolve


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


def dashboard_missing() -> str | None:
    """Why Ray's dashboard cannot start here (the packages of ray[default] are missing), or None."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401  (the import Ray itself judges them by)
    except ImportError as e:
        return str(e)
    return None


def ingest_limits(cfg, model_path: str) -> dict:
    """The job's own bounds on what the ingest accepts, as plain numbers: the model's vocabulary, the
    longest prompt (data.max_prompt_length) and response (actors.max_tokens, or a multi-turn episode's tokens:
    env.max_episode_tokens), the samples of a group
    (actors.n: another size would break the learner ranks' equal shares), and the positions an
    engine enforces: actors.max_model_len, else with vLLM the model's (config.json). The HF engine runs
    rotary models past max_position_embeddings (nothing refuses it there), so it bounds only the parts."""
    model = json.loads((Path(model_path) / "config.json").read_text())
    a = cfg.actors
    own = model.get("max_position_embeddings") or model.get("n_positions")
    positions = a.max_model_len or (own if a.engine == "vllm" else None)
    longest = cfg.data.max_prompt_length + a.max_tokens
    if a.engine == "hf" and cfg.data.train_files and not a.max_model_len and own and longest > own:
        log.warning("data.max_prompt_length + actors.max_tokens = %d tokens is past the model's %d positions "
                    "(max_position_embeddings): the HF engine runs a sample that long all the same, on positions "
                    "the model never saw in training; actors.max_model_len=%d would refuse it", longest, own, own)
    # a multi-turn episode's response holds every turn and the environment's tokens between them
    response = cfg.env.episode_tokens(cfg.buffer) if cfg.env.multi_turn else a.max_tokens
    return {"vocab_size": model["vocab_size"], "max_prompt_tokens": cfg.data.max_prompt_length,
            "max_response_tokens": response, "max_positions": positions, "group_size": a.n}
