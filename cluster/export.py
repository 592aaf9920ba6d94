"""python -m cluster.export [--run-dir D] [--wait S]: save the running job's current policy.

The learner finishes its current step, then writes `<run_dir>/policy-step-<N>` with
`save_pretrained` (loadable by transformers and vLLM); this command prints that path.
"""
from __future__ import annotations

import argparse
import sys
import time

from cluster.scale import reach_job

WAIT_S = 300.0   # a step plus the save of a large model; the job keeps training meanwhile
POLL_S = 0.2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.export", description=__doc__.split("\n\n")[1])
    p.add_argument("--run-dir", help="the job's run directory (default: newest under runs/)")
    p.add_argument("--wait", type=float, default=WAIT_S, help="seconds to wait for the export (0: do not wait)")
    args = p.parse_args(argv)
    if args.wait < 0:
        p.error(f"--wait must be >= 0 seconds (0: do not wait), got {args.wait:g}")
    job, r, keys = reach_job(args.run_dir)
    before = r.llen(keys.exported)
    r.set(keys.export, 1)
    if not args.wait:
        print(f"run {job['run_id']}: export requested")
        return 0
    deadline = time.monotonic() + args.wait
    while r.llen(keys.exported) <= before:
        if time.monotonic() > deadline:
            print(f"error: no export within {args.wait:.0f}s (is the job still training?)", file=sys.stderr)
            return 1
        time.sleep(POLL_S)
    print(r.lindex(keys.exported, -1).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
