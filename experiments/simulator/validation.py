"""The simulator against measured runs: each predicted from a calibration (on other runs, leaving its own setting
out, with `validate_loo`) and compared on samples/s, staleness, drops and the engines' step."""
from __future__ import annotations

from pathlib import Path

from experiments.simulator.calibration import calibrate_gpu, fit_tail_factor, predict
from experiments.simulator.runs import length_spread, measured, run_config

def validate(calib: dict, runs: list) -> list[dict]:
    """Predicted vs measured samples/s and staleness distribution, one row per measured run."""
    rows = []
    for rd in runs:
        m = measured(rd)
        p = predict(calib, m)
        rows.append({"run": str(rd), "actors": m["actors"], "learners": m["learners"], "s": m["max_staleness"],
                     "measured": m["samples_per_s"], "predicted": p.samples_per_s,
                     "error": p.samples_per_s / m["samples_per_s"] - 1,
                     "measured_staleness": m["staleness"], "predicted_staleness": p.staleness_fractions(),
                     "measured_dropped": m["dropped_frac"], "predicted_dropped": p.dropped_frac,
                     "measured_engine": m["engine"], "measured_trained_share": m["trained_share"],
                     "predicted_trained_share": p.trained_share,
                     "predicted_engine": {"step_ms": p.engine_step_ms, "leased_inflight": p.leased_inflight,
                                          "running": p.running}})
    return rows


def setting(run) -> int:
    """A run's setting for leave-one-setting-out: its staleness bound (the corrections at one bound are one setting)."""
    return run_config(run)["buffer"]["max_staleness"]


def loo_calibration(i: int, runs: list, engine_fit: str = "curve") -> tuple[dict, list, str]:
    """The GPU calibration that predicts runs[i] from every given run at another bound (none of its own bound: not
    another seed, not another correction), its runs, and a note. Only lockstep runs measure the lockstep costs (the
    group's way to the learner, delivery_s, is hidden wherever actors run ahead), so an s=0 run takes them from the
    other s=0 runs (they join its calibration, though they share its setting): the note says so. An async run's
    generated tails are fitted on the other async runs' waste (fit_tail_factor)."""
    bounds = [setting(r) for r in runs]
    others = [r for r, b in zip(runs, bounds) if b != bounds[i]]
    note = ""
    if bounds[i] == 0:
        others += [r for j, (r, b) in enumerate(zip(runs, bounds)) if b == 0 and j != i]
        note = "with the other s=0 run: only lockstep runs measure the lockstep costs"
    s0 = [r for r in others if setting(r) == 0]
    if not s0:
        raise ValueError(f"{runs[i]}: no other s=0 run to take the lockstep costs from")
    calib = {"base": calibrate_gpu(s0, [r for r in others if setting(r) != 0], engine_fit), "by_learners": {},
             "len_ratios": length_spread(others)}
    # an async prediction's tails (a lockstep one trains all it generates: the lossless runs' ratio is its own)
    calib["tail_factor"] = fit_tail_factor(calib, [r for r in others if setting(r) != 0]) if bounds[i] else 1.0
    return calib, others, note


def lone_lockstep(runs: list) -> int | None:
    """The index of the only s=0 run among several (a sweep on one GPU machine with one lockstep seed): it
    calibrates the async predictions, and nothing can predict it (loo_calibration), so it is left unpredicted."""
    lockstep = [i for i, r in enumerate(runs) if setting(r) == 0]
    return lockstep[0] if len(lockstep) == 1 and len(runs) > 1 else None


def validate_loo(runs: list, engine_fit: str = "curve", fields: dict | None = None) -> list[dict]:
    """Leave one setting out: each run predicted from a calibration on the runs of every other bound (loo_calibration;
    `fields` override the calibrated ones), its row naming them; a lone s=0 run (lone_lockstep) only calibrates."""
    rows, lone = [], lone_lockstep(runs)
    for i, rd in enumerate(runs):
        if i == lone:
            continue
        calib, others, note = loo_calibration(i, runs, engine_fit)
        calib["base"].update(fields or {})
        row = validate(calib, [rd])[0]
        row.update(calibrated_on=[Path(r).name for r in others], note=note,
                   calibration={**calib["base"], "tail_factor": calib["tail_factor"]})
        rows.append(row)
    return rows
