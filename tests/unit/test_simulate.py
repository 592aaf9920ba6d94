"""The simulator (experiments/simulator/): the admission rule, closed-form cases, and invariants of the schedule."""
from __future__ import annotations

import math
from pathlib import Path
import random
import statistics

import pytest

from buffer.staleness import admission_cap
from experiments.simulate import main as sim_main
from experiments.simulator.config import SimConfig
from experiments.simulator.model import lease_rule, response_lengths, simulate
from learner import metric_names as M

pytestmark = pytest.mark.unit

BASE = dict(groups_per_step=8, n=8, groups_per_batch=4, gen_batch_s=0.01, gen_step_s=0.002, len_mean=5,
            max_tokens=8, train_sample_s=0.0005, publish_s=0.005, steps=60)


def test_lease_rule_is_the_store_rule():
    """The LEASE_LUA decision, written out from buffer/staleness.py's pure admission cap."""
    rng = random.Random(0)
    for _ in range(2000):
        v, s, G = rng.randint(0, 20), rng.randint(0, 4), rng.randint(1, 8)
        actor_v, dropped, want = rng.randint(max(0, v - 6), v), rng.randint(0, 5), rng.randint(1, 6)
        started = rng.randint(0, admission_cap(v, s, G, dropped) + 3)
        for admission, base in (("learner", v), ("actor", min(v, actor_v))):
            got = lease_rule(v, s, G, actor_v, started, dropped, want, admission)
            if actor_v < v - s:
                assert got == -1
            else:
                assert got == max(0, min(want, admission_cap(base, s, G, dropped) - started))


def test_sync_alternates_exactly():
    """One actor, s = 0, one device each: a step is two batches then train then publish."""
    r = simulate(SimConfig(actors=1, mode="sync", **BASE))
    gen = 0.01 + 5 * 0.002
    step = 2 * gen + 64 * 0.0005 + 0.005
    assert r.samples_per_s == pytest.approx(64 / step, rel=1e-9)
    assert r.staleness_hist == [60 * 64]
    assert r.learner_idle == pytest.approx(2 * gen / step, rel=0.02)


def test_sync_is_async_at_zero_staleness():
    a = simulate(SimConfig(actors=3, mode="sync", max_staleness=3, **BASE))
    b = simulate(SimConfig(actors=3, mode="async", max_staleness=0, **BASE))
    assert a.step_end_times == b.step_end_times and a.staleness_hist == b.staleness_hist


@pytest.mark.parametrize("s", [1, 2, 4])
def test_async_is_bounded_and_learner_bound_with_enough_actors(s):
    c = SimConfig(actors=8, mode="async", max_staleness=s, **BASE)
    r = simulate(c)
    assert len(r.staleness_hist) == s + 1 and sum(r.staleness_hist) == c.steps * 64
    # learner-bound: actors run ahead to the admission cap, so almost every sample is s versions old
    assert r.staleness_hist[s] > 0.9 * c.steps * 64
    # the learner never waits once the pipeline is full: step = train + publish
    assert r.samples_per_s == pytest.approx(64 / (64 * 0.0005 + 0.005), rel=0.01)
    assert r.learner_idle < 0.05
    assert r.dropped_frac == 0  # admission keeps everything within s: nothing to drop


def test_async_overlap_beats_sync_and_more_staleness_helps_up_to_the_bound():
    rates = [simulate(SimConfig(actors=2, mode="async", max_staleness=s, **BASE)).samples_per_s for s in (0, 1, 2)]
    assert rates[0] < rates[1] <= rates[2] * 1.001


def test_processor_sharing_halves_speed_on_one_core():
    """1 actor + 1 learner with equal work per step, both always busy (s large): on one shared core
    the pipeline does both works per step at half speed each, so throughput halves."""
    gen_step = 2 * (0.01 + 5 * 0.002)
    kw = {**BASE, "train_sample_s": gen_step / 64, "publish_s": 0.0}
    one = simulate(SimConfig(actors=1, max_staleness=8, cores=1, **kw)).samples_per_s
    two = simulate(SimConfig(actors=1, max_staleness=8, cores=2, **kw)).samples_per_s
    assert two == pytest.approx(64 / gen_step, rel=0.01)
    assert one == pytest.approx(two / 2, rel=0.02)


def test_long_tail_slows_batched_generation():
    lens = response_lengths(random.Random(1), 20000, 100, 1.0, 4096)
    assert abs(sum(lens) / len(lens) - 100) < 5 and max(lens) > 1000  # the mean holds, the tail is long
    kw = {**BASE, "len_mean": 100, "max_tokens": 1024}
    flat = simulate(SimConfig(actors=2, mode="sync", len_sigma=0.0, **kw)).samples_per_s
    tail = simulate(SimConfig(actors=2, mode="sync", len_sigma=1.0, **kw)).samples_per_s
    assert tail < 0.8 * flat  # a batch waits for its longest sample


def test_config_checks():
    with pytest.raises(ValueError):
        SimConfig(mode="hybrid")
    with pytest.raises(ValueError):
        SimConfig(cores=0)
    assert SimConfig(mode="sync", max_staleness=4).s == 0 and math.isinf(SimConfig().cores)


def test_latency_takes_no_core_and_the_ingest_is_on_the_path():
    """One actor, sync, one device each: a step is batch, its ingest, batch, its ingest, latency, train,
    publish: an actor's send waits for the ingest's ack before it leases again."""
    gen = 0.01 + 5 * 0.002
    kw = {**BASE, "system_batch_s": 0.003, "learner_latency_s": 0.007}
    r = simulate(SimConfig(actors=1, mode="sync", **kw))
    step = 2 * (gen + 0.003) + 0.007 + 64 * 0.0005 + 0.005
    assert r.samples_per_s == pytest.approx(64 / step, rel=1e-9)
    # nothing overlaps here, so one core gives the same; the latency takes no core either way
    one = simulate(SimConfig(actors=1, mode="sync", cores=1, **kw))
    assert one.samples_per_s == pytest.approx(64 / step, rel=1e-9)
    # two actors: the second batch generates while the first is stored
    two = simulate(SimConfig(actors=2, mode="sync", **kw))
    assert two.samples_per_s == pytest.approx(64 / (gen + 2 * 0.003 + 0.007 + 64 * 0.0005 + 0.005), rel=1e-9)


