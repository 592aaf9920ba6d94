"""`python -m experiments.simulate`: a table of simulated systems, or predictions of measured runs (validation)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import experiments.simulator
from experiments.simulator.calibration import ENGINE_FITS, calibrate, calibrate_gpu, calibration_for, fit_tail_factor
from experiments.simulator.config import SimConfig
from experiments.simulator.model import simulate
from experiments.simulator.plots import STALENESS_BINS_SHOWN, STALENESS_SHOWN, plot_validation
from experiments.simulator.runs import length_spread
from experiments.simulator.validation import lone_lockstep, validate, validate_loo

def main(argv=None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    _check_args(p, a)
    try:
        return _main(p, a)
    except ValueError as e:   # a run too short to calibrate from, of the wrong kind: named, not a traceback
        p.error(str(e))


def _main(p, a) -> int:
    if a.validate_loo:
        rows = validate_loo(a.validate_loo, a.engine_fit or "curve",
                            {**_overrides(a.set), **({"cores": a.cores} if a.cores else {})})
        if (lone := lone_lockstep(a.validate_loo)) is not None:
            print(f"{a.validate_loo[lone]}: not predicted: the only s=0 run (the async predictions take their "
                  "lockstep costs from it; a second s=0 run would predict it)")
        _report_validation(rows, a.out, "simulator_validation_loo.png")
        return 0
    if a.gpu_s0_run:
        calib = {"base": calibrate_gpu(a.gpu_s0_run, a.gpu_async_run, a.engine_fit or "line"), "by_learners": {},
                 "len_ratios": length_spread([*a.gpu_s0_run, *a.gpu_async_run])}
        calib["tail_factor"] = fit_tail_factor(calib, a.gpu_async_run)
    else:
        calib = calibrate(a.sync_run, a.s0_run) if a.sync_run else {"base": {}, "by_learners": {}}
    overrides = _overrides(a.set)
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    if a.validate is not None:
        if not (a.sync_run and a.s0_run) and not a.gpu_s0_run:
            p.error("--validate needs --sync-run and --s0-run (or --gpu-s0-run) to calibrate from")
        for fields in calib["by_learners"].values() or [calib["base"]]:
            fields.update(overrides, **({"cores": a.cores} if a.cores else {}))
        rows = validate(calib, a.validate)
        for r, fields in sorted(calib["by_learners"].items()) or [(1, {})]:
            print(f"calibration ({r} learner{'s' * (r > 1)}): " + _rounded({**calib["base"], **fields}))
        _report_validation(rows, out, "simulator_validation.png", calib)
        return 0
    overrides = {"cores": a.cores or math.inf, "steps": a.steps, **overrides}
    rows = _table(calib, overrides, a.actors, a.learners, a.max_staleness, a.modes)
    print("| actors | learners | mode | s | samples/s | learner idle | actor idle | dropped | staleness 0,1,.. |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['actors']} | {r['learners']} | {r['mode']} | {r['s']} | {r['samples_per_s']:.0f} | "
              f"{100 * r['learner_idle']:.0f}% | {100 * r['actor_idle']:.0f}% | {100 * r['dropped']:.1f}% | "
              + " ".join(f"{x:.2f}" for x in r["staleness"]) + " |")
    if out:
        (out / "simulation.json").write_text(json.dumps({"calibration": calib, "overrides": overrides, "rows": rows},
                                                        indent=1))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.simulate", description=experiments.simulator.__doc__.split("\n\n")[0])
    p.add_argument("--actors", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--learners", type=int, nargs="+", default=[8])
    p.add_argument("--max-staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--cores", type=float, help="shared CPU cores (inf: one GPU per process; default: inf, or the "
                                               "calibration runs' machine when validating)")
    p.add_argument("--sync-run", help="experiments.sync run dir to calibrate generation/training costs from")
    p.add_argument("--s0-run", nargs="*", default=[],
                   help="cluster.start max_staleness=0 run dirs (one per learner count) to calibrate the system's costs")
    p.add_argument("--gpu-s0-run", nargs="*", default=[],
                   help="GPU: cluster.start max_staleness=0 runs with vLLM actors to calibrate from (calibrate_gpu)")
    p.add_argument("--gpu-async-run", nargs="*", default=[],
                   help="GPU: runs at s >= 1 that calibrate what sharing the GPU costs (predicted by nothing)")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override SimConfig fields")
    p.add_argument("--validate", nargs="*", metavar="RUN", help="measured run dirs to predict and compare")
    p.add_argument("--validate-loo", nargs="+", metavar="RUN",
                   help="GPU: leave one setting out: predict each run from the given runs at other bounds (validate_loo)")
    p.add_argument("--engine-fit", choices=ENGINE_FITS, default=None,
                   help="GPU: the engine step in leased sequences, a line or a monotone piecewise-linear curve "
                        "(default: line for --gpu-s0-run, curve for --validate-loo)")
    p.add_argument("--out", help="write results (JSON, and the validation plot) here")
    return p


def _check_args(p, a) -> None:
    """Refuse what SimConfig would reject with a traceback, or what would be silently ignored."""
    for flag, values, low in (("--actors", a.actors, 1), ("--learners", a.learners, 1),
                              ("--max-staleness", a.max_staleness, 0), ("--steps", [a.steps], 1)):
        if any(v < low for v in values):
            p.error(f"{flag}: every value must be >= {low}, got {values}")
    if a.cores is not None and not a.cores > 0:
        p.error(f"--cores: must be > 0 (inf: one GPU per process), got {a.cores}")
    if a.s0_run and not a.sync_run:
        p.error("--s0-run calibrates together with --sync-run; give both")
    if a.gpu_async_run and not a.gpu_s0_run:
        p.error("--gpu-async-run calibrates together with --gpu-s0-run; give both")
    for run in [a.sync_run or "", *a.s0_run, *a.gpu_s0_run, *a.gpu_async_run, *(a.validate or []),
                *(a.validate_loo or [])]:
        if run and not (Path(run) / "metrics.jsonl").is_file():
            p.error(f"{run}: not a run directory (no metrics.jsonl)")


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for kv in pairs:
        k, _, v = kv.partition("=")
        if k not in SimConfig.__dataclass_fields__:
            raise SystemExit(f"--set {kv}: SimConfig has no field {k!r}")
        kind = type(getattr(SimConfig(), k))
        if kind is bool and v.lower() not in ("true", "false"):
            raise SystemExit(f"--set {kv}: {k} is true or false")
        try:
            out[k] = v.lower() == "true" if kind is bool else kind(v)
        except ValueError:
            raise SystemExit(f"--set {kv}: {k} expects a {kind.__name__}") from None
    return out


def _table(calib: dict, overrides: dict, actors: list[int], learners: list[int], stale: list[int],
           modes: list[str]) -> list[dict]:
    rows = []
    combos = [(a, m, l, s) for a in actors for l in learners for m in modes for s in (stale if m == "async" else [0])]
    for i, (a, mode, lrn, s) in enumerate(combos):
        sys.stderr.write(f"\r\033[Ksimulating {i + 1}/{len(combos)}: {a} actors, {lrn} learners, {mode} s={s}")
        sys.stderr.flush()
        c = SimConfig(**{**calibration_for(calib, lrn), **overrides, "actors": a, "learners": lrn, "mode": mode,
                         "max_staleness": s})
        r = simulate(c)
        rows.append({"actors": a, "learners": lrn, "mode": mode, "s": s, "samples_per_s": r.samples_per_s,
                     "learner_idle": r.learner_idle, "actor_idle": r.actor_idle, "dropped": r.dropped_frac,
                     "staleness": r.staleness_fractions()})
    sys.stderr.write("\r\033[K")
    return rows


def _row_line(r: dict) -> str:
    """One validation row as a markdown table line (staleness histograms cut after their last real bin)."""
    ms, ps = r["measured_staleness"], r["predicted_staleness"]
    last = max((k for k, (x, y) in enumerate(zip(ms, ps)) if max(x, y) >= STALENESS_SHOWN), default=0)
    def fm(xs):  # a long histogram (s=1000) as its mean
        return " ".join(f"{x:.2f}" for x in xs[:last + 1]) if last < STALENESS_BINS_SHOWN else \
            f"mean {sum(k * x for k, x in enumerate(xs)):.1f}"
    me, pe = r.get("measured_engine") or {}, r.get("predicted_engine") or {}
    eng = (f"{me['step_ms']:.1f} / {pe['step_ms']:.1f} ms, {me['leased_inflight']:.0f} / {pe['leased_inflight']:.0f}"
           + (f" ({me['running']:.0f} / {pe['running']:.0f} running)" if "running" in me and "running" in pe else "")
           if me and not math.isnan(pe.get("step_ms", math.nan)) else "-")
    mt, pt = r.get("measured_trained_share"), r.get("predicted_trained_share", math.nan)
    share = f"{mt:.2f} / {pt:.2f}" if mt is not None and not math.isnan(pt) else "-"
    return (f"| {Path(r['run']).name} | {r['actors']}/{r['learners']} | {r['s']} | {r['measured']:.0f} | "
            f"{r['predicted']:.0f} | {100 * r['error']:+.1f}% | {100 * r['measured_dropped']:.0f}% / "
            f"{100 * r['predicted_dropped']:.0f}% | {eng} | {share} | {fm(ms)} | {fm(ps)} |")


def _rounded(fields: dict) -> str:
    return json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in fields.items()})


def _report_validation(rows: list[dict], out, plot_name: str, calib: dict | None = None) -> None:
    """The validation table on stdout (a leave-one-setting-out row also names its calibration runs, and its
    calibration is printed above it); rows, calibration and plot under `out`."""
    for r in rows:
        if "calibrated_on" in r:
            print(f"{Path(r['run']).name}: calibrated on {' '.join(r['calibrated_on'])}"
                  + (f" ({r['note']})" if r["note"] else "") + ": " + _rounded(r["calibration"]))
    print("| run | actors/learners | s | measured samples/s | simulated | error | groups dropped measured / "
          "simulated | engine step, leased seqs measured / simulated | trained share of generated tokens measured / "
          "simulated | staleness measured | simulated |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(_row_line(r))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "validation.json").write_text(json.dumps({"calibration": calib, "rows": rows}, indent=1))
        plot_validation(rows, Path(out) / plot_name)
