"""A sweep's runs, one after the other: each its own process tree, run directory and run id, watched with a
progress line until it ends (trainer.total_steps, or --run-seconds after its first step), its record written
when it finished; --resume keeps the finished ones."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster.rundir import write_whole
from experiments.sweep.analysis import trained_share
from experiments.sweep.config import SEED_STRIDE, Setting, SweepConfig, fmt_s, run_name, settings
from learner import metric_names as M

POLL_S = 1.0             # progress refresh while a run is going
RUN_TIMEOUT_S = 1800     # one run of the sweep; a hung run fails the sweep instead of blocking it
PRINT_S = 10.0           # progress line interval into a log (not a terminal): a readable log of a long run
STOP_GRACE_S = 60.0      # a run stopped by the clock exits cleanly within this (actors drain, learner closes)
START_ALLOWANCE_S = 120.0  # launch to first step of a GPU run (vLLM start, CUDA graphs): 41-122 s measured
RECORD = "record.json"   # in a run's directory once it finished: --resume keeps that run
RECORD_KEYS = {"setting", "max_staleness", "correction", "mode", "seed", "run_wall_s"}  # what the results read


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
        if diff:  # overrides may name paths that move between machines (bench/gpu_staleness.sh): said, not refused
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
            print(f"budget: {left} run(s) left (~{fmt_s(est)} each, {fmt_s(cfg.budget_s)} budget); "
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
    show(f"{tag} {st.label} seed {seed}: {len(ms)} steps in {fmt_s(time.monotonic() - t0)}"
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
                 + f" | run {fmt_s(now - t0)}" + _eta(eta, now - t0))
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
        return f" | sweep {fmt_s(done)}"
    per_run = (done - run_s) / ran
    return f" | sweep {fmt_s(done)} | ~{fmt_s(max(per_run * left - run_s, 0))} left"


def show(line: str, end: bool = False) -> None:
    """A progress line: rewritten in place on a terminal, printed every PRINT_S into a log."""
    if sys.stdout.isatty():
        sys.stdout.write("\r\033[K" + line + ("\n" if end else ""))
        sys.stdout.flush()
    else:
        print(line, flush=True)