def test_background_load_takes_its_share_of_the_cores():
    gen_step = 2 * (0.01 + 5 * 0.002)
    kw = {**BASE, "train_sample_s": gen_step / 64, "publish_s": 0.0, "actors": 1, "max_staleness": 8}
    half = simulate(SimConfig(cores=2, background_cores=1.0, **kw)).samples_per_s
    one = simulate(SimConfig(cores=1, **kw)).samples_per_s
    assert half == pytest.approx(one, rel=1e-9)
    with pytest.raises(ValueError, match="background_cores"):
        SimConfig(cores=2, background_cores=2)


def _write_run(d, cfg: dict, metrics: list[dict], cpu_lines: list[dict] = ()):
    import json

    import yaml

    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if cpu_lines:
        (d / "cpu.jsonl").write_text("".join(json.dumps(x) + "\n" for x in cpu_lines))


def _synthetic_runs(tmp_path):
    cfg = {"actors": {"max_tokens": 8, "n": 8, "groups_per_batch": 4}, "learner": {"groups_per_step": 8},
           "cluster": {"learners": 1, "actors": 2}, "buffer": {"max_staleness": 0}}
    sync = [{M.SAMPLES: 64, M.TRAIN_S: 0.032, M.WS_PUBLISH_S: 0.005,
             M.GEN_BATCHES: [[0.01 + 0.002 * k, k] for k in (4, 5, 6)]} for _ in range(10)]
    _write_run(tmp_path / "sync", cfg, sync)
    # s = 0 run, 1 learner, 2 actors: a step every 0.1 s, of which 0.04 s waiting for the actors
    s0 = [{M.TIME: 100 + 0.1 * i, M.WAIT_S: 0.04, M.WS_PUBLISH_S: 0.006, M.SAMPLES: 64} for i in range(20)]
    per_step = {"learner-0": 0.05, "actor-0": 0.03, "actor-1": 0.03, "ingest": 0.004, "redis": 0.002,
                "launcher": 0.001, "other": 0.002}
    cpu_lines = [{"time": 100 + 0.1 * i, "cores": 2, "cpu": {k: v * i for k, v in per_step.items()}} for i in range(20)]
    _write_run(tmp_path / "s0", cfg, s0, cpu_lines)
    return cfg, s0, cpu_lines


def test_calibration_recovers_the_costs_of_synthetic_runs(tmp_path):
    from experiments.simulator.calibration import calibrate, calibration_for

    cfg, s0, cpu_lines = _synthetic_runs(tmp_path)
    c = calibrate(tmp_path / "sync", [tmp_path / "s0"])
    got = calibration_for(c, 1)
    gen = 0.01 + 0.002 * 5  # at the mean length
    want = {"gen_batch_s": 0.01, "gen_step_s": 0.002, "train_sample_s": 0.0005, "cores": 2, "publish_s": 0.006,
            "load_s": 0.03 - gen, "system_batch_s": 0.003, "background_cores": 0.03,
            "train_step_s": 0.05 - 0.032 - 0.006, "learner_latency_s": 0.06 - 0.05, "learner_comm_s": 0.0}
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert calibration_for(c, 4) == got  # nearest learner count below
    with pytest.raises(ValueError, match="max_staleness=0"):
        _write_run(tmp_path / "s2", {**cfg, "buffer": {"max_staleness": 2}}, s0, cpu_lines)
        calibrate(tmp_path / "sync", [tmp_path / "s2"])


def test_validate_command_writes_rows_and_plot(tmp_path, capsys):
    import json

    from experiments.simulate import main

    cfg, _, _ = _synthetic_runs(tmp_path)
    # a "measured" s = 2 run: 8 steps of 64 samples every 0.08 s
    s2 = [{M.TIME: 200 + 0.08 * i, M.SAMPLES: 64, M.STALENESS_HIST: [0, 8, 56]} for i in range(8)]
    _write_run(tmp_path / "s2", {**cfg, "buffer": {"max_staleness": 2}}, s2)
    assert main(["--sync-run", str(tmp_path / "sync"), "--s0-run", str(tmp_path / "s0"), "--validate",
                 str(tmp_path / "s2"), "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "validation.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["measured"] == pytest.approx(64 / 0.08)
    assert rows[0]["measured_staleness"] == pytest.approx([0, 1 / 8, 7 / 8])
    assert rows[0]["error"] == pytest.approx(rows[0]["predicted"] / rows[0]["measured"] - 1)
    assert (tmp_path / "out" / "simulator_validation.png").stat().st_size > 0
    assert "| 2/1 | 2 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--set", "no_such_field=1"])


def test_stream_actor_with_equal_lengths_is_the_batch_schedule():
    """Equal lengths: a streaming actor's groups all end on the same engine step, so with room for one
    batch in flight it leases, generates and sends exactly as the batch actor (the closed form above)."""
    r = simulate(SimConfig(actors=1, mode="sync", actor_mode="stream", **BASE))
    gen = 0.01 + 5 * 0.002
    assert r.samples_per_s == pytest.approx(64 / (2 * gen + 64 * 0.0005 + 0.005), rel=1e-9)
    a = simulate(SimConfig(actors=3, mode="sync", actor_mode="stream", max_staleness=3, **BASE))
    b = simulate(SimConfig(actors=3, mode="async", actor_mode="stream", max_staleness=0, **BASE))
    assert a.step_end_times == b.step_end_times and a.staleness_hist == b.staleness_hist == [60 * 64]


