"""The run directory's guards: one launcher at a time, and a resume that continues the same run."""
from __future__ import annotations

import copy
import fcntl
import json
import os
import time
from pathlib import Path

import yaml

from cluster.errors import JobError
from runbase import checkpoints
from runbase.configload import local_path, to_dict

LOCK_FILE = "launcher.lock"   # flocked by the launcher for its lifetime; holds its pid
# What a resume may not change: the checkpoint's shapes (model), and what the run's Redis already holds, groups
# of n samples in batches of groups_per_step, prompts drawn from the task or dataset (the learner would train
# leftover groups of the old shape, or feed a queue of the old prompts); and whether the checkpoint holds a critic
# and of which model (a gae resume of a grpo run started every process, then its learner died on "Missing key in
# checkpoint state_dict: critic.model.embed_tokens.weight")
RESUME_FIXED = ("model.path", "actors.n", "learner.groups_per_step", "task", "data", "algorithm.adv_estimator",
                "critic.model_path")


def write_whole(path: Path, text: str) -> None:
    """A run directory's record (job.json, status.json) as readers must see it: absent, or whole. Written in
    place, a reader polling for the file (an operator's cluster.scale/status, a test waiting on job.json) could
    open it between its creation and its write and read an empty or cut JSON."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def record_end(run_dir, how: str, why: str, exit_code: int) -> None:
    """status.json's `ended`: how the job ended (`finished`, `interrupted`, `failed`), why, its exit code and when,
    written by the launcher last, for the operator commands once the job and its Redis are gone."""
    path = Path(run_dir) / "status.json"
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):   # a job that failed before it could write one
        status = {}
    status["ended"] = {"how": how, "why": why, "exit_code": exit_code, "at": time.time()}
    write_whole(path, json.dumps(status, indent=1))


def ended_state(run_dir) -> dict | None:
    """The run's status.json if its job has ended, else None: no `ended` record, or a job started in the run
    directory since (a --resume rewrites job.json as it starts)."""
    run_dir = Path(run_dir)
    try:
        status = json.loads((run_dir / "status.json").read_text())
        started = (run_dir / "job.json").stat().st_mtime
    except (OSError, ValueError):
        return None
    ended = status.get("ended")
    return status if isinstance(ended, dict) and ended.get("at", 0) >= started else None


# path-valued keys: made absolute at config load (runbase.configload.local_path); a config.yaml written before that
# holds them as given, relative to the launcher's directory then (a resume runs from it too: its own are the same)
PATH_KEYS = ("model.path", "critic.model_path", "data.train_files", "data.val_files", "buffer.replay_dir")


def lock_run_dir(run_dir: Path):
    """An exclusive lock on `run_dir` for as long as the returned file stays open (the launcher's life: the
    OS drops it when the process ends, however it ends). A second launcher on the same directory would start
    a second Redis on the same AOF and a second learner writing the same metrics and checkpoints."""
    f = open(run_dir / LOCK_FILE, "a+")   # not inherited by child processes (PEP 446)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise JobError(f"{run_dir} is in use: launcher pid {pid} is running a job there; stop it (Ctrl-C in its "
                       f"terminal, or kill -INT {pid}) before resuming, or give another --run-dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


_ABSENT = object()


def _dotted(d: dict, key: str):
    for part in key.split("."):
        d = d.get(part, _ABSENT) if isinstance(d, dict) else _ABSENT
    return d


def _differs(old, new) -> bool:
    """Whether a value changed; a value one side does not name is no change, and two sections are compared in
    the keys both have (a config.yaml written before a setting existed does not name it: its default is not a
    change)."""
    if old is _ABSENT or new is _ABSENT:
        return False
    if isinstance(old, dict) and isinstance(new, dict):
        return any(_differs(old[k], new[k]) for k in old.keys() & new.keys())
    return old != new


def _absolute_paths(old: dict) -> dict:
    """An earlier config.yaml with its PATH_KEYS as this version's load writes them (absolute, `~` expanded)."""
    for key in PATH_KEYS:
        section, _, leaf = key.rpartition(".")
        node, value = _dotted(old, section), _dotted(old, key)
        if isinstance(value, str) and not value.startswith("builtin:"):
            node[leaf] = local_path(value)
        elif isinstance(value, list):
            node[leaf] = [local_path(v) if isinstance(v, str) else v for v in value]
    return old


def last_checkpoint(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint in `run_dir` (its COMPLETE marker parses), or None."""
    return checkpoints.newest(run_dir)


def check_resume_redis(r, keys, run_dir: Path) -> None:
    """A resume whose newest checkpoint is older than the one the run's Redis acked the groups for cannot redo
    the steps between (their groups are gone, and the admission counter is past them: it waited forever)."""
    acked, step = r.get(keys.checkpointed), last_checkpoint(run_dir)
    if acked is not None and int(acked) > (step or 0):
        raise JobError(f"--resume: the run's Redis acknowledged the groups of every step up to {int(acked)} "
                       f"(covered by checkpoint {checkpoints.folder(run_dir, int(acked))}), but the newest complete "
                       f"checkpoint in {run_dir / 'checkpoints'} is {'at step ' + str(step) if step else 'none'}: "
                       f"the steps between cannot be redone. Put that checkpoint back, or start a new run in "
                       f"another --run-dir")


# keys a resume changes by nature (the flag itself; the directory named on the command line)
RESUME_NOISE = ("cluster.resume", "cluster.run_dir")


def changes(old, new, prefix: str = "") -> list[str]:
    """`key: old -> new` for every setting both configs name and the new one changes (RESUME_NOISE aside)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [c for k in old.keys() & new.keys() for c in changes(old[k], new[k], f"{prefix}{k}.")]
    key = prefix[:-1]
    return [f"{key}: {old!r} -> {new!r}"] if old != new and key not in RESUME_NOISE else []


def check_resume(cfg, run_dir: Path) -> list[str]:
    """A resume continues the run in `run_dir`: refused when the config changes what its checkpoint and Redis
    were made with (RESUME_FIXED), or leaves nothing to train; the run's previous config.yaml is kept beside the
    new one when anything else changed (config-before-resume-K.yaml). Returns what changed (`changes`): a resume
    takes only the overrides given to it, so a setting the first run's command line set and the resume's does not
    (buffer.max_staleness, learner.correction, trainer.checkpoint_every) goes back to its default, which the
    caller says."""
    step = last_checkpoint(run_dir)
    if step is not None and cfg.trainer.total_steps <= step:
        raise JobError(f"--resume: trainer.total_steps={cfg.trainer.total_steps}, but the run's last checkpoint is "
                       f"at step {step}: nothing is left to train; give a larger trainer.total_steps")
    path = run_dir / "config.yaml"
    if not path.exists():
        return []
    raw = yaml.safe_load(path.read_text()) or {}
    old, new = _absolute_paths(copy.deepcopy(raw)), to_dict(cfg)
    for key in RESUME_FIXED:
        if _differs(_dotted(old, key), _dotted(new, key)):   # the message shows the file's value, as written there
            raise JobError(f"--resume: {key} was {_dotted(raw, key)!r} in {path} and is {_dotted(new, key)!r} now; "
                           f"the run's checkpoint and Redis hold what the old value made: resume with it, or start a "
                           f"new run in another --run-dir")
    if old != new:
        k = len(list(run_dir.glob("config-before-resume-*.yaml"))) + 1
        path.rename(run_dir / f"config-before-resume-{k}.yaml")
        return sorted(changes(old, new))
    return []
