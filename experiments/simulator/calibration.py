"""Simulator inputs (SimConfig fields) from measured runs: CPU runs (`calibrate`: a synchronous run and s=0 runs of
`cluster.start` with their cpu.jsonl) and GPU runs with streaming vLLM actors (`calibrate_gpu`); a measured run's
prediction from a calibration (`predict`)."""
from __future__ import annotations

import math
import statistics

from cluster import cpu as cpu_log
from experiments.simulator.config import WARMUP_STEPS, SimConfig, SimResult
from experiments.simulator.lengths import group_share, response_workload, sigma_for_ratio
from experiments.simulator.model import simulate
from experiments.simulator.runs import (LEN_WINDOW, actor_loop_s, heartbeats, measured, measured_slot_use, run_config,
                                        run_metrics, steady)
from learner import metric_names as M

# Async tails searched from as light as the lossless runs' (1) to three times their excess over the mean; a
# bisection of TAIL_FIT_ITERS halvings finds the factor to ~0.03, which moves a prediction by ~1%.
TAIL_FACTOR_RANGE = (1.0, 3.0)
TAIL_FIT_ITERS = 6
ENGINE_FITS = ("line", "curve")   # the engine step in the leased sequences: engine_line, or engine_curve
MIN_LEASED_SPREAD = 20   # sequences: heartbeats closer together than this cannot tell a slope from noise


