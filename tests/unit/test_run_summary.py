"""bench/run_summary.py: the per-step breakdown, lockstep generation, evaluations and actor production."""
from __future__ import annotations

import json

import pytest

from bench import run_summary
from learner import metric_names as M


def line(step: int, t: float, *, wait: float, ws: float | None = None, val: tuple | None = None) -> dict:
    m = {M.STEP: step, M.TIME: t, M.SAMPLES: 128, M.WAIT_S: wait, M.TRAIN_S: 0.2, M.PUBLISH_S: 0.01,
         M.READ_S: wait, M.OTHER_S: 0.005, M.RESPONSE_LEN_MEAN: 20.0 + step, M.RESPONSE_LEN_MAX: 40 + step,
         M.DROPPED_STALE: step % 2, M.ABORTED_STALE: step}
    if ws is not None:
        m[M.WS_PUBLISH_S] = ws
    if val is not None:
        m[M.VAL_EVAL_S], m[M.VAL_LEN_MAX] = val
    return m


def test_breakdown_means_after_the_skipped_steps_and_counts_the_books():
    lines = [line(0, 100.0, wait=5.0)] + [line(s, 100.0 + 0.5 * s, wait=0.3, ws=0.1, val=(1.5, 300) if s == 4
                                                else (0.4, 100) if s == 6 else None) for s in range(1, 8)]
    out = run_summary.breakdown(lines, skip=2)
    assert out["steps"] == 8 and out["wall_s"] == pytest.approx(3.5)
    assert out["samples_per_s"] == pytest.approx(7 * 128 / 3.5)   # the first step's samples came before t0
    assert out[M.WAIT_S] == pytest.approx(0.3)                      # step 0's 5 s start-up wait is left out
    assert out["lockstep_generation_s"] == pytest.approx(0.2)
    assert out["response_len_max"] == 47 and out["dropped_stale"] == 4 and out["aborted_in_flight"] == 7
    assert (out["evaluations"], out["eval_s_max"], out["evaluations_over_1s"]) == (2, 1.5, 1)
    assert out["eval_s_per_decode_step"] == pytest.approx((1.5 / 300 + 0.4 / 100) / 2)
    with pytest.raises(ValueError, match="too few"):
        run_summary.breakdown(lines[:3], skip=2)


def test_a_resumed_runs_downtime_is_not_in_its_rate():
    """As bench.curve: the seconds between the crashed incarnation's last line and the resumed one's first step
    were counted as the run's, halving a resumed run's samples/s in this example."""
    first = [line(s, 100.0 + s, wait=0.3) for s in range(5)]                  # 1 s a step, to t = 104
    again = [line(s, 105.5 + s, wait=0.3) for s in range(5, 10)]              # resumed: step 5 began at 110
    again[0][M.VAL_REWARD_INITIAL] = 0.5
    out = run_summary.breakdown(first + again, skip=1)
    assert out["down_s"] == pytest.approx(110.0 - 104.0) and out["wall_s"] == pytest.approx(14.5 - 6.0)
    assert out["samples_per_s"] == pytest.approx(9 * 128 / 8.5)


