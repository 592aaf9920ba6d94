"""The staleness sweep's summary of held-out evaluations (pure logic over metrics lines)."""
import math

import pytest

from experiments.sweep.analysis import heldout_points, summarize
from experiments.sweep.config import SweepConfig
from experiments.sweep.report import summary_markdown
from learner import metric_names as M

pytestmark = pytest.mark.unit


def line(step, t, **extra):
    """One learner step's metrics line: 64 samples, version step + 1."""
    return {M.STEP: step, M.VERSION: step + 1, M.TIME: 100.0 + t, M.SAMPLES: 64, M.REWARD_MEAN: 0.1 * step,
            M.STALENESS_MEAN: 0.5, M.STALENESS_HIST: [32, 32], M.DROPPED_STALE: 0, M.GROUPS_TRAINED: ["g"] * 8,
            M.MISMATCH_KL: 0.001, **extra}


def evaluator_run():
    """Evaluations of versions 3 and 5 arrive on the lines of steps 4 and 7 (the evaluator lags); the run
    is stopped by the clock after step 7, so no final evaluation."""
    ms = [line(s, 2.0 * s) for s in range(8)]
    ms[0].update({M.VAL_ACCURACY_INITIAL: 0.05, M.VAL_REWARD_INITIAL: 0.06})
    ms[4].update({M.VAL_ACCURACY: 0.2, M.VAL_REWARD: 0.25, M.VAL_VERSION: 3})
    ms[7].update({M.VAL_ACCURACY: 0.3, M.VAL_REWARD: 0.35, M.VAL_VERSION: 5})
    return ms


def test_an_evaluators_result_is_placed_where_its_weights_were_made():
    pts = heldout_points(evaluator_run())
    # version 3 was made by step 2 (t = 4 s, 192 samples seen), version 5 by step 4
    assert [(p["step"], p["wall_s"], p["samples_seen"], p["value"]) for p in pts] == [
        (-1, 0.0, 0, 0.05), (2, 4.0, 192, 0.2), (4, 8.0, 320, 0.3)]
    assert [p["value"] for p in heldout_points(evaluator_run(), M.VAL_REWARD)] == [0.06, 0.25, 0.35]


def test_the_learners_own_evaluation_is_at_its_own_line():
    ms = [line(s, float(s)) for s in range(4)]
    ms[0][M.VAL_ACCURACY_INITIAL] = 0.1
    ms[3][M.VAL_ACCURACY] = 0.4
    assert [(p["step"], p["samples_seen"], p["value"]) for p in heldout_points(ms)] == [(-1, 0, 0.1), (3, 256, 0.4)]


def test_a_clock_stopped_run_reports_its_last_evaluation_not_nan():
    rec = {"setting": "s=1", "mode": "async", "seed": 0, "run_wall_s": 20.0, "metrics": evaluator_run()}
    s = summarize([rec])[0]
    assert s["val_end"] == (0.35, 0.0) and s["acc_start"] == (0.05, 0.0) and s["acc_end"] == (0.3, 0.0)
    row = next(ln for ln in summary_markdown([s], SweepConfig(), 20.0, 8).splitlines() if ln.startswith("| s=1"))
    assert "nan" not in row and "0.050 -> 0.300" in row


def test_a_run_without_evaluations_has_no_end_value():
    s = summarize([{"setting": "s=0", "mode": "async", "seed": 0, "run_wall_s": 5.0,
                    "metrics": [line(s, float(s)) for s in range(5)]}])[0]
    assert math.isnan(s["val_end"][0]) and math.isnan(s["acc_end"][0])


def test_accuracy_at_equal_samples_and_seconds_to_a_target():
    from experiments.sweep.analysis import accuracy_at_samples, seconds_to

    pts = heldout_points(evaluator_run())  # (0 samples, 0.05) (192, 0.2) (320, 0.3); walls 0, 4, 8 s
    assert accuracy_at_samples(pts, 256) == pytest.approx(0.25) and accuracy_at_samples(pts, 192) == 0.2
    assert accuracy_at_samples(pts, 400) is None
    assert seconds_to(pts, 0.25) == 8.0            # 2-point means: 0.125 at 4 s, 0.25 at 8 s
    assert seconds_to(pts, 0.26) is None


