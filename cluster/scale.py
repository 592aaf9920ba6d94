"""python -m cluster.scale --actors N [--run-dir D]: change the actor count of a running job.

Finds the job through D/job.json (default: the newest run under runs/) and sets the target
in Redis; the launcher starts new actors (they join the next weight publication) or drains
the newest ones (each finishes its batch, leaves the weight group, exits).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cluster.rundir import ended_state
from runbase.keys import Keys, connect


def job_dir(run_dir: str | None) -> Path:
    """The run directory asked for, or the newest under runs/ that a job started in."""
    if run_dir is None:
        jobs = sorted(Path("runs").glob("*/job.json"), key=lambda p: p.stat().st_mtime)
        if not jobs:
            raise FileNotFoundError("no runs/*/job.json here; pass --run-dir of a running job")
        return jobs[-1].parent
    path = Path(run_dir) / "job.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} the run directory of a running job?")
    return Path(run_dir)


def find_job(run_dir: str | None) -> dict:
    return json.loads((job_dir(run_dir) / "job.json").read_text())


def ended_run(run_dir: str | None) -> dict | None:
    """The final status.json of the run asked for if its job has ended (cluster/rundir.py ended_state), else None."""
    try:
        return ended_state(job_dir(run_dir))
    except FileNotFoundError:
        return None


def say_ended(status: dict, run: str) -> str:
    """One line: the run, how and when it ended, and why."""
    e = status["ended"]
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(e["at"])))
    return f"run {run} {e['how']} at {at} (exit {e['exit_code']}): {e['why']}"


# An operator command on a job that has ended must say so in seconds, not ride out a 30 s outage.
OPERATOR_OUTAGE_S = 2.0
OPERATOR_REPLY_S = 5.0   # nor wait forever on a port that accepts and never answers (a stopped Redis, not Redis)
MAX_ACTORS = 4096        # far more actor processes than a cluster here holds: a typo's 10**11 is refused


def reach_job(run_dir: str | None):
    """(job, redis client, keys) of a running job; SystemExit with a one-line error when there is none
    (no job.json, or its Redis no longer answers: the job has ended, said plainly where status.json tells)."""

    if (status := ended_run(run_dir)) is not None:
        print(f"error: {say_ended(status, str(job_dir(run_dir)))}; the run has ended, nothing to act on (cluster.status "
              "prints its final state)", file=sys.stderr)
        raise SystemExit(2)
    try:
        job = find_job(run_dir)
        r = connect(job["redis_url"], outage_s=OPERATOR_OUTAGE_S, socket_timeout_s=OPERATOR_REPLY_S)
        keys = Keys(job["run_id"])
        ended, known = r.get(keys.ended), r.exists(keys.startup)
    except Exception as e:  # the job's files or its Redis are gone: say so, not a traceback
        what = f"{type(e).__name__}: {e}" if isinstance(e, (KeyError, TypeError, ValueError)) else str(e)
        print(f"error: cannot reach the job ({what}); is it running?", file=sys.stderr)
        raise SystemExit(2) from None
    if ended is not None:   # its Redis outlives it (--redis-url): the launcher marked the end
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ended)))
        print(f"error: run {job['run_id']} ended at {at}; its final state is in its run directory's status.json",
              file=sys.stderr)
        raise SystemExit(2)
    if not known:   # the launcher writes it before job.json: this Redis never held the run (its port reused)
        print(f"error: cannot reach the job (the Redis at {job['redis_url']} holds no run {job['run_id']}: "
              "the job has ended and another server took its port?); is it running?", file=sys.stderr)
        raise SystemExit(2)
    return job, r, keys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.scale", description=__doc__.split("\n\n")[1])
    p.add_argument("--actors", type=int, required=True, help="desired number of rollout actors (>= 1)")
    p.add_argument("--run-dir", help="the job's run directory (default: newest under runs/)")
    args = p.parse_args(argv)
    if not 1 <= args.actors <= MAX_ACTORS:
        print(f"error: --actors must be in 1..{MAX_ACTORS} (the learner needs someone to generate; each actor is a "
              f"process), got {args.actors}", file=sys.stderr)
        return 2
    job, r, keys = reach_job(args.run_dir)
    r.set(keys.scale_target, args.actors)
    print(f"run {job['run_id']}: actor target set to {args.actors}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