def test_stream_actor_does_not_wait_for_the_longest_sample():
    """Long-tailed lengths, generation-bound: the batch actor's 32 rows last as long as the longest sample,
    the streaming actor refills a group's slots as the group ends (engine.in_flight() counts a group's samples
    until its last one ends, so that is when it has room): 1.6x the samples per second here, and its
    groups leased early but finished late carry versions no newer (staleness within the bound)."""
    kw = {**BASE, "len_mean": 100, "max_tokens": 1024, "train_sample_s": 1e-5, "len_sigma": 1.0}
    batch = simulate(SimConfig(actors=1, max_staleness=8, actor_mode="batch", **kw))
    stream = simulate(SimConfig(actors=1, max_staleness=8, actor_mode="stream", **kw))
    assert stream.samples_per_s > 1.4 * batch.samples_per_s
    assert sum(stream.staleness_hist) == 60 * 64 and len(stream.staleness_hist) == 9
    assert sum(k * x for k, x in enumerate(stream.staleness_hist)) >= sum(k * x for k, x in enumerate(batch.staleness_hist))


def test_counting_running_sequences_keeps_the_engine_fuller():
    """inflight_count=running (actors.inflight_count): the cap counts the rows still decoding, not every sample
    of a group until it is sent, so with long tails and no binding admission an actor holds more leases, its
    engine steps more rows (never above the cap), and, generation-bound, it produces more; with equal lengths
    a group's samples end together and the two counts are one schedule."""
    kw = {**BASE, "len_mean": 100, "max_tokens": 1024, "train_sample_s": 1e-5, "len_sigma": 1.0}
    leased, running = (simulate(SimConfig(actors=1, max_staleness=1000, actor_mode="stream", inflight_seqs=64,
                                          inflight_count=k, **kw)) for k in ("leased", "running"))
    assert leased.leased_inflight <= 64 and running.leased_inflight > 64
    assert leased.running < running.running <= 64
    assert running.samples_per_s > 1.2 * leased.samples_per_s
    even = [simulate(SimConfig(actors=1, max_staleness=4, actor_mode="stream", inflight_seqs=64, inflight_count=k,
                               **BASE)) for k in ("leased", "running")]
    assert even[0].step_end_times == even[1].step_end_times
    with pytest.raises(ValueError, match="inflight_count"):
        SimConfig(actor_mode="stream", inflight_count="rows", **BASE)


@pytest.mark.parametrize("s", [1, 4])
def test_stream_actors_are_bounded_and_learner_bound_with_enough_actors(s):
    c = SimConfig(actors=8, mode="async", max_staleness=s, actor_mode="stream", inflight_seqs=64, **BASE)
    r = simulate(c)
    assert len(r.staleness_hist) == s + 1 and sum(r.staleness_hist) == c.steps * 64
    assert r.staleness_hist[s] > 0.9 * c.steps * 64
    assert r.samples_per_s == pytest.approx(64 / (64 * 0.0005 + 0.005), rel=0.01)


def test_stream_actors_abort_groups_too_stale_to_train():
    """actors.abort_stale in the model: with long tails at s=1, groups that outlive s versions in flight are
    aborted (counted as drops, their rows and admission slots freed for groups that can be trained), which
    raises throughput; without long tails nothing is ever too stale in flight, and the schedule is unchanged."""
    kw = {**BASE, "len_mean": 16, "len_sigma": 1.2, "max_tokens": 320, "gen_step_s": 0.012, "gen_batch_s": 0.002,
          "train_sample_s": 0.002, "groups_per_step": 16, "n": 8, "groups_per_batch": 16}
    on, off = (simulate(SimConfig(actors=3, max_staleness=1, actor_mode="stream", inflight_seqs=512,
                                  abort_stale=ab, **kw)) for ab in (True, False))
    assert on.aborted > 0 and off.aborted == 0
    assert on.samples_per_s > 1.03 * off.samples_per_s
    assert len(on.staleness_hist) == 2 and sum(on.staleness_hist) == on.config["steps"] * 128
    even = [simulate(SimConfig(actors=3, max_staleness=1, actor_mode="stream", inflight_seqs=64, abort_stale=ab,
                               **BASE)) for ab in (True, False)]
    assert even[0].aborted == 0 and even[0].step_end_times == even[1].step_end_times


def test_admission_from_the_actors_weights_stops_doomed_leases_when_weights_lag():
    """buffer.admission in the model, with the weights reaching actors 0.1 s after the learner's version moves
    (overlapped publication; SmolLM2-like costs). Counted from the learner's version (AReaL's rule), actors still
    holding the previous weights lease groups that can only be trained too stale: at s=1 about half of all
    groups are dropped, as measured on the H200 (47% and 44%, 2026-12-03). Counted from the actor's weights they
    wait for the new weights instead: few drops, no less throughput. Without a lag both rules are one."""
    kw = {**BASE, "steps": 120, "len_mean": 16, "len_sigma": 0.75, "max_tokens": 320, "gen_step_s": 0.0037,
          "gen_batch_s": 0.01, "train_step_s": 0.19, "train_sample_s": 0.0, "publish_s": 0.015,
          "groups_per_step": 16, "n": 8, "groups_per_batch": 16, "actor_mode": "stream", "inflight_seqs": 512}
    for s in (1, 2):
        learner, actor = (simulate(SimConfig(actors=3, max_staleness=s, weights_lag_s=0.1, admission=a, **kw))
                          for a in ("learner", "actor"))
        assert learner.dropped_frac > (0.3 if s == 1 else 0.2) and actor.dropped_frac < 0.1, (s, learner, actor)
        assert actor.samples_per_s > 0.98 * learner.samples_per_s
        same = [simulate(SimConfig(actors=3, max_staleness=s, admission=a, **kw)) for a in ("learner", "actor")]
        assert same[0].step_end_times == same[1].step_end_times
    with pytest.raises(ValueError, match="admission"):
        SimConfig(admission="both")
    with pytest.raises(ValueError, match="weights_lag_s"):
        SimConfig(weights_lag_s=-1)