def test_settings_against_the_reference_run():
    """Each setting's held-out accuracy at the samples every run reached, and seconds to the s=0 run's final
    accuracy; the summary writes them as a second table."""
    fast = evaluator_run()
    for m in fast:
        m[M.TIME] = 100.0 + (m[M.TIME] - 100.0) / 2  # the same curve in half the wall time
    recs = [{"setting": "s=0", "mode": "async", "seed": 0, "run_wall_s": 20.0, "metrics": evaluator_run()},
            {"setting": "s=1", "mode": "async", "seed": 0, "run_wall_s": 10.0, "metrics": fast}]
    out = summarize(recs)
    assert [s["equal_samples"] for s in out] == [320, 320] and out[0]["ref_accuracy"] == pytest.approx(0.25)
    assert [s["acc_at_equal"][0] for s in out] == [0.3, 0.3]
    assert [s["s_to_ref"][0] for s in out] == [8.0, 4.0]
    md = summary_markdown(out, SweepConfig(), 30.0, 8)
    assert "| setting | held-out accuracy at 320 samples | seconds to 0.250" in md and "| s=1 | 0.300 ± 0.000 | 4 ± 0 |" in md


def test_a_seed_that_never_reaches_the_reference_is_named_not_averaged_away():
    slow = evaluator_run()
    for m in slow:  # held-out accuracy never above 0.1: the 2-point mean never reaches s=0's 0.25
        if M.VAL_ACCURACY in m:
            m[M.VAL_ACCURACY] = 0.1
    recs = [{"setting": "s=0", "mode": "async", "seed": 0, "run_wall_s": 20.0, "metrics": evaluator_run()},
            {"setting": "s=8", "mode": "async", "seed": 0, "run_wall_s": 20.0, "metrics": evaluator_run()},
            {"setting": "s=8", "mode": "async", "seed": 1, "run_wall_s": 20.0, "metrics": slow}]
    out = summarize(recs)
    assert out[1]["s_to_ref"][0] == 8.0 and out[1]["s_to_ref_missed"] == 1
    assert "| s=8 | 0.200 ± 0.141 | 8 ± 0 (1 of 2 seeds never) |" in summary_markdown(out, SweepConfig(), 60.0, 8)


def test_report_summarises_every_finished_run_whatever_call_ran_it(tmp_path):
    """`--report`: runs of separate calls (the bounds, then the corrections at one bound) in one table, the
    default correction's settings first; an unfinished run (no record.json) is left out; nothing is run."""
    import json

    from experiments.staleness import main

    runs = {"s8-tis-seed0": ("s=8 tis", 8, "tis"), "s8-seed0": ("s=8", 8, "ppo_clip"),
            "s0-seed0": ("s=0", 0, "ppo_clip"), "s2-seed0": ("s=2", 2, "ppo_clip")}
    for name, (label, s, corr) in runs.items():
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        with open(d / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({M.STALENESS_MAX: 1, M.SAMPLES_PER_S: 32.0, M.WAIT_S: 0.1, M.LOSS: 0.0,
                                     M.CLIP_FRAC: 0.0, **m}) + "\n" for m in evaluator_run())
        if name != "s2-seed0":  # cut off: no record
            (d / "record.json").write_text(json.dumps({"setting": label, "max_staleness": s, "correction": corr,
                                                       "mode": "async", "seed": 0, "run_wall_s": 20.0}))
    assert main(["--out", str(tmp_path), "--report"]) == 0
    md = (tmp_path / "summary.md").read_text()
    rows = [ln.split(" | ")[0] for ln in md.splitlines() if ln.startswith("| s=")]
    assert rows[:3] == ["| s=0", "| s=8", "| s=8 tis"] and "3 settings x 1 seeds" in md
    assert (tmp_path / "results.parquet").exists() and not (tmp_path / "runs" / "s2-seed0" / "record.json").exists()
    assert main(["--out", str(tmp_path / "empty"), "--report"]) == 2


