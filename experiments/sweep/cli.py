"""`python -m experiments.staleness`: the sweep's arguments, its run and its exit status."""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import experiments.sweep
from experiments.sweep.config import SweepConfig, fmt_s
from experiments.sweep.report import write_results
from experiments.sweep.runner import load_all, run_all

EXIT_MORE = 3            # main's exit status when the budget left runs for the next call (--resume)
EXIT_INT, EXIT_TERM = 130, 143  # Ctrl-C, SIGTERM: the shell's codes (128 + signal), as cluster.start's


def parse_args(argv=None) -> SweepConfig:
    p = argparse.ArgumentParser(prog="python -m experiments.staleness", description=experiments.sweep.__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML merged over configs/default.yaml, for every run")
    p.add_argument("--max-staleness", type=int, nargs="*", default=[0, 1, 2, 4, 8])
    p.add_argument("--corrections", nargs="+", default=["ppo_clip"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sync", action="store_true", help="also run the synchronous baseline")
    p.add_argument("--steps", type=int, default=0, help="trainer.total_steps (0, the default: the config's)")
    p.add_argument("--actors", type=int, default=0, help="cluster.actors (0, the default: the config's)")
    p.add_argument("--learners", type=int, default=0, help="cluster.learners (0, the default: the config's)")
    p.add_argument("--out", default="")
    p.add_argument("--resume", action="store_true", help="keep OUT's finished runs, run the rest")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no run that would end past this (s)")
    p.add_argument("--run-seconds", type=float, default=0.0, help="stop each run this long after its first step")
    p.add_argument("--report", action="store_true", help="run nothing: summarise every finished run in --out")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    a = p.parse_intermixed_args(argv)
    return SweepConfig(max_staleness=a.max_staleness, corrections=a.corrections, seeds=a.seeds, sync=a.sync,
                       steps=a.steps, config=a.config, actors=a.actors, learners=a.learners,
                       overrides=a.overrides, out=a.out, resume=a.resume, budget_s=a.budget_s,
                       run_seconds=a.run_seconds, report=a.report)


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(cfg.out or f"runs/staleness-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:   # a file there, or nowhere writable
        print(f"error: --out {out}: {e.strerror or e} (a directory for the sweep's runs and results)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    if cfg.report:
        if not (records := load_all(out)):
            print(f"error: --report: no finished run in {out}/runs", file=sys.stderr)
            return 2
        write_results(records, cfg, out)
        return 0
    stop_signals()
    try:
        records, left = run_all(cfg, out, t0)
    except RuntimeError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # a kept run that is not the one asked for (check_kept): nothing ran
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: the running job was stopped; finished runs are kept (--out {out} --resume "
              "goes on)", file=sys.stderr)
        return EXIT_INT
    if not records:
        return EXIT_MORE
    write_results(records, cfg, out)
    print(f"sweep {'done' if not left else f'stopped with {left} run(s) left'} in {fmt_s(time.monotonic() - t0)}: "
          f"{out}/results.parquet, {out}/summary.md, {out}/*.png", flush=True)
    return EXIT_MORE if left else 0


def stop_signals() -> None:
    """SIGTERM unwinds like Ctrl-C, so the running job is stopped (run_one) rather than left behind. SIGINT gets
    Python's handler even where the sweep was started with it ignored (a background job of a non-interactive
    shell): an ignored SIGINT is inherited by every run it starts, and --run-seconds' SIGINT then did nothing
    until the SIGKILL STOP_GRACE_S later (a sync run trained those seconds too)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_TERM))
    signal.signal(signal.SIGINT, signal.default_int_handler)