def test_stream_config_checks():
    with pytest.raises(ValueError, match="actor_mode"):
        SimConfig(actor_mode="continuous")
    with pytest.raises(ValueError, match="inflight_seqs"):
        SimConfig(actor_mode="stream", inflight_seqs=4, n=8)
    assert SimConfig(groups_per_batch=4, n=8).inflight_target == 32
    from experiments.simulator.cli import _overrides

    assert _overrides(["abort_stale=false", "actors=3"]) == {"abort_stale": False, "actors": 3}  # not bool("false")
    with pytest.raises(SystemExit, match="true or false"):
        _overrides(["abort_stale=maybe"])


def _gpu_run(d, s: int, rng, steps: int = 40, wait=lambda mx: 0.09 + 0.003 * mx, train: float = 0.19):
    """A cluster.start run with vLLM actors as the GPU calibration reads it: per step the longest and mean
    response, the learner's wait, train, publish and the publication's end to end time."""
    from learner import metric_names as M

    cfg = {"buffer": {"max_staleness": s}, "cluster": {"actors": 3, "learners": 1},
           "learner": {"groups_per_step": 16}, "actors": {"engine": "vllm", "n": 8, "max_tokens": 320,
                                                         "max_inflight_seqs": 512, "groups_per_batch": 16}}
    ms, t = [], 0.0
    for k in range(steps):
        mean = rng.uniform(14, 20)
        mx = mean * rng.uniform(3.5, 5.5)
        w = wait(mx)
        t += w + train + 0.014
        ms.append({M.STEP: k, M.TIME: t, M.RESPONSE_LEN_MAX: mx, M.RESPONSE_LEN_MEAN: mean, M.WAIT_S: w,
                   M.TRAIN_S: train, M.PUBLISH_S: 0.014, M.WS_PUBLISH_S: 0.04, M.SAMPLES: 128,
                   M.STALENESS_HIST: [128] + [0] * s, M.REWARD_MEAN: 0.1})
    _write_run(d, cfg, ms)


def test_gpu_calibration_reads_the_lockstep_line_and_the_contention():
    """calibrate_gpu: from lockstep runs, generation per step is a line in the step's longest response (per
    engine step; per step, less the weights' lag), lengths a log-normal with the runs' mean and longest-to-mean
    ratio; an async run adds the learner's slow-down (its step against lockstep's). Costs recovered exactly."""
    import tempfile
    from pathlib import Path

    from experiments.simulator.calibration import calibrate_gpu
    from experiments.simulator.runs import measured

    rng = random.Random(1)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        _gpu_run(d / "s0", 0, rng)
        _gpu_run(d / "s1", 1, rng, train=0.228)
        f = calibrate_gpu([d / "s0"])
        # the step's fixed 0.05 s beyond the lag: one engine step's prefill, the rest the groups' way to the learner
        assert f["gen_step_s"] == pytest.approx(0.003, rel=1e-6) and f["gen_batch_s"] == pytest.approx(0.003, rel=1e-6)
        assert f["delivery_s"] == pytest.approx(0.047, rel=1e-6)
        assert f["weights_lag_s"] == 0.04 and f["train_step_s"] == pytest.approx(0.19) and f["publish_s"] == 0.014
        assert f["gen_step_seq_s"] == 0.0   # no heartbeats: the engine's step is the lockstep fit's, fixed
        assert 14 < f["len_mean"] < 20 and 0.3 < f["len_sigma"] < 1.2 and f["actor_mode"] == "stream"
        with_async = calibrate_gpu([d / "s0"], [d / "s1"])
        assert with_async["learner_contention"] == pytest.approx(0.2, rel=1e-6) and with_async["actor_contention"] >= 0
        # with the actors' heartbeats (step against leased sequences in flight) the engine line replaces the factor
        _status(d / "s0", [(50, 3.0)])
        _status(d / "s1", [(450, 19.0)])
        line = calibrate_gpu([d / "s0"], [d / "s1"])
        assert line["gen_step_s"] == pytest.approx(0.001) and line["gen_step_seq_s"] == pytest.approx(4e-5)
        assert "actor_contention" not in line and line["gen_batch_s"] == pytest.approx(0.003, rel=1e-6)
        assert measured(d / "s1")["admission"] == "learner"   # a config from before buffer.admission
        with pytest.raises(ValueError, match="max_staleness=0"):
            calibrate_gpu([d / "s1"])


STREAM = {**{k: v for k, v in BASE.items() if k != "len_mean"}, "steps": 40, "max_tokens": 320, "gen_step_s": 0.003, "gen_batch_s": 0.003, "train_step_s": 0.19,
          "train_sample_s": 0.0, "publish_s": 0.014, "groups_per_step": 16, "n": 8, "groups_per_batch": 16,
          "actor_mode": "stream", "inflight_seqs": 512}


def test_delivery_is_latency_that_takes_no_engine_time():
    """delivery_s: in lockstep (s=0) each step waits for it once more; with room to run ahead (s=4) the engine
    keeps stepping meanwhile and the learner barely notices."""
    def interval(s, delivery):
        r = simulate(SimConfig(actors=1, max_staleness=s, delivery_s=delivery, len_mean=16, **STREAM))
        t = r.step_end_times
        return (t[-1] - t[5]) / (len(t) - 6)

    assert interval(0, 0.05) - interval(0, 0.0) == pytest.approx(0.05, rel=0.1)
    assert abs(interval(4, 0.05) - interval(4, 0.0)) < 0.01
    with pytest.raises(ValueError, match="delivery_s"):
        SimConfig(delivery_s=0.05)   # a batch actor's groups reach the buffer through system_batch_s