def test_a_cut_or_foreign_record_is_a_run_not_finished(tmp_path, capsys):
    """A record.json cut off while written (it was written in place) or not a record was a JSONDecodeError
    traceback in --report, and in --resume `error: Unterminated string ...` naming no file: the run is taken as
    unfinished, named, and the others are reported."""
    import json

    from experiments.staleness import main

    for name, record in (("s0-seed0", '{"setting": "s=0", "max_sta'), ("s1-seed0", "[1]"),
                         ("s2-seed0", '{"setting": "s=2"}'),
                         ("s4-seed0", json.dumps({"setting": "s=4", "max_staleness": 4, "correction": "ppo_clip",
                                                  "mode": "async", "seed": 0, "run_wall_s": 20.0}))):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        with open(d / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({M.STALENESS_MAX: 1, M.SAMPLES_PER_S: 32.0, M.WAIT_S: 0.1, M.LOSS: 0.0,
                                     M.CLIP_FRAC: 0.0, **m}) + "\n" for m in evaluator_run())
        (d / "record.json").write_text(record)
    assert main(["--out", str(tmp_path), "--report"]) == 0
    err = capsys.readouterr().err
    for name in ("s0-seed0", "s1-seed0", "s2-seed0"):
        assert f"{tmp_path / 'runs' / name / 'record.json'} is not a run record" in err, err
    rows = [ln.split(" | ")[0] for ln in (tmp_path / "summary.md").read_text().splitlines() if ln.startswith("| s=")]
    assert rows[:1] == ["| s=4"] and len(set(rows)) == 1, rows


