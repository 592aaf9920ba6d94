"""One Ray per test process, joined by the jobs its tests start (`--address`, `cluster.placement=local`).

A job that starts its own Ray starts and stops seven Ray processes (GCS, raylet, the API server, two agents, the
log and autoscaler monitors): seconds of a 2-core machine per job, dozens of jobs in `make test`. A job that joins
this one pays only its driver's connection. Its processes then descend from this Ray's raylet, not from the
launcher, and inherit this Ray's environment, not the launcher's: a test about Ray itself, about the launcher's
process tree, or that gives a job's processes an environment of its own starts the job with a Ray of its own
(`own_ray=True`). The launcher forwards the fault points (runbase.faults.ENV) to a joined Ray's processes itself.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path

# The holder: a driver that starts the local Ray as a job's launcher would (cluster/preflight.py local_ray_kwargs),
# prints its address and keeps it until its stdin closes (this process's exit). It stops Ray's log monitor: every
# driver here passes log_to_driver=False, so nothing reads what it forwards, and its polling of the session's log
# files (two per worker process ever started: hundreds by the end of `make test`) took ~2% of a core all run.
HOLDER = r"""
import sys
import ray
from types import SimpleNamespace
from cluster.preflight import local_ray_kwargs, ray_on_loopback
with ray_on_loopback():
    ctx = ray.init(**local_ray_kwargs(SimpleNamespace(num_cpus=int(sys.argv[1]), dashboard=False)))
ray._private.worker._global_node.kill_log_monitor()
print(ctx.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""
# what a job's own local Ray gives its processes (cluster/placement.py start_ray): the same for a joined one
WORKER_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "OMP_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false"}
ROOT = Path(__file__).resolve().parents[1]
STOP_WAIT_S = 30   # for the holder's ray.shutdown() at the end of the test process, before it is killed

_holder: subprocess.Popen | None = None
_address: str | None = None


def address() -> str:
    """The shared Ray's GCS address, starting it on first use."""
    global _holder, _address
    if _address is None:
        _holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(os.cpu_count() or 1)], text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, **WORKER_ENV},
                                   start_new_session=True, cwd=ROOT)   # ROOT: the holder imports cluster.preflight
        atexit.register(stop)
        line = _holder.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"the tests' shared Ray did not start (exit {_holder.poll()})")
        _address = line
        # a local Ray turns token authentication on and writes its token to ~/.ray/auth_token: the drivers that
        # join it (the jobs' launchers, children of this process) must use it
        os.environ["RAY_AUTH_MODE"] = "token"
    return _address


def stop() -> None:
    if _holder is not None and _holder.poll() is None:
        _holder.stdin.close()
        try:
            _holder.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            _holder.kill()


def job_args(own_ray: bool = False) -> list[str]:
    """The config overrides that make a job join the shared Ray (none with `own_ray`): for cluster.start and for
    a command that passes overrides on to the jobs it starts."""
    return [] if own_ray else [f"cluster.address={address()}", "cluster.placement=local"]