def test_production_and_launch_time_from_a_run_directory(tmp_path):
    lines = [line(s, 200.0 + s, wait=0.1) for s in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "config.yaml").write_text("actors:\n  n: 8\n")
    members = {"actor-0": {"groups": 100, "busy_s": 2.0, "engine_steps": 400, "step_s": 1.6, "leased_seqs": 80_000,
                           "step_profile": {"0": [100, 0.2], "192": [300, 1.4], "224": [0, 0.0]}},
               "actor-1": {"groups": 10, "busy_s": 0.0, "episode_turns": 30, "env_steps": 20, "env_s": 0.5,
                           "episode_reasons": {"answered": 9, "tool_timeout": 1}, "episodes_resumed": 2},
               "actor-2": {"groups": 5, "busy_s": 1.0, "engine_steps": 10, "step_s": 0.05, "leased_seqs": 640,
                           "occupied_steps": 8, "running_seqs": 400, "waiting_seqs": 80, "kv_usage_max": 0.97,
                           "prompt_tokens": 1000, "prefix_cached_tokens": 640},
               "evaluator": {"version": 5}}   # never held a lease / not an actor: no production
    (tmp_path / "status.json").write_text(json.dumps({"members": members}))
    out = run_summary.summarise(tmp_path, skip=1, launched=150.0)
    assert out["production"] == {"actor-0": 400.0, "actor-2": 40.0}
    # the step's profile by occupancy: bins' lowest leased count -> [steps, mean ms] (empty bins left out)
    assert out["engine_steps"]["actor-0"] == {"step_ms": pytest.approx(4.0), "leased_inflight": 200.0,
                                              "step_ms_by_leased": {0: [100, pytest.approx(2.0)],
                                                                    192: [300, pytest.approx(1.4e3 / 300)]}}
    # the scheduler's view averages over the steps that had one (8 of 10 here)
    assert out["engine_steps"]["actor-2"] == {"step_ms": pytest.approx(5.0), "leased_inflight": 64.0,
                                              "running": 50.0, "waiting": 10.0, "kv_usage_max": 0.97,
                                              "prefix_cached": 0.64}
    assert out["launch_to_first_step_s"] == pytest.approx(50.0)
    # a multi-turn actor's episodes: the time they spent in their environment, per environment step
    assert out["episodes"] == {"actor-1": {"turns": 30, "env_steps": 20, "env_s": 0.5, "env_ms_per_step": 25.0,
                                           "reasons": {"answered": 9, "tool_timeout": 1}, "resumed": 2}}
    assert "production" not in run_summary.summarise(tmp_path / "metrics.jsonl", skip=1)
    assert "startup" not in out and "launch_to_first_step_s" not in run_summary.summarise(tmp_path, skip=1)
    # the launcher's start-up timeline: reported as it is, and launch -> first step read from it unless given
    startup = {"launcher:launched": 0.0, "actor-0:engine": 31.5, "learner-0:first_step": 47.25}
    (tmp_path / "status.json").write_text(json.dumps({"members": members, "startup": startup}))
    out = run_summary.summarise(tmp_path, skip=1)
    assert out["startup"] == startup and out["launch_to_first_step_s"] == 47.25
    assert run_summary.summarise(tmp_path, skip=1, launched=150.0)["launch_to_first_step_s"] == pytest.approx(50.0)


def test_a_path_without_metrics_is_a_usage_error(tmp_path, capsys):
    """A missing path, or a run directory whose job never finished a step, is named (exit 2), not a traceback."""
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(SystemExit) as e:
            run_summary.main([str(path)])
        assert e.value.code == 2 and "no metrics.jsonl with a step in it" in capsys.readouterr().err


def test_short_runs_and_bad_arguments_are_usage_errors(tmp_path, capsys):
    """The README's own example on a 4-step run, a line that is not a JSON object, a negative --skip and a
    --json nowhere writable were tracebacks (the last one after the summary had printed)."""
    lines = [line(s, 200.0 + s, wait=0.1) for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    (tmp_path / "other.jsonl").write_text('{"prompt": "abcd>", "score": 1.0}\n' * 6)
    cases = [([str(tmp_path), "--skip", "3"], "4 steps: too few to summarise after skipping 3"),
             ([str(tmp_path / "list.jsonl")], "line 1 is not a JSON object (a list)"),
             # a .jsonl of another schema was a KeyError traceback
             ([str(tmp_path / "other.jsonl")], f"line 1 has no '{M.TIME}': not a learner's metrics.jsonl"),
             ([str(tmp_path), "--skip", "-2"], "--skip must be >= 0"),
             ([str(tmp_path), "--skip", "1", "--json", str(tmp_path / "no" / "x.json")], "no directory")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            run_summary.main(argv)
        out = capsys.readouterr()
        assert e.value.code == 2 and message in out.err and not out.out, (argv, out)
    assert run_summary.main([str(tmp_path), "--skip", "1"]) == 0   # fewer skipped: it summarises
    capsys.readouterr()
    # no --skip: a short run (a smoke test) is summarised with fewer skipped, and says so
    assert run_summary.main([str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "skip its first 2 step(s), not 3" in out.err and "steps: 4" in out.out, out
