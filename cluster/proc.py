"""What runs inside every Ray actor process: logging with role and id, then the component."""
from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

from runbase import faults, net
from runbase.stalls import cancel_stall_dump

# the given variables whose values a process's log shows (the rest by name: run secrets, the loggers' keys)
SHOWN_ENV = frozenset((*net.IFNAME_ENV, net.VLLM_COPY_ENV, "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", faults.ENV))


def setup_logging(role: str, run_dir: str, level: str = "INFO") -> None:
    """Log to <run_dir>/logs/<role>.log; warnings and errors also to stderr, tagged with the role."""
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s {role} pid={os.getpid()} %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.handlers.clear()
    fh = logging.FileHandler(logs / f"{role}.log")
    fh.setFormatter(fmt)
    root.addHandler(fh)
    sh = logging.StreamHandler(sys.stderr)
    sh.setLevel(logging.WARNING)
    sh.setFormatter(fmt)
    root.addHandler(sh)
    root.setLevel(level)
    # Weight-loading progress bars are noise in a log file. transformers reads this variable when it is
    # first imported; importing it here only to switch them off cost the launcher and the ingest 4 s each.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if hf := sys.modules.get("transformers.utils.logging"):  # already imported: the variable came too late
        hf.disable_progress_bar()


class Proc:
    """A Ray actor hosting one component (`module:Class` with a `run()` method).

    The components know nothing about Ray; this wrapper gives each its log file and makes
    every failure name its role before it propagates to the launcher.
    """

    def __init__(self, role: str, run_dir: str, target: str, kwargs: dict, profile: bool = False,
                 env: dict[str, str] | None = None):
        # The job's settings for every process (interfaces, run secrets, fault points), before anything reads
        # them: given here, not as Ray's runtime_env, which starts each worker through a setup interpreter that
        # imports Ray a second time (~0.35 CPU-s a process) only to set them.
        os.environ.update(env or {})
        self.role, self.target, self.kwargs, self.run_dir, self.profile = role, target, kwargs, run_dir, profile
        setup_logging(role, run_dir)
        if env:   # values only of the settings known to hold no secret (a forwarded WANDB_API_KEY does)
            logging.getLogger("proc").info("environment given: %s", " ".join(
                f"{k}={v}" if k in SHOWN_ENV else k for k, v in sorted(env.items())))

    def where(self) -> dict:
        """Which Ray node this process runs on (the launcher records it in status.json)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

    def run(self):
        log = logging.getLogger("proc")
        try:
            module, name = self.target.split(":")
            cls = getattr(importlib.import_module(module), name)
            if faults.install_from(os.environ):  # chaos tests only: their faults wrap the components just loaded
                log.info("%s runs with the fault module %s", self.role, os.environ[faults.ENV])
            obj = cls(**self.kwargs)
            log.info("%s started", self.role)
            result = profiled(obj.run, Path(self.run_dir) / "profiles" / self.role) if self.profile else obj.run()
            log.info("%s finished", self.role)
            return result
        except BaseException as e:
            log.exception("%s failed", self.role)
            raise RuntimeError(f"{self.role} failed: {type(e).__name__}: {e}") from e
        finally:   # a loop that ended, however, is not stalled: no stack dump is due (runbase.stalls repeats them)
            cancel_stall_dump()


PROFILE_TOP = 60  # functions listed per sort order in a profile's text summary


def profiled(fn, out: Path):
    """fn() under cProfile (its own thread only); `out`.prof and a text summary `out`.txt when it returns."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        out.parent.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(f"{out}.prof")
        buf = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(PROFILE_TOP)
        Path(f"{out}.txt").write_text(buf.getvalue())