def fit_line(xs, ys) -> tuple[float, float]:
    """Least-squares y = a + b x; with no spread in x, the whole cost is proportional (a = 0)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx < 1e-9 * max(len(xs), 1):
        return 0.0, my / mx
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if b < 0:  # noise can tilt it; a negative per-step cost means nothing
        return 0.0, my / mx
    return my - b * mx, b


def calibrate(sync_run, s0_runs=()) -> dict:
    """Simulator inputs (SimConfig fields) from measured runs.

    `sync_run`: an `experiments.sync` run dir, one process alone on the machine: generation cost per
    generate call and per decode step (fitted over its batches), and the learner's cost per sample.

    `s0_runs`: `cluster.start buffer.max_staleness=0` run dirs (with their `cpu.jsonl`, see
    cluster/cpu.py), at most one per learner count. Their steps alternate, so each process's CPU per
    step is its work, undisturbed by overlap: the learner ranks' CPU per step beyond the per-sample
    cost is their fixed cost per step (with more than one rank, the excess over one rank is the
    communication cost); the actors' CPU beyond generation is charged per version (weight receive
    and apply, idle polls: it does not grow with batches); ingest and Redis CPU per batch; the
    launcher's and Ray's CPU a constant load; the learner's turn (step time minus its `perf/wait_s`)
    beyond its CPU is latency that takes no core. The machine's core count comes from cpu.jsonl.

    Returns {"base": fields shared by all, "by_learners": {R: fields measured with R ranks}}.
    """

    base, gen_fit = _calibrate_sync(sync_run)
    by_learners: dict[int, dict] = {}
    one_rank_fixed = None
    for run in sorted(s0_runs, key=lambda r: run_config(r)["cluster"]["learners"]):
        R = run_config(run)["cluster"]["learners"]
        if R in by_learners:
            raise ValueError(f"{run}: a second s=0 run with {R} learners")
        fields, rank_work = _calibrate_s0(run, base, gen_fit)
        if one_rank_fixed is None:
            one_rank_fixed = max(rank_work, 0.0)
        fields["train_step_s"] = one_rank_fixed
        fields["learner_comm_s"] = max(rank_work - one_rank_fixed, 0.0) if R > 1 else 0.0
        by_learners[R] = fields
    return {"base": base, "by_learners": by_learners}


def _calibrate_sync(sync_run) -> tuple[dict, tuple[float, float, float]]:
    """The fields one synchronous run measures, and its fit (per call, per decode step, samples per step)."""
    ms = steady(run_metrics(sync_run), sync_run)
    cfg = run_config(sync_run)
    batches = [b for m in ms for b in m[M.GEN_BATCHES]]
    a, b = fit_line([x[1] for x in batches], [x[0] for x in batches])
    samples = statistics.median(m[M.SAMPLES] for m in ms)
    base = {"gen_batch_s": a, "gen_step_s": b, "gen_step_row_s": 0.0,
            "len_mean": statistics.fmean(x[1] for x in batches), "len_sigma": 0.0,
            "max_tokens": cfg["actors"]["max_tokens"], "train_sample_s": statistics.median(m[M.TRAIN_S] for m in ms) / samples,
            "load_s": statistics.median(m[M.WS_PUBLISH_S] for m in ms),
            "groups_per_step": cfg["learner"]["groups_per_step"], "n": cfg["actors"]["n"],
            "groups_per_batch": cfg["actors"]["groups_per_batch"]}
    return base, (a, b, samples)


def _calibrate_s0(run, base: dict, gen_fit: tuple[float, float, float]) -> tuple[dict, float]:
    """The fields one s=0 run measures (see calibrate), and its learner ranks' work per step beyond the
    per-sample cost and the publication."""
    a, b, samples = gen_fit
    c0 = run_config(run)
    if c0["buffer"]["max_staleness"] != 0:
        raise ValueError(f"{run}: calibration needs max_staleness=0 runs (steps alternate)")
    R, A = c0["cluster"]["learners"], c0["cluster"]["actors"]
    m0 = steady(run_metrics(run), run)
    lines = cpu_log.read(run)
    used, wall = cpu_log.used_between(lines, m0[0][M.TIME], m0[-1][M.TIME])
    steps = wall / statistics.fmean(q[M.TIME] - p[M.TIME] for p, q in zip(m0, m0[1:]))
    per_step = {role: c / steps for role, c in used.items()}
    ranks = [per_step.get(f"learner-{r}", 0.0) for r in range(R)]
    actors = [per_step.get(f"actor-{i}", 0.0) for i in range(A)]
    batches_per_step = math.ceil(base["groups_per_step"] / base["groups_per_batch"])
    publish = statistics.median(m.get(M.WS_PUBLISH_S, 0.0) for m in m0)
    rank_work = statistics.fmean(ranks) - base["train_sample_s"] * samples / R - publish
    latency = statistics.median(q[M.TIME] - p[M.TIME] - q[M.WAIT_S] for p, q in zip(m0, m0[1:])) - ranks[0]
    fields = {"cores": lines[-1]["cores"], "publish_s": publish,
              "load_s": max(statistics.fmean(actors) - (a + b * base["len_mean"]) * batches_per_step / A, 0.0),
              "actor_batch_overhead_s": 0.0,
              "system_batch_s": (per_step.get("ingest", 0.0) + per_step.get("redis", 0.0)) / batches_per_step,
              "background_cores": sum(used.get(k, 0.0) for k in ("launcher", "other")) / wall,
              "learner_latency_s": max(latency, 0.0)}
    return fields, rank_work


def calibrate_gpu(s0_runs, async_runs=(), engine_fit: str = "line") -> dict:
    """SimConfig fields for streaming vLLM actors beside the learner on one GPU, from lockstep runs of
    `cluster.start` (max_staleness=0, actors.engine=vllm): each step there generates its groups from idle
    weights-current engines and ends when the longest sample ends, so the learner's wait is a line in the
    step's longest response (per engine step, and per step: the new weights reaching the actors, prefill,
    ingest); the publication's end-to-end time is the lag of the weights behind the version; the learner's
    turn (its step less its wait and publication) and its publication are taken as they are; response lengths
    are log-normal with the runs' mean and a sigma that gives their ratio of longest to mean response per step.
    The engine's step is a line in the leased sequences in flight (engine_line), fitted to the actors'
    heartbeats of every calibration run: lockstep runs hold ~50, an async run (`async_runs`, s >= 1) more,
    with the learner training beside it; the async runs also give the learner's slow-down (its step there
    against lockstep's). With `engine_fit="curve"` the step is engine_curve instead (gen_step_curve: piecewise
    linear through the heartbeats, monotone), which bends where runs in the mid-range show it does. A run used
    here predicts nothing (validate, validate_loo)."""
    if engine_fit not in ENGINE_FITS:
        raise ValueError(f"engine_fit must be one of {ENGINE_FITS}, not {engine_fit!r}")
    pts, train, publish, lag, ms = [], [], [], [], []
    for run in s0_runs:
        cfg = run_config(run)
        if cfg["buffer"]["max_staleness"] != 0 or cfg["actors"]["engine"] != "vllm":
            raise ValueError(f"{run}: GPU calibration needs max_staleness=0 runs with actors.engine=vllm")
        steps = run_metrics(run)
        ms += steady(steps, run)
        train += [b[M.TIME] - a[M.TIME] - b[M.WAIT_S] - b.get(M.PUBLISH_S, 0.0) for a, b in zip(steps, steps[1:])][1:-1]
    for m in ms:
        pts.append((m[M.RESPONSE_LEN_MAX], m[M.WAIT_S]))
        publish.append(m.get(M.PUBLISH_S, 0.0))
        lag.append(m.get(M.WS_PUBLISH_S, 0.0))
    a, b = fit_line([x for x, _ in pts], [y for _, y in pts])
    lag_s = statistics.median(lag)
    step_s, seq_s = engine_line([*s0_runs, *async_runs], b)
    load_s = min(actor_loop_s([*s0_runs, *async_runs]), max(a - lag_s - b, 0.0))
    fields = {"actor_mode": "stream", "inflight_seqs": cfg["actors"]["max_inflight_seqs"], "cores": math.inf,
            # the step's fixed part is the weights' lag, the actor's swap, the new prompts' prefill (about one more
            # engine step: it rides on a decode step) and the group's way to the learner, which takes no engine time
            "gen_step_s": step_s, "gen_step_seq_s": seq_s, "gen_batch_s": min(b, max(a - lag_s, 0.0)),
            "delivery_s": max(a - lag_s - b - load_s, 0.0), "gen_step_row_s": 0.0, "weights_lag_s": lag_s,
            "load_s": load_s,
            "train_step_s": statistics.median(train), "train_sample_s": 0.0, "publish_s": statistics.median(publish),
            "groups_per_step": cfg["learner"]["groups_per_step"], "n": cfg["actors"]["n"],
            "groups_per_batch": cfg["actors"]["groups_per_batch"], "max_tokens": cfg["actors"]["max_tokens"],
            **_length_fields([*s0_runs, *async_runs], ms, cfg["learner"]["groups_per_step"], cfg["actors"]["n"],
                             cfg["actors"]["max_tokens"])}
    if engine_fit == "curve":
        fields["gen_step_curve"] = engine_curve([*s0_runs, *async_runs], b)
    if async_runs:
        lockstep = statistics.median(m[M.TRAIN_S] for m in ms)
        overlapped = statistics.median(m[M.TRAIN_S] for run in async_runs for m in steady(run_metrics(run), run))
        fields["learner_contention"] = max(overlapped / lockstep - 1, 0.0)
        if seq_s == 0:   # runs from before the heartbeat's counters: what sharing costs the engine, as a factor
            fields["actor_contention"] = _fit_actor_contention(fields, [measured(run) for run in async_runs])
    return fields


def _length_fields(runs, ms: list[dict], groups: int, n: int, cap: int) -> dict:
    """len_mean, len_sigma (the lockstep steps `ms`) and len_group_share: how much of the spread is a prompt's,
    from the runs that lost no group (their engines generated only what was trained), through the tokens per
    leased sequence-step their heartbeats measured (none: independent samples)."""
    lossless = [(m, measured_slot_use(r)) for r, m in zip(runs, map(measured, runs)) if m["dropped_frac"] == 0]
    lossless = [(m, u) for m, u in lossless if u and m["length_schedule"]]
    share = 0.0
    if lossless:
        share = group_share(tuple(w for m, _u in lossless for w in m["length_schedule"]),
                            statistics.fmean(u for _m, u in lossless), groups, n, cap)
    return {**response_workload(ms, groups, n, cap, share), "len_group_share": share}


def _fit_actor_contention(fields: dict, runs: list[dict], top: float = 4.0) -> float:
    """The engines' slow-down under a training learner that makes the simulated samples/s of `runs` (measured
    dicts) average their measured ones; 0 or `top` when even those bounds miss (runs without heartbeats only:
    with them the engine line replaces this factor)."""
    target = statistics.fmean(m["samples_per_s"] for m in runs)

    def rate(k: float) -> float:
        return statistics.fmean(predict({"base": {**fields, "actor_contention": k}, "by_learners": {}}, m).samples_per_s
                                for m in runs)

    lo, hi = 0.0, top
    if rate(lo) <= target:
        return lo
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) > target else (lo, mid)
    return (lo + hi) / 2


def engine_line(runs, lockstep_step_s: float) -> tuple[float, float]:
    """(fixed, per leased sequence) seconds of an engine step: the line through the actors' heartbeats of
    `runs` (mean step against mean leased sequences in flight). Without heartbeats that spread over
    MIN_LEASED_SPREAD sequences, the step is the lockstep fit's per-step cost, whatever is in flight."""
    pts = [(e["leased_inflight"], e["step_ms"] / 1e3) for run in runs for e in heartbeats(run).values()]
    if len(pts) < 2 or max(x for x, _ in pts) - min(x for x, _ in pts) < MIN_LEASED_SPREAD:
        return lockstep_step_s, 0.0
    return fit_line([x for x, _ in pts], [y for _, y in pts])


