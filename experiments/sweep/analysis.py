"""What a sweep's runs measured: pure functions of the per-run records (and a run's status.json)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from learner import metric_names as M

TAIL_FRACTION = 0.1      # "final training reward" = mean over the last 10% of steps (one step is noise)


def step_rows(records: list[dict]) -> list[dict]:
    """One row per learner step of every run (the parquet table)."""
    rows = []
    for rec in records:
        ms = rec["metrics"]
        t0 = ms[0][M.TIME]
        seen = 0
        for m in ms:
            seen += m[M.SAMPLES]
            rows.append({"setting": rec["setting"], "max_staleness": rec["max_staleness"],
                         "correction": rec["correction"], "mode": rec["mode"], "seed": rec["seed"],
                         "step": m[M.STEP], "wall_s": m[M.TIME] - t0, "samples_seen": seen,
                         "reward_mean": m[M.REWARD_MEAN], "staleness_mean": m[M.STALENESS_MEAN],
                         "staleness_max": m[M.STALENESS_MAX], "staleness_hist": list(m[M.STALENESS_HIST]),
                         "dropped_stale": m[M.DROPPED_STALE], "aborted_in_flight": m.get(M.ABORTED_STALE, 0),
                         "groups": len(m[M.GROUPS_TRAINED]),
                         "mismatch_kl": m[M.MISMATCH_KL], "samples_per_s": m[M.SAMPLES_PER_S],
                         "wait_s": m[M.WAIT_S], "loss": m[M.LOSS], "clip_frac": m[M.CLIP_FRAC],
                         "val_reward": m.get(M.VAL_REWARD), "val_reward_initial": m.get(M.VAL_REWARD_INITIAL),
                         "val_accuracy": m.get(M.VAL_ACCURACY), "val_version": m.get(M.VAL_VERSION)})
    return rows


def heldout_points(ms: list[dict], key: str = M.VAL_ACCURACY) -> list[dict]:
    """Every held-out evaluation of a run, placed where the evaluated weights were made: the initial one at
    0, the learner's own at its step's line, an evaluator's (`val/version` v: arrives some steps later) at
    the line of the step that made version v. Each point: step, wall_s, samples_seen, value."""
    first = {M.VAL_ACCURACY: M.VAL_ACCURACY_INITIAL, M.VAL_REWARD: M.VAL_REWARD_INITIAL}[key]
    pts = [{"step": -1, "wall_s": 0.0, "samples_seen": 0, "value": ms[0][first]}] if first in ms[0] else []
    t0, seen, made = ms[0][M.TIME], 0, {}  # made: version -> (step, wall_s, samples_seen) of the line that made it
    for m in ms:
        seen += m[M.SAMPLES]
        here = made.setdefault(m.get(M.VERSION, m[M.STEP] + 1), (m[M.STEP], m[M.TIME] - t0, seen))
        if m.get(key) is None:
            continue
        # an evaluator's result arrives after the line of the version it evaluated; the learner's own is this line's
        at = made.get(m[M.VAL_VERSION]) if M.VAL_VERSION in m else here
        if at is not None:
            pts.append({"step": at[0], "wall_s": at[1], "samples_seen": at[2], "value": m[key]})
    return sorted(pts, key=lambda p: p["samples_seen"])


def trained_share(run_dir, ms: list[dict]) -> float | None:
    """Tokens of the trained samples (each step's samples x mean response) over the rows the actors' engines
    stepped (their heartbeats' `running_seqs`: every token generated, aborted or dropped ones too), or None
    where an engine did not count its rows on every step (the HF engine, runs from before the counter)."""
    path = Path(run_dir) / "status.json"
    beats = [m for role, m in json.loads(path.read_text()).get("members", {}).items()
             if role.startswith("actor")] if path.exists() else []
    if not beats or any(not m.get("running_seqs") or m.get("occupied_steps") != m.get("engine_steps") for m in beats):
        return None
    trained = sum(m[M.SAMPLES] * m.get(M.RESPONSE_LEN_MEAN, 0.0) for m in ms)
    return trained / sum(m["running_seqs"] for m in beats)


def run_throughput(ms: list[dict]) -> float:
    """Steady-state samples/s of one run: steps 1..T-2 over their wall time. Step 0 includes start-up
    waiting and the last step the final held-out evaluation, neither of which is training."""
    if len(ms) < 4:
        return sum(m[M.SAMPLES] for m in ms) / max(ms[-1][M.TIME] - ms[0][M.TIME], 1e-9) if len(ms) > 1 else math.nan
    body = ms[1:-1]
    return sum(m[M.SAMPLES] for m in body) / (body[-1][M.TIME] - ms[0][M.TIME])


def _mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def _last(points: list[dict]) -> float | None:
    after = [p for p in points if p["step"] >= 0]  # the initial evaluation (step -1) is no end value
    return after[-1]["value"] if after else None


def summarize(records: list[dict]) -> list[dict]:
    """Per setting: held-out reward end (mean, std over seeds), final training reward, samples/s,
    speed-up vs sync, fraction of groups dropped as stale, staleness, mismatch KL."""
    order = list(dict.fromkeys(r["setting"] for r in records))
    out = []
    for label in order:
        runs = [r for r in records if r["setting"] == label]
        tail = [sum(m[M.REWARD_MEAN] for m in r["metrics"][-max(1, int(len(r["metrics"]) * TAIL_FRACTION)):])
                / max(1, int(len(r["metrics"]) * TAIL_FRACTION)) for r in runs]
        trained = sum(len(m[M.GROUPS_TRAINED]) for r in runs for m in r["metrics"])
        # dropped by the learner on arrival, plus aborted in flight by the actors (a running total per run)
        dropped = sum(m[M.DROPPED_STALE] for r in runs for m in r["metrics"]) \
            + sum(r["metrics"][-1].get(M.ABORTED_STALE, 0) for r in runs)
        all_m = [m for r in runs for m in r["metrics"]]
        out.append({"setting": label, "mode": runs[0]["mode"], "seeds": len(runs),
                    "val_start": _mean_std([r["metrics"][0].get(M.VAL_REWARD_INITIAL) for r in runs]),
                    # the last evaluation, wherever it came (a run stopped by the clock has no final one)
                    "val_end": _mean_std([_last(heldout_points(r["metrics"], M.VAL_REWARD)) for r in runs]),
                    "acc_start": _mean_std([r["metrics"][0].get(M.VAL_ACCURACY_INITIAL) for r in runs]),
                    "acc_end": _mean_std([_last(heldout_points(r["metrics"])) for r in runs]),
                    "train_reward_tail": _mean_std(tail),
                    "samples_per_s": _mean_std([run_throughput(r["metrics"]) for r in runs]),
                    "dropped_frac": dropped / max(trained + dropped, 1),
                    "staleness_mean": sum(m[M.STALENESS_MEAN] * m[M.SAMPLES] for m in all_m)
                    / max(sum(m[M.SAMPLES] for m in all_m), 1),
                    "mismatch_kl": sum(m[M.MISMATCH_KL] for m in all_m) / max(len(all_m), 1),
                    # generation spent on groups aborted or dropped as too stale (runs whose engines count rows)
                    "generation_wasted": _mean_std([1 - r["trained_share"] for r in runs
                                                    if r.get("trained_share") is not None]),
                    "run_wall_s": sum(r["run_wall_s"] for r in runs) / len(runs)})
    base = next((s for s in out if s["mode"] == "sync"), None)
    for s in out:
        s["speedup_vs_sync"] = s["samples_per_s"][0] / base["samples_per_s"][0] if base else math.nan
    _against_reference(out, records)
    return out


def accuracy_at_samples(points: list[dict], samples: float) -> float | None:
    """Held-out accuracy interpolated at `samples` trained on (None outside the run's evaluations)."""
    for a, b in zip(points, points[1:]):
        if a["samples_seen"] <= samples <= b["samples_seen"]:
            span = b["samples_seen"] - a["samples_seen"]
            return b["value"] if span == 0 else a["value"] + (samples - a["samples_seen"]) / span * (b["value"] - a["value"])
    return None


def seconds_to(points: list[dict], target: float) -> float | None:
    """Wall seconds at which the two-point moving mean of held-out accuracy first reaches `target` (the
    learner-speed issue's measure); None if it never does."""
    return next((b["wall_s"] for a, b in zip(points, points[1:]) if (a["value"] + b["value"]) / 2 >= target), None)


def _against_reference(out: list[dict], records: list[dict]) -> None:
    """Each setting against the reference run (sync, else s=0): held-out accuracy at equal samples (the
    fewest any run had trained on at its last evaluation), and seconds to the reference's final accuracy
    (its last two-point mean). What the sweep is for: where staleness starts to cost, and what async saves."""
    pts = [(r["setting"], heldout_points(r["metrics"])) for r in records]
    ends = [p[-1]["samples_seen"] for _lab, p in pts if len(p) > 1]
    equal = min(ends) if ends else None
    target = None
    for ref in [s["setting"] for s in out if s["mode"] == "sync"] + ["s=0"]:  # the first with evaluations
        finals = [(p[-2]["value"] + p[-1]["value"]) / 2 for lab, p in pts if lab == ref and len(p) > 2]
        if finals:
            target = sum(finals) / len(finals)
            break
    for s in out:
        mine = [p for lab, p in pts if lab == s["setting"]]
        s["equal_samples"], s["ref_accuracy"] = equal, target
        s["acc_at_equal"] = _mean_std([accuracy_at_samples(p, equal) for p in mine] if equal else [])
        times = [seconds_to(p, target) for p in mine] if target is not None else []
        s["s_to_ref"] = _mean_std(times)
        s["s_to_ref_missed"] = sum(t is None for t in times)  # seeds that never reached it (left out of the mean)
