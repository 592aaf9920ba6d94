"""The staleness sweep end to end, and s = 0 async == the synchronous baseline (docs/design.md, Staleness).

One small sweep (sync + s=0, one seed, one actor, a few steps) runs once for the module; its two
run directories are compared number for number, and its outputs are checked.

Why one actor: with two, which actor leases which batch is a race, and each actor draws from its
own RNG stream, so the *samples* (not their distribution) would depend on timing. With one actor
the distributed run is deterministic, and every metric that does not measure time must equal the
synchronous run's exactly: the groups (ids, hence prompts), rewards, losses, gradient norms,
clip fractions, behavior-vs-learner mismatch and the held-out reward. Wall-clock metrics
(samples_per_s, wait_s, time) are not compared: two processes' schedules differ by nature.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray_shared

from learner import metric_names as M

STEPS = 4
SWEEP_TIMEOUT_S = 240  # two runs of a few steps: ~40 s idle, generous for a loaded 2-core machine
# Every metric that is a function of the data and the weights, not of the clock.
DETERMINISTIC = [M.STEP, M.VERSION, M.GROUPS_TRAINED, M.REWARD_MEAN, M.STALENESS_HIST, M.DROPPED_STALE, M.SAMPLES,
                 M.RESPONSE_LEN_MEAN, M.LOSS, M.CLIP_FRAC, M.GRAD_NORM, M.MISMATCH_ABS, M.MISMATCH_KL,
                 M.ENGINE_MISMATCH_KL]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """Run over two calls, as on a lent GPU: a 1-second budget lets the first call run only the sync run
    (nothing is known of a run's length before one finished) and leave s=0 (exit 3); --resume keeps the sync
    run and runs s=0. The tests below then see one sweep of both."""
    out = tmp_path_factory.mktemp("sweep")
    cmd = [sys.executable, "-m", "experiments.staleness", "--max-staleness", "0", "--sync", "--seeds", "1",
           "--steps", str(STEPS), "--actors", "1", "--out", str(out), *ray_shared.job_args()]
    first = subprocess.run(cmd + ["--budget-s", "1"], capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    assert first.returncode == 3, f"exit {first.returncode}\n{first.stdout[-3000:]}\n{first.stderr[-3000:]}"
    assert "1 run(s) left" in first.stdout and not (out / "runs" / "s0-seed0").exists(), first.stdout[-2000:]
    kept = (out / "runs" / "sync-seed0" / "metrics.jsonl").read_text()
    res = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert "sync seed 0: finished before, kept" in res.stdout
    assert (out / "runs" / "sync-seed0" / "metrics.jsonl").read_text() == kept  # not run again
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_s0_async_reproduces_sync_exactly(sweep):
    sync, s0 = _metrics(sweep / "runs" / "sync-seed0"), _metrics(sweep / "runs" / "s0-seed0")
    assert len(sync) == len(s0) == STEPS
    for a, b in zip(s0, sync):
        # both writers (learner, experiments.sync) write only names of the table: all namespaced
        assert a.keys() <= M.TABLE.keys() and b.keys() <= M.TABLE.keys(), (a.keys() | b.keys()) - M.TABLE.keys()
        for key in DETERMINISTIC:
            assert a[key] == b[key], (a[M.STEP], key, a[key], b[key])
    # not vacuous: the runs learn (the loss and reward move), and they trained on the expected groups
    assert len({m[M.REWARD_MEAN] for m in sync}) > 1 and len({m[M.GRAD_NORM] for m in sync}) == STEPS
    assert sync[1][M.GROUPS_TRAINED] == [f"g{i}" for i in range(9, 17)]
    assert s0[0][M.VAL_REWARD_INITIAL] == sync[0][M.VAL_REWARD_INITIAL]
    assert s0[-1][M.VAL_REWARD] == sync[-1][M.VAL_REWARD] != sync[0][M.VAL_REWARD_INITIAL]
    # the held-out accuracy too: the sync baseline wrote none, so the sweep's accuracy table had no sync row
    assert s0[0][M.VAL_ACCURACY_INITIAL] == sync[0][M.VAL_ACCURACY_INITIAL]
    assert s0[-1][M.VAL_ACCURACY] == sync[-1][M.VAL_ACCURACY]


def test_sweep_writes_parquet_plots_and_summary(sweep):
    import pyarrow.parquet as pq

    t = pq.read_table(sweep / "results.parquet").to_pylist()
    assert len(t) == 2 * STEPS
    assert {r["setting"] for r in t} == {"sync", "s=0"}
    for key in ("seed", "step", "wall_s", "samples_seen", "reward_mean", "staleness_hist", "dropped_stale",
                "mismatch_kl"):
        assert all(key in r for r in t), key
    s0 = sorted((r for r in t if r["setting"] == "s=0"), key=lambda r: r["step"])
    assert [r["samples_seen"] for r in s0] == [64 * (i + 1) for i in range(STEPS)]
    assert all(r["staleness_hist"] == [64] for r in s0)
    assert [r["wall_s"] for r in s0] == sorted(r["wall_s"] for r in s0)
    for png in ("reward_vs_step", "reward_vs_wallclock", "reward_vs_samples", "staleness_distribution",
                "throughput"):
        data = (sweep / f"{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    summary, _, against = (sweep / "summary.md").read_text().partition("| setting | held-out accuracy at")
    rows = [ln for ln in summary.splitlines() if ln.startswith("| s=0") or ln.startswith("| sync")]
    assert len(rows) == 2 and "1.00x" in rows[0]
    assert rows[0].split("|")[3].strip() != "-", rows[0]  # the sync baseline's held-out accuracy
    assert "0.0%" in rows[1]  # nothing dropped at s = 0
    # the second table: both settings at equal samples, against the sync run's final accuracy
    assert [ln[:6] for ln in against.splitlines() if ln.startswith("| s")] == ["| sync", "| s=0 "], against


def test_a_run_is_stopped_by_the_clock_after_its_first_step(tmp_path):
    """--run-seconds: the run is stopped with SIGINT that long after its first trained step, well before its
    step count; the sweep keeps its steps (every line on disk) and marks the record as stopped by the clock."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "experiments.staleness", "--max-staleness", "1", "--seeds", "1", "--actors", "1",
           "--steps", "100000", "--run-seconds", "3", "--out", str(out), *ray_shared.job_args(),
           "learner.groups_per_step=2", "actors.groups_per_batch=2", "trainer.val_every=0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    record = json.loads((out / "runs" / "s1-seed0" / "record.json").read_text())
    steps = _metrics(out / "runs" / "s1-seed0")
    assert record["stopped_by"] == "clock" and 1 <= len(steps) < 100000
    assert steps[-1][M.TIME] - steps[0][M.TIME] < 3 + 10  # stopped near the 3 s mark (one step of slack)
    assert "stopped by the clock" in res.stdout and (out / "results.parquet").exists()


def test_sweep_rejects_bad_arguments():
    res = subprocess.run([sys.executable, "-m", "experiments.staleness", "--corrections", "vtrace"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--corrections" in res.stderr
    res = subprocess.run([sys.executable, "-m", "experiments.staleness", "--resume"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--resume, --report: give the --out" in res.stderr
    # a bound given twice ran the same run twice into one directory and summarised it as two seeds
    for flag, vals, dup in (("--max-staleness", ["0", "4", "0"], "[0]"), ("--corrections", ["tis", "tis"], "['tis']")):
        res = subprocess.run([sys.executable, "-m", "experiments.staleness", flag, *vals, "--out", "/nonexistent/x"],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and f"{flag}: {dup} given more than once" in res.stderr, res.stderr[-2000:]


def test_sync_baseline_trains_on_the_same_dataset(tmp_path):
    """With data.train_files (verl parquet), the sync baseline reads the learner's prompt source and
    scores with the actors' scorer: s=0 and sync stay equal number for number on a real dataset."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from test_datasets import verl_gsm8k_rows

    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(verl_gsm8k_rows(split)), tmp_path / f"{split}.parquet")
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "experiments.staleness", "--max-staleness", "0", "--sync", "--seeds", "1",
           "--steps", "4", "--actors", "1", "--out", str(out), *ray_shared.job_args(),
           f"data.train_files=[{tmp_path}/train.parquet]",
           f"data.val_files=[{tmp_path}/test.parquet]", "data.max_prompt_length=512", "learner.groups_per_step=2",
           "actors.groups_per_batch=2", "trainer.val_samples=2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    sync, s0 = _metrics(out / "runs" / "sync-seed0"), _metrics(out / "runs" / "s0-seed0")
    assert len(sync) == len(s0) == 4
    for a, b in zip(s0, sync):
        for key in DETERMINISTIC:
            assert a[key] == b[key], (a[M.STEP], key, a[key], b[key])
    assert s0[-1][M.VAL_REWARD] == sync[-1][M.VAL_REWARD]


def test_sync_baseline_interrupted_stops_cleanly(tmp_path):
    """Ctrl-C (or a sweep's --run-seconds SIGINT) ends the sync baseline as it ends cluster.start: exit 130, a line
    naming how many steps are on disk, every finished step's metrics line whole; it ended in a KeyboardInterrupt
    traceback."""
    import os
    import signal
    import time

    run_dir = tmp_path / "sync"
    # the default task: any other task.* setting warms up and caches a built-in model of its own (600 SFT steps)
    proc = subprocess.Popen([sys.executable, "-m", "experiments.sync", "--run-dir", str(run_dir),
                             "trainer.total_steps=1000", "trainer.val_samples=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # started with SIGINT ignored, as under nohup (CI's make test): it must stop all the same
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + SWEEP_TIMEOUT_S
        while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().count("\n"):
            assert proc.poll() is None and time.monotonic() < deadline, f"no step trained: {proc.poll()}"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    steps = len(_metrics(run_dir))
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert f"interrupted: {steps} steps in {run_dir}/metrics.jsonl" in out and 1 <= steps < 1000, out[-1000:]
