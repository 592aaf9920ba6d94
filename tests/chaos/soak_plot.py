"""The soak's course as a picture: training reward and the share of steps with a zero gradient (every group of the
step scored alike: nothing to learn from), per window of steps, with each resumed job's first step marked.

    python tests/chaos/soak_plot.py RUN_DIR OUT.png [--title TEXT] [--window 250]

soak.py draws it at the end of a soak (`soak_reward.png` beside `soak.json`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from ledger import counted_steps  # noqa: E402

from learner import metric_names as M  # noqa: E402

WINDOW = 250   # steps per point: thousands of steps of a 2-hour soak, each one group-noisy


def course(lines: list[dict], window: int = WINDOW) -> list[tuple[int, float, float]]:
    """(first step, mean training reward, share of zero-gradient steps) per `window` counted steps."""
    out = []
    for i in range(0, len(lines) - window + 1, window):
        w = lines[i:i + window]
        out.append((w[0][M.STEP], sum(m[M.REWARD_MEAN] for m in w) / window,
                    sum(1 for m in w if m.get(M.GRAD_NORM, 1.0) == 0.0) / window))
    return out


def plot(run_dir: Path, out: Path, *, title: str, window: int = WINDOW) -> list[tuple[int, float, float]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = counted_steps(run_dir)
    pts = course(lines, window)
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for m in lines[1:]:
        if M.VAL_REWARD_INITIAL in m:   # a resumed job's first line
            ax.axvline(m[M.STEP], color="0.9", lw=0.8, zorder=0)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"training reward (mean of {window} steps)")
    ax.plot([p[0] for p in pts], [p[2] for p in pts], label="share of steps with a zero gradient", alpha=0.7)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("step (grey: a resumed job's first step)")
    ax.set_title(title)
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return pts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--title", default="the soak's job")
    p.add_argument("--window", type=int, default=WINDOW)
    a = p.parse_args(argv)
    for step, reward, zero in plot(a.run_dir, a.out, title=a.title, window=a.window)[::max(1, 1000 // a.window)]:
        print(f"step {step:6d}  reward {reward:.3f}  zero-gradient steps {zero:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
