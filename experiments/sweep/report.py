"""A sweep's results: DIR/results.parquet (one row per learner step of every run), PNG plots and DIR/summary.md."""
from __future__ import annotations

import math
from pathlib import Path

from experiments.sweep.analysis import heldout_points, step_rows, summarize
from experiments.sweep.config import SweepConfig, fmt_s
from learner import metric_names as M

def write_results(records: list[dict], cfg: SweepConfig, out: Path) -> None:
    """The parquet, the plots and the summary of every finished run (this call's and kept ones)."""
    write_parquet(step_rows(records), out / "results.parquet")
    summary = summarize(records)
    plot(records, summary, out)
    steps = max(len(r["metrics"]) for r in records)
    runs_s = sum(r["run_wall_s"] for r in records)
    (out / "summary.md").write_text(summary_markdown(summary, cfg, runs_s, steps))
    print((out / "summary.md").read_text())


def summary_markdown(summary: list[dict], cfg: SweepConfig, wall_s: float, steps: int) -> str:
    """`wall_s`: the runs' own wall time, summed (a resumed sweep's runs come from several calls)."""
    pm = lambda ms, d=3: f"{ms[0]:.{d}f} ± {ms[1]:.{d}f}"  # noqa: E731
    lines = ["# Staleness sweep", "",
             f"{len(summary)} settings x {_seeds(summary, cfg)} seeds, up to {steps} steps each; "
             f"runs' wall time {fmt_s(wall_s)}. Mean ± std over seeds. Held-out reward: 128 prompts never "
             "trained on, same sampling seed at start and end; \"last\" is the run's last evaluation (a run "
             "stopped by the clock has no final one). Samples/s: steady state (steps 1..T-2).", "",
             "| setting | held-out reward start -> last | held-out accuracy start -> last | train reward (last 10%) "
             "| samples/s | speed-up vs sync | dropped stale (learner + actors) | generation wasted | mean staleness "
             "| mismatch KL |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        sp = "-" if math.isnan(s["speedup_vs_sync"]) else f"{s['speedup_vs_sync']:.2f}x"
        acc = "-" if math.isnan(s["acc_start"][0]) else f"{s['acc_start'][0]:.3f} -> {pm(s['acc_end'])}"
        lines.append(f"| {s['setting']} | {s['val_start'][0]:.3f} -> {pm(s['val_end'])} | {acc} "
                     f"| {pm(s['train_reward_tail'])} "
                     f"| {pm(s['samples_per_s'], 0)} | {sp} | {100 * s['dropped_frac']:.1f}% | {_wasted(s)} "
                     f"| {s['staleness_mean']:.2f} | {s['mismatch_kl']:.4f} |")
    return "\n".join(lines + _reference_table(summary)) + "\n"


def _wasted(s: dict) -> str:
    """Share of generated tokens that trained nothing (mean over the seeds that counted their rows), or -. The
    rows are counted after each engine step, within ~1% of the tokens (a lockstep run shows 1.00-1.01 trained
    per row): below 0 is shown as 0."""
    w = s["generation_wasted"]
    return "-" if math.isnan(w[0]) else f"{100 * max(w[0], 0.0):.0f}%"


def _missed(s: dict) -> str:
    k = s.get("s_to_ref_missed", 0)
    return f" ({k} of {s['seeds']} seeds never)" if k else ""


def _seeds(summary: list[dict], cfg: SweepConfig) -> str:
    """Seeds per setting: the sweep's, or (a report of runs from several calls) the range found."""
    n = sorted({s["seeds"] for s in summary})
    return str(cfg.seeds) if not cfg.report else str(n[0]) if len(n) == 1 else f"{n[0]}-{n[-1]}"


def _reference_table(summary: list[dict]) -> list[str]:
    """The settings against the reference run (summarize's `_against_reference`), when runs were evaluated."""
    s0 = summary[0] if summary else {}
    if s0.get("equal_samples") is None:
        return []
    ref = s0["ref_accuracy"]
    head = f"seconds to {ref:.3f} (the reference's final accuracy, 2-point mean)" if ref is not None else "-"
    lines = ["", f"| setting | held-out accuracy at {s0['equal_samples']} samples | {head} |", "|---|---|---|"]
    for s in summary:
        t = "-" if ref is None else "never" if math.isnan(s["s_to_ref"][0]) else \
            f"{s['s_to_ref'][0]:.0f} ± {s['s_to_ref'][1]:.0f}" + _missed(s)
        acc = "-" if math.isnan(s["acc_at_equal"][0]) else f"{s['acc_at_equal'][0]:.3f} ± {s['acc_at_equal'][1]:.3f}"
        lines.append(f"| {s['setting']} | {acc} | {t} |")
    return lines


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def plot(records: list[dict], summary: list[dict], out: Path) -> list[Path]:
    """reward vs step / wall clock / samples, staleness distribution, throughput: one PNG each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = [s["setting"] for s in summary]
    colors = {lab: plt.cm.viridis(i / max(len(order) - 1, 1)) for i, lab in enumerate(order)}
    colors.update({lab: "black" for lab in order if lab == "sync"})
    files = [_plot_reward(records, order, colors, xkey, xlabel, out / fname)
             for xkey, xlabel, fname in [("step", "learner step", "reward_vs_step.png"),
                                         ("wall_s", "wall clock since first step (s)", "reward_vs_wallclock.png"),
                                         ("samples_seen", "samples trained on", "reward_vs_samples.png")]]
    if any(len(heldout_points(r["metrics"])) > 1 for r in records):  # runs with an accuracy scorer
        files += [_plot_heldout(records, order, colors, xkey, xlabel, out / fname)
                  for xkey, xlabel, fname in [("wall_s", "wall clock since first step (s)", "heldout_vs_wallclock.png"),
                                              ("samples_seen", "samples trained on", "heldout_vs_samples.png")]]
    files.append(_plot_staleness(records, order, colors, out / "staleness_distribution.png"))
    files.append(_plot_throughput(summary, order, colors, out / "throughput.png"))
    return files


def _smooth(y, k: int = 5):
    """One step's reward is a mean over 64 samples: noisy; a short moving average."""
    import numpy as np

    y = np.asarray(y, float)
    if len(y) < k:
        return y
    return np.convolve(np.pad(y, (k // 2, k - 1 - k // 2), mode="edge"), np.ones(k) / k, mode="valid")


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _plot_reward(records: list[dict], order: list[str], colors: dict, xkey: str, xlabel: str, path: Path) -> Path:
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for lab in order:
        first = True
        for rec in (r for r in records if r["setting"] == lab):
            ms = rec["metrics"]
            xs = {"step": [m[M.STEP] for m in ms], "wall_s": [m[M.TIME] - ms[0][M.TIME] for m in ms],
                  "samples_seen": np.cumsum([m[M.SAMPLES] for m in ms])}[xkey]
            ax.plot(xs, _smooth([m[M.REWARD_MEAN] for m in ms]), color=colors[lab], lw=1.4, alpha=0.85,
                    ls="--" if lab == "sync" else "-", label=lab if first else None)
            first = False
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training reward (5-step moving mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _plot_heldout(records: list[dict], order: list[str], colors: dict, xkey: str, xlabel: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for lab in order:
        for i, rec in enumerate(r for r in records if r["setting"] == lab):
            pts = heldout_points(rec["metrics"])
            ax.plot([p[xkey] for p in pts], [p["value"] for p in pts], marker="o", ms=3, color=colors[lab], lw=1.4,
                    alpha=0.85, ls="--" if lab == "sync" else "-", label=None if i else lab)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out accuracy (at the weights evaluated)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _plot_staleness(records: list[dict], order: list[str], colors: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    width = 0.8 / max(len(order), 1)
    for i, lab in enumerate(order):
        hist = {}
        for r in (r for r in records if r["setting"] == lab):
            for m in r["metrics"]:
                for k, c in enumerate(m[M.STALENESS_HIST]):
                    hist[k] = hist.get(k, 0) + c
        total = sum(hist.values()) or 1
        ks = sorted(hist)
        ax.bar(np.array(ks) + (i - (len(order) - 1) / 2) * width, [hist[k] / total for k in ks], width,
               color=colors[lab], label=lab)
    ax.set_xlabel("staleness of trained samples (learner version - version_start)")
    ax.set_ylabel("fraction of trained samples")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def _plot_throughput(summary: list[dict], order: list[str], colors: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    means = [s["samples_per_s"][0] for s in summary]
    ax.bar(order, means, yerr=[s["samples_per_s"][1] for s in summary], color=[colors[lab] for lab in order],
           capsize=4)
    for i, s in enumerate(summary):
        if not math.isnan(s["speedup_vs_sync"]):
            ax.text(i, means[i], f"{s['speedup_vs_sync']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("samples/s (steady state, mean over seeds)")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)