def test_an_interrupted_sweep_stops_its_running_job(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM, which main turns into SystemExit) while a run goes: the run's process group,
    started in its own session so the terminal's signal never reaches it, is stopped, not orphaned. The sweep
    here was started with SIGINT ignored (nohup, `&` in a script): its runs still stop on SIGINT at once."""
    import os
    import signal
    import subprocess
    import sys

    from experiments.sweep import cli, runner
    from experiments.sweep.config import Setting

    child = [sys.executable, "-c", "import time; time.sleep(600)"]
    monkeypatch.setattr(runner, "command", lambda *a: child)
    started = []
    real_popen = subprocess.Popen

    def popen(*a, **kw):
        started.append(real_popen(*a, **kw))
        return started[-1]

    def interrupted(run_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    monkeypatch.setattr(runner, "progress_of", interrupted)
    st = Setting(label="s=1", max_staleness=1, correction="ppo_clip", mode="async")
    handlers = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.getsignal(signal.SIGTERM)
    try:
        cli.stop_signals()  # main's first step
        with pytest.raises(KeyboardInterrupt):
            runner.run_one(SweepConfig(), st, 0, tmp_path, "run-x", "[1/1]", eta=(0.0, 0, 1))
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    proc = started[0]
    # reaped, and ended by the SIGINT itself: with the ignored disposition inherited it took SIGKILL, 60 s later
    assert proc.returncode == -signal.SIGINT
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its process group is left


def test_a_setting_has_one_name_however_the_corrections_are_asked_for(tmp_path, capsys):
    """`--corrections decoupled` alone names its runs like `--corrections ppo_clip decoupled` does (s4-decoupled),
    never like the default correction's (s4): --resume once kept an s=4 ppo_clip run for s=4 decoupled. A kept
    run whose record is another setting than its name says is refused, and nothing runs."""
    import json

    from experiments.staleness import main
    from experiments.sweep.config import run_name, settings

    def names(*corrections):
        cfg = SweepConfig(max_staleness=[4], corrections=list(corrections), seeds=1)
        return [run_name(st, 0) for st in settings(cfg)]

    assert names("decoupled") == ["s4-decoupled-seed0"]
    assert names("ppo_clip") == ["s4-seed0"]
    assert names("ppo_clip", "decoupled") == ["s4-seed0", "s4-decoupled-seed0"]
    d = tmp_path / "runs" / "s4-decoupled-seed0"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(json.dumps({M.REWARD_MEAN: 0.5}) + "\n")
    (d / "record.json").write_text(json.dumps({"setting": "s=4", "max_staleness": 4, "correction": "ppo_clip",
                                               "mode": "async", "seed": 0, "run_wall_s": 1.0}))
    # s=2 comes first in the sweep and would run: the check is made before anything runs
    rc = main(["--max-staleness", "2", "4", "--corrections", "decoupled", "--seeds", "1", "--out", str(tmp_path),
                  "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "s4-decoupled-seed0 holds a finished run of" in err and "'correction': 'ppo_clip'" in err
    assert not (tmp_path / "runs" / "s2-decoupled-seed0").exists()


def test_generation_wasted_is_the_untrained_share_of_the_engines_rows(tmp_path):
    """A run folder whose actors counted their engine rows: summarize reports 1 - trained tokens / rows per
    setting (mean over seeds), and '-' where no run counted them (the HF engine)."""
    import json

    from experiments.sweep.runner import load_finished

    ms = [{M.STEP: k, M.TIME: float(k), M.SAMPLES: 64, M.RESPONSE_LEN_MEAN: 10.0, M.REWARD_MEAN: 0.5,
           M.GROUPS_TRAINED: ["g"] * 8, M.DROPPED_STALE: 0, M.STALENESS_MEAN: 1.0, M.MISMATCH_KL: 0.0}
          for k in range(4)]
    for name, rows in (("a", 3200), ("b", None)):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in ms))
        (d / "record.json").write_text(json.dumps({"setting": f"s={name}", "max_staleness": 2, "correction": "ppo_clip",
                                                   "mode": "async", "seed": 0, "run_wall_s": 4.0}))
        beat = {"engine_steps": 10, "occupied_steps": 10 if rows else 0, "running_seqs": rows or 0}
        (d / "status.json").write_text(json.dumps({"members": {"actor-0": beat}}))
    recs = [load_finished(tmp_path / n) for n in ("a", "b")]
    assert recs[0]["trained_share"] == pytest.approx(4 * 64 * 10 / 3200) and recs[1]["trained_share"] is None
    summary = summarize(recs)
    assert summary[0]["generation_wasted"][0] == pytest.approx(0.2)
    table = summary_markdown(summary, SweepConfig(), 8.0, 4)
    assert "| 20% |" in table and "| - |" in table


def test_resume_refuses_runs_kept_from_a_call_with_other_arguments(tmp_path, capsys):
    """--resume kept a finished run whatever --steps, --actors or --learners its call had: a sweep resumed
    with other ones mixed 40-step runs of one actor with 6-step runs of two into one table, silently. Refused,
    naming the run and both values, before anything runs; other overrides are said, not refused (they may name
    paths that move between device calls); the same arguments keep it."""
    import json

    from experiments.staleness import main

    d = tmp_path / "runs" / "s0-seed0"
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({M.STALENESS_MAX: 1, M.SAMPLES_PER_S: 32.0, M.WAIT_S: 0.1, M.LOSS: 0.0,
                                 M.CLIP_FRAC: 0.0, **m}) + "\n" for m in evaluator_run())
    args = {"config": None, "steps": 40, "actors": 1, "learners": 0, "run_seconds": 0.0, "overrides": ["a.b=1"]}
    (d / "record.json").write_text(json.dumps({"setting": "s=0", "max_staleness": 0, "correction": "ppo_clip",
                                               "mode": "async", "seed": 0, "run_wall_s": 20.0, "args": args}))
    sweep = ["--max-staleness", "0", "--seeds", "1", "--out", str(tmp_path), "--resume"]
    assert main([*sweep, "--steps", "6", "--actors", "2", "a.b=1"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {d} was run with --steps=40 (this call: 6), --actors=1 (this call: 2)" in err, err
    assert not (tmp_path / "summary.md").exists()
    assert main([*sweep, "--steps", "40", "--actors", "1", "a.b=2"]) == 0   # all kept: nothing runs
    assert "overrides=['a.b=1'] (this call: ['a.b=2'])" in capsys.readouterr().err
    assert main([*sweep, "--steps", "40", "--actors", "1", "a.b=1"]) == 0
    assert "note: --resume keeps" not in capsys.readouterr().err