def engine_curve(runs, lockstep_step_s: float) -> tuple:
    """gen_step_curve: knots (leased, seconds) of a non-decreasing engine step through the actors' heartbeats of
    `runs` (mean step against mean leased sequences; monotone_knots); without heartbeats, the lockstep step, flat."""
    pts = [(e["leased_inflight"], e["step_ms"] / 1e3) for run in runs for e in heartbeats(run).values()]
    return monotone_knots(pts) if pts else ((0.0, lockstep_step_s),)


def monotone_knots(points, min_spread: float = MIN_LEASED_SPREAD) -> tuple:
    """Knots of a non-decreasing curve through (x, y) points: sorted by x, adjacent points pooled into their mean
    (x, y) while a later one lies below an earlier one (pool-adjacent-violators: the least-squares monotone fit) or
    closer than `min_spread` in x (their difference is noise, not a slope)."""
    blocks: list[list[float]] = []   # [sum x, sum y, points]
    for x, y in sorted(points):
        blocks.append([x, y, 1])
        while len(blocks) > 1:
            (xa, ya, na), (xb, yb, nb) = blocks[-2], blocks[-1]
            if ya / na <= yb / nb and xb / nb - xa / na >= min_spread:
                break
            blocks[-2:] = [[xa + xb, ya + yb, na + nb]]
    return tuple((sx / k, sy / k) for sx, sy, k in blocks)