def test_a_length_schedule_changes_lengths_with_the_training_step():
    """len_schedule: long responses under the first versions, short after; one entry is the fixed lengths."""
    one = simulate(SimConfig(actors=1, max_staleness=1, len_mean=16, len_sigma=0.5, **STREAM))
    same = simulate(SimConfig(actors=1, max_staleness=1, len_schedule=((16, 0.5),), **STREAM))
    assert one.step_end_times == same.step_end_times
    sched = simulate(SimConfig(actors=1, max_staleness=0, len_schedule=((200, 0.0), (10, 0.0)), len_window=10,
                               **STREAM))
    t = sched.step_end_times
    early, late = (t[9] - t[1]) / 8, (t[-1] - t[12]) / (len(t) - 13)
    assert early - late == pytest.approx(190 * 0.003, rel=0.1)   # 190 more decode steps per lockstep step
    with pytest.raises(ValueError, match="len_schedule"):
        SimConfig(len_schedule=((0, 0.1),))


def test_sharing_the_device_slows_both_sides():
    kw = {**BASE, "steps": 80, "len_mean": 16, "len_sigma": 0.6, "max_tokens": 320, "gen_step_s": 0.003,
          "gen_batch_s": 0.05, "train_step_s": 0.19, "train_sample_s": 0.0, "publish_s": 0.014, "groups_per_step": 16,
          "n": 8, "groups_per_batch": 16, "actor_mode": "stream", "inflight_seqs": 512}
    alone = simulate(SimConfig(actors=3, max_staleness=2, **kw))
    learner = simulate(SimConfig(actors=3, max_staleness=2, learner_contention=0.5, **kw))
    actors = simulate(SimConfig(actors=1, max_staleness=2, actor_contention=3.0, **{**kw, "inflight_seqs": 128}))
    actors_alone = simulate(SimConfig(actors=1, max_staleness=2, **{**kw, "inflight_seqs": 128}))
    assert learner.samples_per_s < 0.9 * alone.samples_per_s
    assert actors.samples_per_s < actors_alone.samples_per_s
    sync = [simulate(SimConfig(actors=3, mode="sync", learner_contention=c, actor_contention=c, **kw))
            for c in (0.0, 1.0)]
    assert sync[0].step_end_times == sync[1].step_end_times   # lockstep: nothing overlaps, nothing is slowed


def _status(d, beats):
    """The launcher's status.json with one actor heartbeat per (leased sequences, step ms) over 1000 steps."""
    import json

    members = {f"actor-{i}": {"engine_steps": 1000, "step_s": ms, "leased_seqs": round(leased * 1000), "groups": 1,
                              "busy_s": 1.0} for i, (leased, ms) in enumerate(beats)}
    (d / "status.json").write_text(json.dumps({"members": members}))


def test_engine_step_is_a_line_in_the_sequences_in_flight():
    """engine_step_s: fixed + per running row + per leased sequence; the simulator's mean engine step is that
    line at its mean leased sequences (no prefill, no contention), and more room ahead (s) fills the engine,
    slowing each step."""
    from experiments.simulator.model import engine_step_s

    c = SimConfig(gen_step_s=0.001, gen_step_row_s=1e-5, gen_step_seq_s=4e-5)
    assert engine_step_s(c, 10, 80) == pytest.approx(0.001 + 1e-4 + 3.2e-3)
    kw = {**STREAM, "gen_batch_s": 0.0, "gen_step_s": 0.001, "gen_step_seq_s": 4e-5, "len_mean": 16, "len_sigma": 0.8}
    lo, hi = (simulate(SimConfig(actors=1, max_staleness=s, **kw)) for s in (0, 8))
    for r in (lo, hi):
        assert r.engine_step_ms == pytest.approx(1e3 * (0.001 + 4e-5 * r.leased_inflight), rel=1e-9)
        assert r.leased_inflight <= 512   # room counts whole groups: never more leased than inflight_seqs
        # a group's ended samples keep their leased slots but leave the batch: fewer rows run than are leased
        assert 0 < r.running < r.leased_inflight
    assert hi.leased_inflight > 3 * lo.leased_inflight and hi.engine_step_ms > 2 * lo.engine_step_ms
    with pytest.raises(ValueError, match="gen_step_seq_s"):
        SimConfig(gen_step_seq_s=-1e-5)


def test_engine_line_fits_the_heartbeats_or_falls_back(tmp_path):
    """engine_line: the least-squares line through (leased in flight, mean step) of every actor's heartbeat;
    heartbeats that do not spread over MIN_LEASED_SPREAD sequences (or none) give the lockstep step, flat."""
    from experiments.simulator.calibration import engine_line, MIN_LEASED_SPREAD

    for name, beats in (("a", [(50, 3.0), (150, 7.0)]), ("b", [(500, 21.0)]), ("c", [(52, 5.0)]), ("d", [])):
        (tmp_path / name).mkdir()
        if beats:
            _status(tmp_path / name, beats)
    assert engine_line([tmp_path / "a", tmp_path / "b"], 0.003) == pytest.approx((0.001, 4e-5))
    assert engine_line([tmp_path / "a"], 0.003) == pytest.approx((0.001, 4e-5))
    assert engine_line([tmp_path / "c", tmp_path / "d"], 0.003) == (0.003, 0.0)
    _status(tmp_path / "c", [(50 + MIN_LEASED_SPREAD - 1, 3.0), (50, 2.5)])
    assert engine_line([tmp_path / "c"], 0.003) == (0.003, 0.0)


def test_measured_drops_count_the_learners_and_the_actors():
    """dropped_frac: the learner's drops per step plus the actors' running total of aborts, over groups trained
    (samples / n) plus dropped."""
    from experiments.simulator.runs import dropped_frac

    ms = [{M.SAMPLES: 128, M.DROPPED_STALE: 2, M.ABORTED_STALE: 1}, {M.SAMPLES: 128, M.DROPPED_STALE: 1,
                                                                      M.ABORTED_STALE: 5}]
    assert dropped_frac(ms, 8) == pytest.approx(8 / (32 + 8))
    assert dropped_frac([{M.SAMPLES: 64}], 8) == 0.0


def test_a_smaller_lease_pays_its_share_of_the_prefill():
    """stream: gen_batch_s is a full lease's (groups_per_batch groups, as lockstep measures it); at s=0 this actor
    may lease only groups_per_step = half of that, and its step pays half the prefill."""
    kw = {**BASE, "groups_per_step": 4, "groups_per_batch": 8, "inflight_seqs": 64}
    r = simulate(SimConfig(actors=1, mode="sync", actor_mode="stream", **kw))
    assert r.samples_per_s == pytest.approx(32 / (0.01 * 4 / 8 + 5 * 0.002 + 32 * 0.0005 + 0.005), rel=1e-9)


def test_a_groups_samples_share_their_prompts_length():
    """len_group_share: that share of the log-variance is one draw per group, so a group's samples end closer
    together and its slots idle less (slot_use rises with it); group_share finds the share back from the slot use
    it gives, and is 0 when independent samples already use the slots as well as measured."""
    from experiments.simulator.lengths import group_share, slot_use

    rng = random.Random(0)
    groups = [response_lengths(rng, 8, 40, 0.8, 4096, share) for share in (0.0, 0.9) for _ in range(400)]
    spread = [statistics.fmean(statistics.pstdev([math.log(x) for x in g]) for g in half)
              for half in (groups[:400], groups[400:])]
    assert spread[1] < 0.5 * spread[0]
    assert statistics.fmean(x for g in groups[400:] for x in g) == pytest.approx(40, rel=0.1)   # the same mean
    sched = ((50.0, 5.0), (20.0, 3.0))
    uses = [slot_use(sched, 16, 8, 320, share) for share in (0.0, 0.3, 0.6)]
    assert uses[0] < uses[1] < uses[2] < 1
    assert group_share(sched, uses[1], 16, 8, 320) == pytest.approx(0.3, abs=0.01)
    assert group_share(sched, 0.9 * uses[0], 16, 8, 320) == 0.0
    with pytest.raises(ValueError, match="len_group_share"):
        SimConfig(len_group_share=1.0)


def test_spread_and_actor_loop_come_from_runs_that_lost_nothing(tmp_path):
    """length_spread: the ratio of longest to mean response per window, from runs without drops (a run with drops
    trains without its longest groups); actor_loop_s: the actors' busy time outside engine steps per version."""
    import json

    from experiments.simulator.runs import actor_loop_s, LEN_WINDOW, length_spread

    rng = random.Random(2)
    _gpu_run(tmp_path / "a", 0, rng, steps=2 * LEN_WINDOW)
    _gpu_run(tmp_path / "b", 8, rng, steps=LEN_WINDOW)
    ms = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    ms[0][M.DROPPED_STALE] = 3
    (tmp_path / "b" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in ms))
    spread = length_spread([tmp_path / "a", tmp_path / "b"])
    a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert spread == pytest.approx([statistics.fmean(m[M.RESPONSE_LEN_MAX] / m[M.RESPONSE_LEN_MEAN] for m in w)
                                    for w in (a[:LEN_WINDOW], a[LEN_WINDOW:])])
    members = {"actor-0": {"engine_steps": 100, "step_s": 2.0, "busy_s": 3.0, "version": 10, "leased_seqs": 1},
               "actor-1": {"engine_steps": 100, "step_s": 1.0, "busy_s": 3.0, "version": 30, "leased_seqs": 1}}
    (tmp_path / "a" / "status.json").write_text(json.dumps({"members": members}))
    assert actor_loop_s([tmp_path / "a", tmp_path / "b"]) == pytest.approx(3.0 / 40)
    assert actor_loop_s([tmp_path / "b"]) == 0.0


def _isotonic(y):
    """The least-squares non-decreasing fit of y (equal weights) by its min-max formula, in numpy:
    fit[i] = max over j <= i of min over k >= i of mean(y[j..k])."""
    import numpy as np

    y = np.asarray(y, float)
    c = np.concatenate([[0.0], np.cumsum(y)])
    n = len(y)
    mean = np.full((n, n), np.nan)
    for j in range(n):
        mean[j, j:] = (c[j + 1:] - c[j]) / np.arange(1, n - j + 1)
    return np.array([max(np.nanmin(mean[j, i:]) for j in range(i + 1)) for i in range(n)])


def test_monotone_knots_are_the_isotonic_fit_and_the_curve_is_np_interp():
    """monotone_knots: with no spread rule, each knot is the mean of a block of the isotonic (least-squares
    non-decreasing) fit; knots closer than min_spread pool. step_curve_s: np.interp between the knots, the end
    segments' lines beyond them, never below 0."""
    import numpy as np

    from experiments.simulator.calibration import monotone_knots
    from experiments.simulator.model import step_curve_s

    rng = np.random.default_rng(3)
    for _ in range(200):
        x = np.sort(rng.choice(np.arange(600), size=rng.integers(1, 8), replace=False)).astype(float)
        y = rng.uniform(0.002, 0.03, size=len(x))
        knots = monotone_knots(list(zip(x, y)), min_spread=0)
        fit = _isotonic(y)
        blocks = np.unique(np.round(fit, 12))   # the fit's blocks: runs of one value (random y: no two equal)
        kx, ky = np.array(knots).T
        assert ky == pytest.approx(blocks, rel=1e-9)
        assert kx == pytest.approx([x[np.isclose(fit, v, rtol=1e-9)].mean() for v in blocks], rel=1e-9)
        spaced = monotone_knots(list(zip(x, y)), min_spread=20)
        assert np.all(np.diff([k[0] for k in spaced]) >= 20) and np.all(np.diff([k[1] for k in spaced]) > 0)
        q = rng.uniform(-100, 700, size=20)
        got = [step_curve_s(knots, v) for v in q]
        if len(knots) == 1:
            assert got == [knots[0][1]] * 20
            continue
        inside = (q >= kx[0]) & (q <= kx[-1])
        assert np.array(got)[inside] == pytest.approx(np.interp(q[inside], kx, ky), rel=1e-9, abs=1e-15)
        lo, hi = np.polyfit(kx[:2], ky[:2], 1), np.polyfit(kx[-2:], ky[-2:], 1)
        want = np.where(q < kx[0], np.polyval(lo, q), np.polyval(hi, q))
        assert np.array(got)[~inside] == pytest.approx(np.maximum(want[~inside], 0.0), rel=1e-6, abs=1e-12)
    # heartbeats 6 sequences apart pool (noise, not a slope), and so does a later step below an earlier one
    got = monotone_knots([(50, 3.0), (56, 3.2), (300, 9.0), (480, 21.0), (440, 23.0)])
    assert [v for k in got for v in k] == pytest.approx([53, 3.1, 300, 9.0, 460, 22.0])


