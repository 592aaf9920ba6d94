"""bench/curve.py: a run's learning curve from its metrics lines."""
from __future__ import annotations

import json

import pytest

from bench.curve import curve, main, table
from learner import metric_names as M

pytestmark = pytest.mark.unit


def lines():
    out = []
    for s in range(6):
        m = {M.STEP: s, M.TIME: 100.0 + 2 * s, M.REWARD_MEAN: 0.1 * s, M.RESPONSE_LEN_MEAN: 50 + s, M.SAMPLES: 128}
        if s == 0:
            m.update({M.WAIT_S: 3.0, M.TRAIN_S: 1.0, M.VAL_ACCURACY_INITIAL: 0.01})
        if s % 3 == 2:
            m[M.VAL_ACCURACY] = 0.02 * s
        out.append(m)
    return out


def test_curve_times_from_the_first_step_start_and_val_points():
    c = curve(lines())
    assert c["times"][0] == pytest.approx(4.0) and c["times"][-1] == pytest.approx(14.0)
    assert c["val"] == [(0, 0.0, 0.01), (3, pytest.approx(8.0), pytest.approx(0.04)), (6, pytest.approx(14.0),
                                                                                       pytest.approx(0.10))]
    assert c["samples"] == 768
    t = table(c, every=2)
    assert t.splitlines()[0] == "6 steps in 14 s; 54.9 samples/s"
    assert "| 0 | 0 | | | 0.0100 |" in t and "| 3 | 8 | 0.200 | 52 | 0.0400 |" in t
    assert "| 2 | 6 | 0.100 | 51 |  |" in t and "| 1 |" not in t   # every 2nd step, plus validations


def test_a_resumed_run_starts_at_its_first_step():
    ls = [{**m, M.STEP: m[M.STEP] + 50} for m in lines()]
    c = curve(ls)
    assert c["val"][0] == (50, 0.0, 0.01) and c["steps"][0] == 51
    assert "| 50 | 0 | | | 0.0100 |" in table(c, every=5)
    one = curve([{M.STEP: 0, M.TIME: 5.0, M.REWARD_MEAN: 0.0, M.RESPONSE_LEN_MEAN: 1, M.SAMPLES: 8}])
    assert table(one, every=1).splitlines()[0] == "1 steps in 0 s; samples/s unknown"  # no division by zero


def test_cli_writes_png_and_refuses_an_empty_file(tmp_path, capsys):
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps(m) for m in lines()) + "\n")
    assert main([str(f), "--png", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    f.write_text("")
    assert main([str(f)]) == 2
    assert "no step finished" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(f), "--every", "0"])


# a line as runs before the namespaced names wrote it (kept verbatim: bench.curve still reads those runs)
OLD_STYLE = ('{"step": 0, "version": 1, "reward_mean": 0.25, "staleness_mean": 0.5, "samples": 8, "time": 10.0, '
             '"wait_s": 1.0, "train_s": 0.5, "response_len_mean": 12.0, "val_reward_initial": 0.1, '
             '"val/accuracy_initial": 0.05, "val/accuracy": 0.5, "ws_publish_s": 0.2, "mismatch_kl": 0.01}')


