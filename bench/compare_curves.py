"""Held-out accuracy against seconds of training for several runs, ours and TRL's, in one plot and table.

    python -m bench.compare_curves LABEL=RUN.metrics.jsonl [LABEL=trl.metrics.jsonl ...] [--png OUT.png]
        [--threshold 0.30] [--title T]

Our runs' metrics (the learner's metrics.jsonl) are read as bench.curve reads them: times from the first
step's start, a resumed run's downtime and redone steps left out. TRL's (bench/trl_vllm.py's trl.metrics.jsonl:
one line per evaluation with `train_s`, the seconds of training with evaluation time kept off its clock) as they
are. For each run: samples/s over
the run, and when a two-point moving average of the accuracy first reaches --threshold (the time-to-accuracy
measure of BENCHMARKS.md's comparisons with TRL).
"""
from __future__ import annotations

import argparse

from bench.curve import curve
from learner import metric_names as M


def read_points(path: str) -> tuple[list[tuple[float, float]], float | None]:
    """(seconds, accuracy) points and samples/s of one run, ours or TRL's."""
    lines = M.json_lines(path)
    if lines and "train_s" in lines[0] and "val/accuracy" in lines[0]:  # TRL's evaluation lines
        pts = [(float(m["train_s"]), float(m["val/accuracy"])) for m in lines if "val/accuracy" in m]
        summary = next((m for m in lines if m.get("summary")), None)
        return pts, (summary or {}).get("samples_per_s")

    c = curve(M.superseded_dropped(M.read_metrics(path)))
    rate = c["samples"] / c["times"][-1] if c["times"] and c["times"][-1] > 0 else None
    return [(t, a) for _s, t, a in c["val"]], rate


def first_crossing(pts: list[tuple[float, float]], threshold: float) -> float | None:
    """Seconds at which the mean of two consecutive accuracy points first reaches `threshold`."""
    for (_t0, a0), (t1, a1) in zip(pts, pts[1:]):
        if (a0 + a1) / 2 >= threshold:
            return t1
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_curves", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=PATH")
    p.add_argument("--png")
    p.add_argument("--threshold", type=float, default=0.30)
    p.add_argument("--title", default="held-out accuracy against seconds of training")
    args = p.parse_args(argv)
    runs = []
    for spec in args.runs:
        label, sep, path = spec.rpartition("=")  # labels may hold "=" (s=2), paths rarely do
        if not sep:
            p.error(f"expected LABEL=PATH, got {spec!r}")
        try:
            runs.append((label, *read_points(path)))
        except (OSError, ValueError) as e:   # missing, a directory, not JSON lines, no step finished
            p.error(f"{label}={path}: {e}")
    print(f"| run | samples/s | accuracy points | 2-point mean first >= {args.threshold} |\n|---|---|---|---|")
    for label, pts, rate in runs:
        cross = first_crossing(pts, args.threshold)
        print(f"| {label} | {rate:.1f} | " if rate else f"| {label} | | ", end="")
        print(" -> ".join(f"{a:.3f} ({t:.0f} s)" for t, a in pts) + " | " +
              (f"{cross:.0f} s |" if cross is not None else "not reached |"))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for label, pts, _rate in runs:
            ax.plot([t for t, _a in pts], [a for _t, a in pts], "o-", label=label)
        ax.axhline(args.threshold, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("seconds after the first training step")
        ax.set_ylabel("held-out accuracy")
        ax.set_title(args.title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        plt.close(fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
