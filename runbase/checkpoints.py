"""A run's checkpoint folders (`<run_dir>/checkpoints/step-NNNNNNNN`): which are complete, their COMPLETE
marker written all or nothing, and the old ones pruned. No torch: the learner writes the shards, the launcher
reads what is there before anything starts.

A checkpoint is complete when its COMPLETE marker parses and names its step: the learner writes the marker
after every rank's shards, so a kill, a full disk or a power loss in between leaves a folder without one, which
nothing loads.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

FOLDER = re.compile(r"step-(\d+)")
MARKER = "COMPLETE"


def folder(run_dir, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def write_marker(path, marker: dict) -> None:
    """A checkpoint's COMPLETE marker, all or nothing: written beside it, flushed to disk, then renamed into
    place (a kill or a full disk between open and write would otherwise leave an empty COMPLETE, which every
    --resume would take for the newest checkpoint and fail to parse)."""
    tmp = Path(path) / f"{MARKER}.tmp"
    with open(tmp, "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(path) / MARKER)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself, on disk
    finally:
        os.close(fd)


def read_marker(path) -> dict | None:
    """The COMPLETE marker of the checkpoint at `path`, or None if it is missing, empty or cut short."""
    try:
        marker = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("step"), int) else None


def complete(run_dir) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint of the run, oldest first; a folder whose marker is there but
    does not parse is passed over with a warning."""
    out = []
    for p in (Path(run_dir) / "checkpoints").glob(f"step-*/{MARKER}"):
        if not (m := FOLDER.fullmatch(p.parent.name)):
            continue
        if read_marker(p.parent) is None:
            log.warning("%s is not a complete marker (empty or cut short); that checkpoint is passed over", p)
            continue
        out.append((int(m.group(1)), p.parent))
    return sorted(out)


def newest(run_dir) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    done = complete(run_dir)
    return done[-1][0] if done else None


def prune(run_dir, keep: int) -> list[Path]:
    """Remove all but the `keep` newest complete checkpoints, and any unfinished folder older than the newest
    complete one (a save a kill or a full disk cut short); returns what was removed. keep=0: keep all."""
    if not keep:
        return []
    done = complete(run_dir)
    if not done:
        return []
    kept = {p for _s, p in done[-keep:]}
    newest_step = done[-1][0]
    gone = []
    for p in sorted((Path(run_dir) / "checkpoints").glob("step-*")):
        m = FOLDER.fullmatch(p.name)
        if m and p not in kept and int(m.group(1)) < newest_step:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone
