"""The validation plot: simulated against measured samples/s, and each run's staleness distribution."""
from __future__ import annotations

from pathlib import Path

STALENESS_SHOWN = 0.005   # histogram bins printed: up to the last one holding this fraction on either side
STALENESS_BINS_SHOWN = 12  # longer histograms are printed as their mean (a table cell stays readable)


def plot_validation(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 1 + len(rows), figsize=(3.6 * (1 + len(rows)), 3.4))
    ax = axes[0]
    lim = max(max(r["measured"], r["predicted"]) for r in rows) * 1.15
    ax.plot([0, lim], [0, lim], color="gray", lw=1)
    ax.fill_between([0, lim], [0, lim * 0.85], [0, lim * 1.15], color="gray", alpha=0.15, label="±15%")
    for r in rows:
        ax.scatter(r["measured"], r["predicted"], zorder=3)
        ax.annotate(f"{r['actors']}/{r['learners']} s={r['s']}", (r["measured"], r["predicted"]), fontsize=7,
                    xytext=(3, -9), textcoords="offset points")
    ax.set_xlim(0, lim)
    ax.set_ylim(0, lim)
    ax.set_xlabel("measured samples/s")
    ax.set_ylabel("simulated samples/s")
    ax.set_title("throughput", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    for ax, r in zip(axes[1:], rows):
        ms, ps = r["measured_staleness"], r["predicted_staleness"]
        k = np.arange(1 + max((j for j, (x, y) in enumerate(zip(ms, ps)) if max(x, y) >= STALENESS_SHOWN), default=0))
        ax.bar(k - 0.2, ms[:len(k)], 0.4, label="measured")
        ax.bar(k + 0.2, ps[:len(k)], 0.4, label="simulated")
        ax.set_title(f"staleness, {Path(r['run']).name} ({r['actors']}/{r['learners']}, s={r['s']})", fontsize=9)
        if len(k) <= STALENESS_BINS_SHOWN:
            ax.set_xticks(k)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