def test_a_two_knot_curve_is_the_engine_line():
    """gen_step_curve through two points of the line gen_step_s + gen_step_seq_s x leased is that line: the same
    schedule; knots must have leased increasing."""
    from experiments.simulator.model import engine_step_s

    kw = {**STREAM, "gen_batch_s": 0.0, "len_mean": 16, "len_sigma": 0.8}
    line = SimConfig(actors=1, max_staleness=4, gen_step_seq_s=4e-5, **{**kw, "gen_step_s": 0.001})
    curve = SimConfig(actors=1, max_staleness=4, gen_step_curve=((50, 0.003), (500, 0.021)), **{**kw, "gen_step_s": 0.05})
    assert engine_step_s(curve, 3, 275) == pytest.approx(engine_step_s(line, 3, 275))
    a, b = simulate(line), simulate(curve)
    assert a.step_end_times == pytest.approx(b.step_end_times, rel=1e-9)
    assert a.leased_inflight == b.leased_inflight
    with pytest.raises(ValueError, match="gen_step_curve"):
        SimConfig(gen_step_curve=((50, 0.003), (50, 0.004)))


def test_leave_one_setting_out_never_calibrates_on_the_predicted_bound(tmp_path, capsys):
    """validate_loo: each run is predicted from the runs at other bounds only (an s=8 run from neither the other
    seed nor another correction at 8); an s=0 run takes the lockstep costs from the other s=0 run (labelled), and
    with no other s=0 run there is nothing to take them from. The curve's knots come from those runs' heartbeats."""
    import json

    from experiments.simulate import main
    from experiments.simulator.validation import loo_calibration, validate_loo

    rng = random.Random(4)
    runs = {name: tmp_path / name for name in ("s0a", "s0b", "s2", "s8a", "s8b")}
    beats = {"s0a": (50, 3.0), "s0b": (56, 3.2), "s2": (150, 6.0), "s8a": (512, 21.0), "s8b": (500, 18.0)}
    for name, d in runs.items():
        _gpu_run(d, int(name[1]), rng, steps=20)
        _status(d, [beats[name]])
    names = [str(d) for d in runs.values()]
    assert main(["--validate-loo", *names, "--out", str(tmp_path / "out")]) == 0
    rows = {Path(r["run"]).name: r for r in json.loads((tmp_path / "out" / "validation.json").read_text())["rows"]}
    assert rows["s8a"]["calibrated_on"] == ["s0a", "s0b", "s2"] and rows["s8a"]["note"] == ""
    assert rows["s2"]["calibrated_on"] == ["s0a", "s0b", "s8a", "s8b"]
    assert rows["s0a"]["calibrated_on"] == ["s2", "s8a", "s8b", "s0b"] and "other s=0 run" in rows["s0a"]["note"]
    assert [k for k, _ in rows["s8b"]["calibration"]["gen_step_curve"]] == pytest.approx([53, 150])
    assert all(r["predicted"] > 0 for r in rows.values()) and "| s8b | 3/1 | 8 |" in capsys.readouterr().out
    assert (tmp_path / "out" / "simulator_validation_loo.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no other s=0 run"):
        loo_calibration(0, names[:1] + names[2:])
    # one machine's sweep with one lockstep seed: the async runs are predicted from it, it is named unpredicted
    assert main(["--validate-loo", *names[:1], *names[2:], "--out", str(tmp_path / "lone")]) == 0
    rows = {Path(r["run"]).name for r in json.loads((tmp_path / "lone" / "validation.json").read_text())["rows"]}
    assert rows == {"s2", "s8a", "s8b"} and f"{names[0]}: not predicted: the only s=0 run" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no other s=0 run"):  # no lockstep run at all: nothing to calibrate from
        validate_loo(names[2:])


