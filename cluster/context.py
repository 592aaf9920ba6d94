"""What every part of a job (cluster/launch.py's Job) shares, filled in as the job starts."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class JobContext:
    """The run a job's parts (placement, processes, supervision, shutdown) work on; each reads it at use, so
    what the start sets later (the resolved config, the run's Redis) reaches every part."""

    cfg: object
    """The job's config; replaced once by the placement with cluster.bind_host and weightsync.backend resolved."""
    run_id: str
    """The run's id: its Redis namespace and the prefix of its Ray actors' names."""
    run_dir: Path
    """The run directory (absolute), locked by this launcher for its life."""
    model_path: str = ""
    """The model's folder (a builtin: model made into one), known once the preflight passed."""
    redis_url: str = ""
    """The run's Redis: --redis-url, or the local server the job started."""
    r: object = None
    """A client of the run's Redis, once it answers (None before: close() then has nothing to tell)."""
    keys: object = None
    """The run's Redis keys (runbase.keys.Keys), with `r`."""
