"""python -m bench.curve RUN/metrics.jsonl [--png OUT.png] [--every N]

A run's learning curve from its metrics: a table of the training reward and the validation accuracy
(every `trainer.val_every` steps) against wall time from the first step's start (a resumed run's downtime and redone
steps left out), and, with --png, the
same as a plot. Used for the real-model runs (bench/gpu_smollm2.sh), whose point is that val accuracy
rises within minutes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from learner import metric_names as M


def curve(lines: list[dict]) -> dict:
    """Times from the first step's start, less the time between a crash and its resume's first step (each
    incarnation's first line carries the held-out reward it started from): training time, not downtime.
    Validation points include the step-0 evaluation."""
    if not lines:
        raise ValueError("no step finished: the metrics file is empty")
    M.require(lines, (M.TIME, M.STEP, M.REWARD_MEAN, M.RESPONSE_LEN_MEAN, M.SAMPLES))
    down = M.downtime(lines)   # a resumed incarnation: the crash, its start-up and the redone steps are left out
    times = [m[M.TIME] - d - M.step_start(lines[0]) for m, d in zip(lines, down)]
    steps = [m[M.STEP] + 1 for m in lines]
    # the evaluation before the first step (a resumed run's first step is not step 0)
    first = lines[0][M.STEP]
    val = [(first, 0.0, lines[0][M.VAL_ACCURACY_INITIAL])] if M.VAL_ACCURACY_INITIAL in lines[0] else []
    val += [(m[M.STEP] + 1, t, m[M.VAL_ACCURACY]) for m, t in zip(lines, times) if M.VAL_ACCURACY in m]
    return {"steps": steps, "times": times, "reward": [m[M.REWARD_MEAN] for m in lines],
            "response_len": [m[M.RESPONSE_LEN_MEAN] for m in lines], "val": val,
            "samples": sum(m[M.SAMPLES] for m in lines), "down_s": down[-1],
            "resumes": sum(1 for m in lines[1:] if M.VAL_REWARD_INITIAL in m)}


def table(c: dict, every: int) -> str:
    val_at = {s: a for s, _t, a in c["val"]}
    wall = c["times"][-1]
    rate = f"{c['samples'] / wall:.1f} samples/s" if wall > 0 else "samples/s unknown"
    resumed = f" ({c['resumes']} resume(s): {c['down_s']:.0f} s of downtime and redone steps left out)" if c.get("resumes") else ""
    out = [f"{len(c['steps'])} steps in {wall:.0f} s{resumed}; {rate}",
           "| step | t (s) | reward | response len | val/accuracy |", "|---|---|---|---|---|"]
    if c["val"] and c["val"][0][1] == 0.0:
        out.append(f"| {c['val'][0][0]} | 0 | | | {c['val'][0][2]:.4f} |")
    for s, t, r, n in zip(c["steps"], c["times"], c["reward"], c["response_len"]):
        if s in val_at or s % every == 0:
            va = f"{val_at[s]:.4f}" if s in val_at else ""
            out.append(f"| {s} | {t:.0f} | {r:.3f} | {n:.0f} | {va} |")
    return "\n".join(out)


def plot(c: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    w = max(1, len(c["reward"]) // 20)  # a rolling mean: one step's 128 samples are noisy
    roll = [statistics.fmean(c["reward"][max(0, i - w + 1):i + 1]) for i in range(len(c["reward"]))]
    ax.plot(c["times"], roll, label=f"training reward (mean of {w} steps)", color="tab:blue")
    if c["val"]:
        ax.plot([t for _s, t, _a in c["val"]], [a for _s, _t, a in c["val"]], "o-", color="tab:red",
                label="validation accuracy")
    ax.set_xlabel("wall time (s)" + (", downtime and redone steps of a resume left out" if c.get("resumes") else ""))
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.curve", description=__doc__.split("\n\n")[1])
    p.add_argument("metrics")
    p.add_argument("--png")
    p.add_argument("--title", default="")
    p.add_argument("--every", type=int, default=10, help="table rows: every N steps, plus every validation")
    args = p.parse_args(argv)
    if args.every < 1:
        p.error("--every must be >= 1")
    try:
        # runs written with the old names too; a resumed run's redone steps once (the resumed incarnation's)
        c = curve(M.superseded_dropped(M.read_metrics(args.metrics)))
    except (OSError, ValueError) as e:
        print(f"error: {args.metrics}: {e}", file=sys.stderr)
        return 2
    if args.png and not Path(args.png).resolve().parent.is_dir():
        print(f"error: --png {args.png}: no directory {Path(args.png).resolve().parent}", file=sys.stderr)
        return 2
    print(table(c, args.every))
    if args.png:
        plot(c, Path(args.png), args.title or str(Path(args.metrics).parent))
        print(f"(plot: {args.png})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