@pytest.mark.parametrize("argv", [["--actors", "0"], ["--cores", "0"], ["--max-staleness", "-1"], ["--steps", "0"],
                                  ["--s0-run", "x"], ["--sync-run", "/nonexistent"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    """Values SimConfig would reject with a traceback, or calibration runs that would be silently ignored."""
    with pytest.raises(SystemExit) as e:
        sim_main(argv)
    assert e.value.code == 2 and "error: " in capsys.readouterr().err
    with pytest.raises(SystemExit, match="gen_step_seq_s expects a float"):
        sim_main(["--set", "gen_step_seq_s=abc"])


def test_a_calibration_run_too_short_is_named_not_a_traceback(tmp_path, capsys):
    """A sync run of 4 steps (a smoke sweep's) as --sync-run was a ValueError traceback naming no run."""
    import json

    _synthetic_runs(tmp_path)
    ms = (tmp_path / "sync" / "metrics.jsonl").read_text().splitlines()[:4]
    (tmp_path / "sync" / "metrics.jsonl").write_text("".join(json.dumps(json.loads(x)) + "\n" for x in ms))
    with pytest.raises(SystemExit) as e:
        sim_main(["--sync-run", str(tmp_path / "sync"), "--s0-run", str(tmp_path / "s0"), "--actors", "2",
                  "--learners", "1", "--steps", "5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {tmp_path / 'sync'}: 4 steps: calibration needs at least 6" in err, err


def test_trained_share_of_generated_tokens_is_what_drops_did_not_waste():
    """SimResult.trained_share: tokens of trained groups over engine rows. Lockstep trains everything it
    generates (all but the groups in flight when the run ends); at s=1 with long tails the aborted and dropped
    groups' tokens are generated for nothing, and aborting them in flight wastes fewer rows than letting
    them run to the end."""
    kw = {**BASE, "len_mean": 16, "len_sigma": 1.2, "max_tokens": 320, "gen_step_s": 0.012, "gen_batch_s": 0.002,
          "train_sample_s": 0.002, "groups_per_step": 16, "n": 8, "groups_per_batch": 16}
    lock = simulate(SimConfig(actors=3, max_staleness=0, actor_mode="stream", inflight_seqs=512, **kw))
    on, off = (simulate(SimConfig(actors=3, max_staleness=1, actor_mode="stream", inflight_seqs=512,
                                  abort_stale=ab, **kw)) for ab in (True, False))
    assert 0.9 < lock.trained_share <= 1.0
    assert off.trained_share < on.trained_share < lock.trained_share
    assert math.isnan(simulate(SimConfig(**BASE)).trained_share)   # batch actors: rows not simulated


def test_measured_trained_share_reads_the_heartbeats_rows(tmp_path):
    """trained_share(run): each step's samples x mean response over the actors' `running_seqs`; None where an
    engine did not count its rows on every step."""
    import json

    from experiments.sweep.analysis import trained_share

    ms = [{M.SAMPLES: 128, M.RESPONSE_LEN_MEAN: 20.0}, {M.SAMPLES: 128, M.RESPONSE_LEN_MEAN: 30.0}]
    beat = {"engine_steps": 100, "occupied_steps": 100, "running_seqs": 4000}
    (tmp_path / "status.json").write_text(json.dumps({"members": {"actor-0": beat, "actor-1": beat,
                                                                  "learner-0": {}}}))
    assert trained_share(tmp_path, ms) == pytest.approx(128 * 50 / 8000)
    (tmp_path / "status.json").write_text(json.dumps({"members": {"actor-0": {**beat, "occupied_steps": 99}}}))
    assert trained_share(tmp_path, ms) is None
    assert trained_share(tmp_path / "missing", ms) is None


def test_tail_factor_is_the_one_whose_simulated_waste_is_the_measured(tmp_path):
    """fit_tail_factor: the async runs' generated tails, widened from the lossless runs' until the simulated
    trained share of generated tokens is the measured one. A run whose heartbeat says it trained what the
    simulator gives at factor 1.6 is fitted 1.6; a run that wasted nothing gives 1; without rows counted, 1."""
    import json

    from experiments.simulator.calibration import calibrate_gpu, fit_tail_factor, predict
    from experiments.simulator.runs import length_spread, measured

    rng = random.Random(5)
    d = {name: tmp_path / name for name in ("s0a", "s0b", "s1")}
    for name, run in d.items():
        _gpu_run(run, int(name[1]), rng, steps=30)
        _status(run, [{"s0a": (50, 3.0), "s0b": (56, 3.2), "s1": (150, 6.0)}[name]])
    calib = {"base": calibrate_gpu([d["s0a"], d["s0b"]], [d["s1"]]), "by_learners": {},
             "len_ratios": length_spread([d["s0a"], d["s0b"]])}
    m = measured(d["s1"])
    shares = {f: predict({**calib, "tail_factor": f}, m).trained_share for f in (1.0, 1.6)}
    assert shares[1.6] < shares[1.0] < 1   # wider tails: more of the generation aborted or dropped

    def heartbeat_says(share):
        ms = [json.loads(x) for x in (d["s1"] / "metrics.jsonl").read_text().splitlines()]
        trained = sum(x[M.SAMPLES] * x[M.RESPONSE_LEN_MEAN] for x in ms)
        beat = {"engine_steps": 1000, "occupied_steps": 1000, "step_s": 6.0, "leased_seqs": 150_000,
                "groups": 1, "busy_s": 1.0, "running_seqs": trained / share, "waiting_seqs": 0, "kv_usage_max": 0.1}
        (d["s1"] / "status.json").write_text(json.dumps({"members": {"actor-0": beat}}))

    heartbeat_says(shares[1.6])
    assert fit_tail_factor(calib, [d["s1"]]) == pytest.approx(1.6, abs=0.1)
    heartbeat_says(1.0)
    assert fit_tail_factor(calib, [d["s1"]]) == 1.0
    _status(d["s1"], [(150, 6.0)])   # no rows counted
    assert fit_tail_factor(calib, [d["s1"], d["s0a"]]) == 1.0


def test_a_lockstep_prediction_takes_its_own_tails_an_async_one_the_calibrations(tmp_path):
    """_predict: an s=0 run trains everything it generates and each step waits for its longest sample, so its
    own longest-to-mean ratio is its workload: the calibration's lossless ratio (and the async tail factor) do
    not move it. An async run's own ratio is short of what it generated (drops): it takes the calibration's."""
    from experiments.simulator.calibration import calibrate_gpu, predict
    from experiments.simulator.runs import length_spread, measured

    rng = random.Random(6)
    d = {name: tmp_path / name for name in ("s0a", "s0b", "s2")}
    for name, run in d.items():
        _gpu_run(run, int(name[1]), rng, steps=20)
        _status(run, [{"s0a": (50, 3.0), "s0b": (56, 3.2), "s2": (150, 6.0)}[name]])
    calib = {"base": calibrate_gpu([d["s0b"]], [d["s2"]]), "by_learners": {}, "len_ratios": length_spread([d["s0b"]])}
    wide = {**calib, "len_ratios": [x + 3 for x in calib["len_ratios"]], "tail_factor": 2.0}
    lock, asyn = measured(d["s0a"]), measured(d["s2"])
    assert predict(wide, lock).samples_per_s == predict(calib, lock).samples_per_s
    assert predict(wide, asyn).samples_per_s != predict(calib, asyn).samples_per_s
