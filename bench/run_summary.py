"""python -m bench.run_summary RUN_DIR|METRICS.jsonl [--launched UNIX_SECONDS] [--skip 3] [--json OUT.json]

What BENCHMARKS.md reports of a real run (generation, learner and evaluation speed), from its run directory (the
learner's metrics.jsonl and the launcher's status.json): samples/s over the run, the learner's step
broken down (means over the steps after the first `--skip`, whose start-up costs are not a step's),
lockstep generation (perf/wait_s minus the weights' publication: what the learner waited for at s=0),
the evaluator's time per evaluation against its longest response, what staleness threw away, each actor's
production (samples acked per second over the seconds it held at least one lease) and its engine's mean
step and leased sequences in flight (both from its last heartbeat), the seconds from launch to the first trained
step (the launcher's start-up timeline, or --launched), and that timeline: when each process reached each point on
the way (Ray and Redis up, engines built, first group, the learner ready, its first evaluation, batch and step).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from cluster.status import engine_steps, episodes, production
from learner import metric_names as M

DEFAULT_SKIP = 3   # steps whose start-up costs (first batch, compile, the first publication) are not a step's
PARTS = (M.WAIT_S, M.TRAIN_S, M.PUBLISH_S, M.WS_PUBLISH_S, M.READ_S, M.OTHER_S)


def breakdown(lines: list[dict], skip: int) -> dict:
    """Per-step means of the learner's parts, the run's rate and its books (lines: metrics.jsonl's)."""
    M.require(lines, (M.TIME, M.SAMPLES, M.TRAIN_S, M.WAIT_S, M.RESPONSE_LEN_MEAN, M.RESPONSE_LEN_MAX))
    if len(lines) <= skip + 1:
        raise ValueError(f"{len(lines)} steps: too few to summarise after skipping {skip}")
    steady = lines[skip:]
    # a resumed run's downtime and redone steps are not the system's rate (bench.curve leaves them out too)
    down = M.downtime(lines)[-1]
    wall = lines[-1][M.TIME] - lines[0][M.TIME] - down
    out = {"steps": len(lines), "wall_s": wall, "down_s": down,
           # the first line's samples were waited for before the clock starts (bench.curve counts them)
           "samples_per_s": sum(m[M.SAMPLES] for m in lines[1:]) / wall if wall > 0 else None}
    for k in PARTS:
        out[k] = statistics.fmean(m.get(k) or 0.0 for m in steady)
    out["train_s_median"] = statistics.median(m[M.TRAIN_S] for m in steady)
    out["lockstep_generation_s"] = statistics.fmean(m[M.WAIT_S] - (m.get(M.WS_PUBLISH_S) or 0.0) for m in steady)
    out["response_len_mean"] = statistics.fmean(m[M.RESPONSE_LEN_MEAN] for m in lines)
    out["response_len_max"] = max(m[M.RESPONSE_LEN_MAX] for m in lines)
    out["dropped_stale"] = sum(m.get(M.DROPPED_STALE, 0) for m in lines)
    out["aborted_in_flight"] = lines[-1].get(M.ABORTED_STALE, 0)
    evals = [(m[M.VAL_EVAL_S], m.get(M.VAL_LEN_MAX)) for m in lines if M.VAL_EVAL_S in m]
    if evals:
        secs = [e for e, _ in evals]
        out.update({"evaluations": len(evals), "eval_s_mean": statistics.fmean(secs), "eval_s_max": max(secs),
                    "evaluations_over_1s": sum(e > 1.0 for e in secs)})
        per_token = [e / n for e, n in evals if n]
        if per_token:  # an evaluation takes as many decode steps as its longest response
            out["eval_s_per_decode_step"] = statistics.median(per_token)
    return out


def summarise(path: Path, *, skip: int = DEFAULT_SKIP, launched: float | None = None) -> dict:
    """`path`: a run directory, or a metrics.jsonl alone (then no production: that is in status.json)."""
    run_dir = path if path.is_dir() else None
    lines = M.superseded_dropped(M.read_metrics(str(path / "metrics.jsonl" if run_dir else path)))
    out = breakdown(lines, skip)
    if launched is not None:  # the first line is written when the first step ends
        out["launch_to_first_step_s"] = lines[0][M.TIME] - launched
    if run_dir is not None and (status_path := run_dir / "status.json").exists():
        import yaml

        n = yaml.safe_load((run_dir / "config.yaml").read_text())["actors"]["n"]
        status = json.loads(status_path.read_text())
        out["production"] = production(status, n)
        out["engine_steps"] = engine_steps(status)
        if eps := episodes(status):   # a multi-turn job: the time its episodes spent in their environment
            out["episodes"] = eps
        if startup := status.get("startup"):   # seconds after launch (status.json from before it: none)
            out["startup"] = startup
            out.setdefault("launch_to_first_step_s", startup.get("learner-0:first_step"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("path", type=Path, help="a run directory, or a metrics.jsonl")
    p.add_argument("--launched", type=float, default=None, help="unix time the job was launched")
    p.add_argument("--skip", type=int, default=None,
                   help=f"steps left out of the per-step means (default {DEFAULT_SKIP}, fewer on a shorter run)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    metrics = args.path / "metrics.jsonl" if args.path.is_dir() else args.path
    if not metrics.is_file() or not metrics.stat().st_size:
        p.error(f"{args.path}: no metrics.jsonl with a step in it (a run directory, or its metrics.jsonl)")
    if args.skip is not None and args.skip < 0:
        p.error(f"--skip must be >= 0, got {args.skip}")
    if args.json and not args.json.parent.is_dir():   # before the work, not after it printed
        p.error(f"--json {args.json}: no directory {args.json.parent}")
    try:
        skip = args.skip
        if skip is None:   # a short run (a smoke test) is still summarised: its start-up timeline above all
            skip = max(0, min(DEFAULT_SKIP, len(M.read_metrics(str(metrics))) - 2))
            if skip < DEFAULT_SKIP:
                print(f"note: a short run; per-step means skip its first {skip} step(s), not {DEFAULT_SKIP}",
                      file=sys.stderr)
        out = summarise(args.path, skip=skip, launched=args.launched)
    except ValueError as e:   # too few steps for --skip, a line that is not a JSON object
        p.error(str(e))
    for k, v in out.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a} {x:.1f}" if isinstance(x, float) else f"{a} {json.dumps(x)}"
                          for a, x in v.items()) or "none"
        elif isinstance(v, float):
            v = f"{v:.3f}"
        print(f"{k}: {v}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