def test_runs_written_with_the_old_names_are_read_with_the_new(tmp_path, capsys):
    f = tmp_path / "metrics.jsonl"
    second = {k: v for k, v in json.loads(OLD_STYLE).items() if k != "val_reward_initial"}   # not a resume's first
    f.write_text(OLD_STYLE + "\n" + json.dumps({**second, "step": 1, "time": 12.0}) + "\n")
    m = M.read_metrics(f)[0]
    assert m == {M.STEP: 0, M.VERSION: 1, M.REWARD_MEAN: 0.25, M.STALENESS_MEAN: 0.5, M.SAMPLES: 8, M.TIME: 10.0,
                 M.WAIT_S: 1.0, M.TRAIN_S: 0.5, M.RESPONSE_LEN_MEAN: 12.0, M.VAL_REWARD_INITIAL: 0.1,
                 M.VAL_ACCURACY_INITIAL: 0.05, M.VAL_ACCURACY: 0.5, M.WS_PUBLISH_S: 0.2, M.MISMATCH_KL: 0.01}
    assert M.upgrade(m) == m  # new names stay
    assert main([str(f), "--every", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 0 | | | 0.0500 |" in out and "| 2 | 4 | 0.250 | 12 | 0.5000 |" in out


def test_a_line_being_written_is_left_out_and_a_broken_one_named(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text(OLD_STYLE + "\n" + '{"step": 1, "ti')
    assert [m[M.STEP] for m in M.read_metrics(f)] == [0]
    f.write_text('{"step": 1, "ti\n' + OLD_STYLE + "\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        M.read_metrics(f)


def test_skipped_steps_lines_are_left_out_unless_asked_for(tmp_path, capsys):
    """A skipped step's line has no step metrics (train/skipped, the reason, nothing else): readers that index
    the step metrics get only applied steps; bench.curve draws a run that skipped one."""
    f = tmp_path / "metrics.jsonl"
    skipped = {M.STEP: 1, M.VERSION: 1, M.SKIPPED: 1, M.SKIP_REASON: "non-finite loss", M.TIME: 11.0}
    applied = {**json.loads(OLD_STYLE), "step": 1, "time": 12.0}
    f.write_text("\n".join([OLD_STYLE, json.dumps(skipped), json.dumps(applied)]) + "\n")
    assert [m[M.TIME] for m in M.read_metrics(f)] == [10.0, 12.0]
    assert [m.get(M.SKIPPED) for m in M.read_metrics(f, skipped=True)] == [None, 1, None]
    assert main([str(f), "--every", "1"]) == 0


def test_compare_curves_reads_ours_and_trls_and_finds_the_two_point_crossing(tmp_path, capsys):
    import json

    from bench.compare_curves import first_crossing, main, read_points

    assert first_crossing([(0, 0.1), (10, 0.28), (20, 0.31), (30, 0.35)], 0.30) == 30  # (0.31 + 0.35) / 2
    assert first_crossing([(0, 0.1), (10, 0.5)], 0.30) == 10
    assert first_crossing([(0, 0.1), (10, 0.2)], 0.30) is None
    trl = tmp_path / "trl.metrics.jsonl"
    trl.write_text("\n".join(json.dumps(x) for x in [
        {"train_s": 0.0, "step": 1, "samples": 128, "val/accuracy": 0.05},
        {"train_s": 15.0, "step": 11, "samples": 1408, "val/accuracy": 0.60},
        {"summary": True, "steps": 20, "samples": 2560, "train_s": 20.0, "samples_per_s": 128.0}]) + "\n")
    pts, rate = read_points(str(trl))
    assert pts == [(0.0, 0.05), (15.0, 0.60)] and rate == 128.0
    assert main([f"TRL s=1={trl}", "--png", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "| TRL s=1 | 128.0 |" in out and "| 15 s |" in out
    assert (tmp_path / "c.png").stat().st_size > 0
    # a run still being written (its last line half there) reads as it stands; a file that is not JSON lines,
    # or is not there, is a usage error naming it (they were tracebacks)
    trl.write_text(trl.read_text() + '{"train_s": 30.0, "val/acc')
    assert read_points(str(trl))[0] == [(0.0, 0.05), (15.0, 0.60)]
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    for path, message in ((tmp_path / "list.jsonl", "line 1 is not a JSON object"), (tmp_path / "no", "No such file")):
        with pytest.raises(SystemExit) as e:
            main([f"x={path}"])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_file_of_another_schema_and_a_png_nowhere_are_named(tmp_path, capsys):
    """A .jsonl that is not a learner's metrics (an eval dump, the ingest's log) was a KeyError traceback in
    bench.curve and bench.compare_curves; --png into a missing directory a traceback after the table printed."""
    from bench import compare_curves

    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "abcd>", "score": 1.0}\n')
    assert main([str(other)]) == 2
    assert f"{other}: line 1 has no '{M.TIME}': not a learner's metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        compare_curves.main([f"s=2={other}"])
    assert e.value.code == 2 and "not a learner's metrics.jsonl" in capsys.readouterr().err
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps(m) for m in lines()) + "\n")
    assert main([str(f), "--png", str(tmp_path / "no" / "c.png")]) == 2
    out = capsys.readouterr()
    assert f"no directory {tmp_path / 'no'}" in out.err and not out.out


def test_a_resumed_runs_redone_steps_count_once(tmp_path, capsys):
    """A resume redoes the steps after its checkpoint and appends their lines: bench.curve listed both
    incarnations' lines of those steps (and their samples), and put the crashed one's evaluation on the
    redone step's row. The resumed incarnation's lines supersede them (as tests/chaos/ledger.py counts)."""
    first = lines()                                            # steps 0..5, crashed after step 5
    again = [{**m, M.TIME: m[M.TIME] + 100, M.REWARD_MEAN: 0.9} for m in lines()[4:]]   # resumed from step 4
    again[0][M.VAL_REWARD_INITIAL] = 0.5
    assert [m[M.STEP] for m in M.superseded_dropped(first + again)] == [0, 1, 2, 3, 4, 5]
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps(m) + "\n" for m in first + again))
    assert main([str(f), "--every", "1"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 5 ") or ln.startswith("| 6 ")]
    assert len(rows) == 2 and all("0.900" in r for r in rows), rows


def test_the_downtime_between_a_crash_and_its_resume_is_left_out():
    """The samples/s of a resumed run counted the minutes between its crash and its resume's first step (the
    new learner's start-up and initial evaluation too) as if it had trained through them."""
    first = lines()                                                 # steps 0..5 at t = 104..114 (start 100)
    again = [{**m, M.STEP: m[M.STEP] + 6, M.TIME: m[M.TIME] + 500} for m in lines()[:3]]   # resumed at step 6
    again[0][M.VAL_REWARD_INITIAL] = 0.5                             # began at 600 (its wait 3 s, train 1 s)
    c = curve(first + again)
    assert c["resumes"] == 1 and c["down_s"] == pytest.approx(600 - 114)
    assert c["times"][6] == pytest.approx(14 + 4) and c["times"][-1] == pytest.approx(14 + 8)
    assert table(c, every=1).splitlines()[0] == ("9 steps in 22 s (1 resume(s): 486 s of downtime and redone steps "
                                                 f"left out); {9 * 128 / 22:.1f} samples/s")
