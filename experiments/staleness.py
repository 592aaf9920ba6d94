"""python -m experiments.staleness [--config F] [--max-staleness 0 1 2 4 8] [--corrections ppo_clip ...]
                                 [--seeds 3] [--sync] [--steps N] [--actors N] [--learners M]
                                 [--out DIR] [--resume] [--budget-s S] [--run-seconds S]
                                 [section.key=value ...]

Off-policy staleness sweep: runs the same job once per (max_staleness, correction, seed), plus the
synchronous baseline (`--sync`, `experiments.sync`) per seed, one after the other (each its own
process tree, run directory and run id, so runs never share CPU or Redis keys), with a live
progress line. Then writes DIR/results.parquet (one row per learner step of every run), PNG plots
and DIR/summary.md. Run directories land in DIR/runs/.

On a lent GPU, where one call lasts minutes: `--run-seconds` stops each run by wall clock after its
first step (runs compare over equal training time), `--budget-s` starts no run that would outlast the
call, and `--resume` keeps the runs that finished before (DIR/runs/*/record.json) and runs the rest;
exit status 3 says runs are left. bench/gpu_staleness.sh drives it on the H200.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.rundir import write_whole
from learner import metric_names as M
from learner.config import LearnerConfig

POLL_S = 1.0             # progress refresh while a run is going
RUN_TIMEOUT_S = 1800     # one run of the sweep; a hung run fails the sweep instead of blocking it
SEED_STRIDE = 1000       # actor i of seed k samples with seed k*SEED_STRIDE + i: streams never overlap
TAIL_FRACTION = 0.1      # "final training reward" = mean over the last 10% of steps (one step is noise)
PRINT_S = 10.0           # progress line interval into a log (not a terminal): a readable log of a long run
STOP_GRACE_S = 60.0      # a run stopped by the clock exits cleanly within this (actors drain, learner closes)
START_ALLOWANCE_S = 120.0  # launch to first step of a GPU run (vLLM start, CUDA graphs): 41-122 s measured
RECORD = "record.json"   # in a run's directory once it finished: --resume keeps that run
RECORD_KEYS = {"setting", "max_staleness", "correction", "mode", "seed", "run_wall_s"}  # what the results read
DEFAULT_CORRECTION = LearnerConfig.correction  # its runs are named by bound alone (s=4), the others s=4 tis
EXIT_MORE = 3            # main's exit status when the budget left runs for the next call (--resume)
EXIT_INT, EXIT_TERM = 130, 143  # Ctrl-C, SIGTERM: the shell's codes (128 + signal), as cluster.start's


@dataclass(kw_only=True)
class SweepConfig:
    """One staleness sweep."""
    max_staleness: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8])
    """Values of buffer.max_staleness to run (async)."""
    corrections: list[str] = field(default_factory=lambda: ["ppo_clip"])
    """learner.correction values; every one is run at every max_staleness."""
    seeds: int = 3
    """Seeds per setting (learner.seed = k, actors.seed = k * SEED_STRIDE)."""
    sync: bool = False
    """Also run the synchronous baseline (experiments.sync) per seed; speed-ups are relative to it."""
    steps: int = 0
    """trainer.total_steps for every run (0 = the config's own)."""
    config: str | None = None
    """YAML merged over configs/default.yaml, for every run."""
    actors: int = 0
    """cluster.actors (0 = the config's own)."""
    learners: int = 0
    """cluster.learners (0 = the config's own)."""
    overrides: list[str] = field(default_factory=list)
    """Dotted overrides passed to every run."""
    out: str = ""
    """Output directory (empty = runs/staleness-<time>)."""
    resume: bool = False
    """Keep the runs in OUT/runs that finished before (their record.json) and run only the rest: a sweep
    longer than one device call goes on over several calls and sessions."""
    budget_s: float = 0.0
    """Start no run that would end past this many seconds of this call (its estimate: the longest run so
    far, else run_seconds plus a start-up allowance); what is left runs with --resume. 0 = no budget."""
    run_seconds: float = 0.0
    """Stop each run this many seconds after its first trained step (SIGINT: every step's metrics line is
    kept), so runs are compared over equal training time; 0 = each runs to trainer.total_steps."""
    report: bool = False
    """Run nothing: write the parquet, plots and summary of every finished run in OUT/runs, whatever call
    and settings ran it (a sweep's bounds and its corrections at one bound, run as separate calls, in one table)."""

    def __post_init__(self):
        from learner.losses import CORRECTIONS  # lazy: imports torch

        if not self.max_staleness and not self.sync:
            raise ValueError("--max-staleness: nothing to run (give values, or --sync)")
        if any(s < 0 for s in self.max_staleness):
            raise ValueError("--max-staleness: values must be >= 0")
        # a value given twice would run the same (setting, seed) twice into one run directory (the second
        # deletes the first) and count it as two seeds in the summary
        for flag, vals in (("--max-staleness", self.max_staleness), ("--corrections", self.corrections)):
            if dup := sorted({v for v in vals if vals.count(v) > 1}, key=str):
                raise ValueError(f"{flag}: {dup} given more than once (each setting runs once per seed; "
                                 "use --seeds for repeats)")
        if bad := [c for c in self.corrections if c not in CORRECTIONS]:
            raise ValueError(f"--corrections: unknown {bad}; choose from {list(CORRECTIONS)}")
        if self.seeds < 1:
            raise ValueError("--seeds: must be >= 1")
        if self.steps and self.steps < 4:
            raise ValueError("--steps: at least 4 (throughput leaves out the first and the last step)")
        if self.actors < 0 or self.learners < 0:
            raise ValueError("--actors, --learners: must be >= 0 (0 = the config's)")
        if self.budget_s < 0 or self.run_seconds < 0:
            raise ValueError("--budget-s, --run-seconds: must be >= 0 (0 = none)")
        if (self.resume or self.report) and not self.out:
            raise ValueError("--resume, --report: give the --out of the sweep")


@dataclass(kw_only=True)
class Setting:
    label: str
    max_staleness: int
    correction: str
    mode: str  # async | sync


def settings(cfg: SweepConfig) -> list[Setting]:
    # one name per (bound, correction), however many corrections a call asks for: --resume finds a run by
    # its name, so `--corrections decoupled` alone must not be named like (and kept for) the default's run
    out = [Setting(label=f"s={s}" + (f" {c}" if c != DEFAULT_CORRECTION else ""), max_staleness=s, correction=c,
                   mode="async") for c in cfg.corrections for s in cfg.max_staleness]
    if cfg.sync:  # on-policy: every correction is the same gradient there (tests/unit/test_corrections.py)
        out.insert(0, Setting(label="sync", max_staleness=0, correction=cfg.corrections[0], mode="sync"))
    return out


def command(cfg: SweepConfig, st: Setting, seed: int, run_dir: Path, run_id: str) -> list[str]:
    module = "experiments.sync" if st.mode == "sync" else "cluster.start"
    cmd = [sys.executable, "-m", module, "--run-dir", str(run_dir)]
    if cfg.config:
        cmd += ["--config", cfg.config]
    if cfg.actors:
        cmd += ["--actors", str(cfg.actors)]
    if cfg.learners and st.mode == "async":
        cmd += ["--learners", str(cfg.learners)]
    cmd += [f"cluster.run_id={run_id}", f"buffer.max_staleness={st.max_staleness}",
            f"learner.correction={st.correction}", f"learner.seed={seed}", f"actors.seed={seed * SEED_STRIDE}"]
    if cfg.steps:
        cmd.append(f"trainer.total_steps={cfg.steps}")
    return cmd + list(cfg.overrides)


def progress_of(run_dir: Path) -> tuple[int, float | None]:
    """(complete steps, last reward) of a running job: counts lines and parses only the last one,
    so polling a long run does not re-parse every step's metrics each time."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0, None
    lines = path.read_text().splitlines()
    for k in range(len(lines), 0, -1):
        try:
            return k, M.upgrade(json.loads(lines[k - 1]))[M.REWARD_MEAN]
        except json.JSONDecodeError:  # a line being written right now
            continue
    return 0, None


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return M.read_metrics(path) if path.exists() else []


def _fmt_s(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def run_name(st: Setting, seed: int) -> str:
    return st.label.replace("=", "").replace(" ", "-") + f"-seed{seed}"


def load_finished(run_dir: Path) -> dict | None:
    """A finished run's record (record.json, written after it exited cleanly) with its metrics; None if the
    run never finished (absent, failed or cut off: its directory is run again from scratch)."""
    path = run_dir / RECORD
    if not path.exists():
        return None
    try:
        rec = json.loads(path.read_text())
    except ValueError as e:  # cut off while written (a kill, a full disk), edited by hand: the run is not kept
        rec = e
    if not isinstance(rec, dict) or not RECORD_KEYS <= rec.keys():
        rec = rec if not isinstance(rec, dict) else f"no {sorted(RECORD_KEYS - rec.keys())}"
        print(f"note: {path} is not a run record ({rec}): {run_dir.name} is taken as unfinished (--resume runs it "
              "again)", file=sys.stderr)
        return None
    rec["metrics"] = read_metrics(run_dir)
    rec["trained_share"] = trained_share(run_dir, rec["metrics"])
    return rec if rec["metrics"] else None


def run_args(cfg: SweepConfig) -> dict:
    """What a call gives every run besides its setting and seed (recorded with each run, checked by --resume)."""
    return {"config": cfg.config, "steps": cfg.steps, "actors": cfg.actors, "learners": cfg.learners,
            "run_seconds": cfg.run_seconds, "overrides": list(cfg.overrides)}


def check_kept(rec: dict, st: Setting, seed: int, run_dir: Path, cfg: SweepConfig | None = None) -> None:
    """A finished run kept by --resume must be the one asked for (a folder from an older naming, or edited
    by hand, could hold another correction or bound under the same name; an earlier call could have run it
    with other --steps, --actors, --learners or overrides, which this summary would mix in silently): refused,
    naming both. Records from before the arguments were kept (no `args`) are checked on the setting alone."""
    want = {"max_staleness": st.max_staleness, "correction": st.correction, "mode": st.mode, "seed": seed}
    have = {k: rec.get(k) for k in want}
    if have != want:
        raise ValueError(f"--resume: {run_dir} holds a finished run of {have}, not the {want} this sweep names "
                         "so; move it away (or use another --out)")
    if cfg is not None and isinstance(rec.get("args"), dict):
        diff = {k: (rec["args"].get(k), v) for k, v in run_args(cfg).items() if rec["args"].get(k) != v}
        said = ", ".join(f"{'--' + k.replace('_', '-') if k != 'overrides' else k}={a!r} (this call: {b!r})"
                         for k, (a, b) in diff.items())
        if set(diff) - {"overrides"}:
            raise ValueError(f"--resume: {run_dir} was run with {said}; give the sweep's first arguments again, or "
                             "use another --out (--report summarises runs of different calls)")
        if diff:  # overrides may name paths that move between sessions (bench/gpu_staleness.sh): said, not refused
            print(f"note: --resume keeps {run_dir}, run with {said}", file=sys.stderr)


def load_all(out: Path) -> list[dict]:
    """Every finished run in OUT/runs (`--report`): the synchronous runs, then the default correction's
    settings (labelled `s=N`) by bound, then the other corrections' (`s=N correction`), seeds in order."""
    recs = [r for d in sorted((out / "runs").glob("*/")) if (r := load_finished(d)) is not None]
    return sorted(recs, key=lambda r: (r["mode"] != "sync", " " in r["setting"], r["correction"],
                                       r["max_staleness"], r["seed"]))


def estimate_s(cfg: SweepConfig, walls: list[float]) -> float | None:
    """What the next run will take: the longest finished run of this sweep, else the wall-clock cap plus a
    start-up allowance; None when nothing is known yet (the first run of a step-bounded sweep)."""
    if walls:
        return max(walls)
    return cfg.run_seconds + START_ALLOWANCE_S if cfg.run_seconds else None


def run_all(cfg: SweepConfig, out: Path, t_start: float) -> tuple[list[dict], int]:
    """Every (setting, seed), one at a time, with a progress line. Returns one record per finished run and
    how many runs are left (the budget stopped the sweep before them; --resume runs them next time)."""
    jobs = [(st, seed) for st in settings(cfg) for seed in range(cfg.seeds)]
    # --resume: the finished runs, each read once and checked before anything runs (a kept run of another
    # setting stops the sweep here)
    kept = {i: rec for i, (st, seed) in enumerate(jobs) if cfg.resume
            and (rec := load_finished(out / "runs" / run_name(st, seed))) is not None}
    for i, rec in kept.items():
        check_kept(rec, *jobs[i], out / "runs" / run_name(*jobs[i]), cfg)
    records, walls = [], []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i, (st, seed) in enumerate(jobs):
        name = run_name(st, seed)
        run_dir = out / "runs" / name
        if (rec := kept.get(i)) is not None:
            print(f"[{i + 1}/{len(jobs)}] {st.label} seed {seed}: finished before, kept", flush=True)
            records.append(rec)
            continue
        est = estimate_s(cfg, walls)
        if cfg.budget_s and est is not None and time.monotonic() - t_start + est > cfg.budget_s:
            left = len(jobs) - i
            print(f"budget: {left} run(s) left (~{_fmt_s(est)} each, {_fmt_s(cfg.budget_s)} budget); "
                  "run again with --resume", flush=True)
            return records, left
        if run_dir.exists():  # a fresh run: metrics.jsonl is appended to, never mixed with an old run's
            import shutil

            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        rec = run_one(cfg, st, seed, run_dir, f"sweep-{stamp}-{os.getpid()}-{name}",
                      f"[{i + 1}/{len(jobs)}]", eta=(t_start, len(walls), len(jobs) - i))
        walls.append(rec["run_wall_s"])
        records.append(rec)
    return records, 0


def run_one(cfg: SweepConfig, st: Setting, seed: int, run_dir: Path, run_id: str, tag: str, eta) -> dict:
    """One run to its end (trainer.total_steps, or --run-seconds after its first step: SIGINT, which stops
    every process cleanly with each step's metrics line on disk); writes and returns its record."""
    cmd = command(cfg, st, seed, run_dir, run_id)
    t0, launched = time.monotonic(), time.time()
    with open(run_dir / "stdout.log", "w") as log:
        # its own session: a Ctrl-C in the terminal reaches the sweep, which stops the run (watch's caller)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            stopped = watch(cfg, proc, run_dir, f"{tag} {st.label} seed {seed}", eta, t0)
        except BaseException:  # Ctrl-C, SIGTERM (main raises SystemExit), the timeout: the run stops too
            stop(proc)
            raise
    if proc.returncode != 0 and not stopped:
        tail = (run_dir / "stdout.log").read_text()[-3000:]
        raise RuntimeError(f"{run_dir.name} exited {proc.returncode} (log: {run_dir}/stdout.log)\n{tail}")
    ms = read_metrics(run_dir)
    if not ms:
        raise RuntimeError(f"{run_dir.name} trained no step (log: {run_dir}/stdout.log)")
    show(f"{tag} {st.label} seed {seed}: {len(ms)} steps in {_fmt_s(time.monotonic() - t0)}"
         + (" (stopped by the clock)" if stopped else "") + f", reward {ms[-1][M.REWARD_MEAN]:.3f}, held-out "
         f"{ms[0].get(M.VAL_REWARD_INITIAL, float('nan')):.3f} -> {ms[-1].get(M.VAL_REWARD, float('nan')):.3f}",
         end=True)
    rec = {"setting": st.label, "max_staleness": st.max_staleness, "correction": st.correction, "mode": st.mode,
           "seed": seed, "run_dir": str(run_dir), "run_wall_s": time.monotonic() - t0, "launched": launched,
           "stopped_by": "clock" if stopped else "steps", "args": run_args(cfg)}
    write_whole(run_dir / RECORD, json.dumps(rec))   # whole or absent: a cut one would stop --resume and --report
    return {**rec, "metrics": ms, "trained_share": trained_share(run_dir, ms)}


def watch(cfg: SweepConfig, proc, run_dir: Path, label: str, eta, t0: float) -> bool:
    """Show a run's progress until it exits; True if the clock stopped it (--run-seconds after its first step)."""
    first, last_print = None, 0.0
    while proc.poll() is None:
        steps, reward = progress_of(run_dir)
        now = time.monotonic()
        first = first or (now if steps else None)
        if now - t0 > RUN_TIMEOUT_S:  # hung: no grace
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{run_dir.name} did not finish within {RUN_TIMEOUT_S}s (log: {run_dir}/stdout.log)")
        if cfg.run_seconds and first and now - first > cfg.run_seconds:
            stop(proc)
            return True
        if now - last_print > (POLL_S if sys.stdout.isatty() else PRINT_S):
            show(f"{label}: step {steps}" + (f" | reward {reward:.3f}" if steps else " | starting")
                 + f" | run {_fmt_s(now - t0)}" + _eta(eta, now - t0))
            last_print = now
        time.sleep(POLL_S)
    return False


def stop(proc) -> None:
    """SIGINT to the run's process group, as Ctrl-C; SIGKILL if it has not exited in STOP_GRACE_S."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _eta(eta, run_s: float) -> str:
    """The call's time so far and, after a first run in it, its runs' mean times the runs left."""
    t_start, ran, left = eta
    done = time.monotonic() - t_start
    if not ran:
        return f" | sweep {_fmt_s(done)}"
    per_run = (done - run_s) / ran
    return f" | sweep {_fmt_s(done)} | ~{_fmt_s(max(per_run * left - run_s, 0))} left"


def show(line: str, end: bool = False) -> None:
    """A progress line: rewritten in place on a terminal, printed every PRINT_S into a log."""
    if sys.stdout.isatty():
        sys.stdout.write("\r\033[K" + line + ("\n" if end else ""))
        sys.stdout.flush()
    else:
        print(line, flush=True)


# ---- results: pure functions of the per-run records --------------------------------------------

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


def summary_markdown(summary: list[dict], cfg: SweepConfig, wall_s: float, steps: int) -> str:
    """`wall_s`: the runs' own wall time, summed (a resumed sweep's runs come from several calls)."""
    pm = lambda ms, d=3: f"{ms[0]:.{d}f} ± {ms[1]:.{d}f}"  # noqa: E731
    lines = ["# Staleness sweep", "",
             f"{len(summary)} settings x {_seeds(summary, cfg)} seeds, up to {steps} steps each; "
             f"runs' wall time {_fmt_s(wall_s)}. Mean ± std over seeds. Held-out reward: 128 prompts never "
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


def parse_args(argv=None) -> SweepConfig:
    p = argparse.ArgumentParser(prog="python -m experiments.staleness", description=__doc__.split("\n\n")[1])
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
    print(f"sweep {'done' if not left else f'stopped with {left} run(s) left'} in {_fmt_s(time.monotonic() - t0)}: "
          f"{out}/results.parquet, {out}/summary.md, {out}/*.png", flush=True)
    return EXIT_MORE if left else 0


def stop_signals() -> None:
    """SIGTERM unwinds like Ctrl-C, so the running job is stopped (run_one) rather than left behind. SIGINT gets
    Python's handler even where the sweep was started with it ignored (a background job of a non-interactive
    shell): an ignored SIGINT is inherited by every run it starts, and --run-seconds' SIGINT then did nothing
    until the SIGKILL STOP_GRACE_S later (a sync run trained those seconds too)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_TERM))
    signal.signal(signal.SIGINT, signal.default_int_handler)


def write_results(records: list[dict], cfg: SweepConfig, out: Path) -> None:
    """The parquet, the plots and the summary of every finished run (this call's and kept ones)."""
    write_parquet(step_rows(records), out / "results.parquet")
    summary = summarize(records)
    plot(records, summary, out)
    steps = max(len(r["metrics"]) for r in records)
    runs_s = sum(r["run_wall_s"] for r in records)
    (out / "summary.md").write_text(summary_markdown(summary, cfg, runs_s, steps))
    print((out / "summary.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