def calibration_for(calib: dict, learners: int) -> dict:
    """SimConfig fields for a system with `learners` ranks: those measured with that many, else with
    the nearest count below (or the fewest): say which in the validation rows."""
    by = calib["by_learners"]
    if not by:
        return dict(calib["base"])
    below = [r for r in by if r <= learners]
    return {**calib["base"], **by[max(below) if below else min(by)]}


def predict(calib: dict, m: dict) -> SimResult:
    fields = calibration_for(calib, m["learners"])
    if fields.get("actor_mode") == "stream":   # GPU calibration: costs from the s=0 runs, the run's own lengths
        G, n, cap = fields["groups_per_step"], fields["n"], fields["max_tokens"]
        own = [rw for _mw, rw in m["length_schedule"]]
        if m["max_staleness"] == 0:   # lockstep: every step waits for its longest sample, and nothing was dropped,
            spread = own              # so the run's own longest-to-mean ratio is its workload, measured exactly
        else:   # async: its own is short of what it generated (drops take the longest); the lossless runs' tails,
            # widened by what async policies generate beyond them (fit_tail_factor)
            spread = [1 + (x - 1) * calib.get("tail_factor", 1.0) for x in calib.get("len_ratios") or own]
        fields.update(len_window=LEN_WINDOW,   # (the schedule replaces len_mean and len_sigma)
                      len_schedule=tuple((mw, sigma_for_ratio(round(spread[min(w, len(spread) - 1)], 2), G, n,
                                                               round(mw, 1), cap, fields.get("len_group_share", 0.0)))
                                         for w, (mw, _rw) in enumerate(m["length_schedule"])))
    return simulate(SimConfig(**{**fields, "actors": m["actors"], "learners": m["learners"], "mode": "async",
                                 "max_staleness": m["max_staleness"], "steps": max(m["steps"], WARMUP_STEPS + 2),
                                 "admission": m["admission"], "abort_stale": m["abort_stale"],
                                 **({"inflight_seqs": m["inflight_seqs"], "inflight_count": m["inflight_count"]}
                                    if fields.get("actor_mode") == "stream" else {})}))


def fit_tail_factor(calib: dict, runs) -> float:
    """How much heavier than the lossless runs' (`len_ratios`) async runs' generated tails are: the factor on the
    longest-to-mean ratio's excess over 1 at which the simulated trained share of generated tokens of `runs` (the
    async ones that measured it: their rows and their trained tokens) matches theirs on average. A run with drops
    trains without its longest groups, so what it generated is seen only in what it wasted. 1 where no run
    measured it."""
    got = [(m, m["trained_share"]) for m in map(measured, runs)
           if m["max_staleness"] > 0 and m["trained_share"] is not None and m["length_schedule"]]
    if not got:
        return 1.0

    def gap(f: float) -> float:   # simulated minus measured share: falls as the tails widen
        return statistics.fmean(predict({**calib, "tail_factor": f}, m).trained_share - share for m, share in got)

    lo, hi = TAIL_FACTOR_RANGE
    if gap(lo) <= 0:   # each gap is a simulation of every run: no bound is tried twice
        return lo
    if gap(hi) >= 0:
        return hi
    for _ in range(TAIL_FIT_ITERS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return (lo + hi) / 2
