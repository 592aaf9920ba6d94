"""The whole system from its one command: real Redis, Ray, ZeroMQ, gloo, processes."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray_shared

from learner import metric_names as M

START_TIMEOUT_S = 300  # generous for a loaded 2-core CI machine; a healthy run takes ~20 s


def start(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cluster.start", "--run-dir", str(run_dir), *ray_shared.job_args(), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-4000:]}"
    return res


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


VAL_EVERY_S = 1.5  # the first test's evaluation cadence in seconds: a few evaluations within its 20 steps


def test_two_learners_two_actors_respect_staleness(tmp_path):
    from listening import any_off_loopback, ours_off_loopback, run_watched

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "cluster.start", "--run-dir", str(run), "--actors", "2", "--learners", "2",
           "trainer.total_steps=20", f"trainer.val_every_s={VAL_EVERY_S}"]
    res, seen, env = run_watched(cmd, run, START_TIMEOUT_S)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-4000:]}"
    # On one node nothing listens beyond loopback (README, security): neither ours (Redis, the ingest, the learner
    # group's store and gloo pairs, the weight-sync store and its groups in every member) nor the job's own Ray's
    # (gcs_server, raylet, agents, monitors, the core worker in every process: cluster.preflight ray_on_loopback)
    print("Ray's listeners:", *sorted(x for x in seen if x.owner.startswith("ray:")), sep="\n  ")
    assert not ours_off_loopback(seen), ours_off_loopback(seen)
    assert not any_off_loopback(seen), any_off_loopback(seen)
    assert any(x.owner.startswith("ray:") for x in seen), "no listener of Ray's seen: the check saw nothing of it"
    owners = {x.owner for x in seen}
    assert {"redis", "ingest", "learner-0", "learner-1", "actor-0", "actor-1"} <= owners, sorted(seen)
    # gloo's pair listeners follow the hostname's address unless told: every torch process is told lo
    for role in ("learner-0", "learner-1", "actor-0", "actor-1"):
        assert env[role] == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}, (role, env[role])
    lines = metrics(run)
    assert [m[M.STEP] for m in lines] == list(range(20))
    required = {M.STEP, M.VERSION, M.REWARD_MEAN, M.STALENESS_MEAN, M.STALENESS_MAX, M.DROPPED_STALE,
                M.SAMPLES_PER_S, M.TOKENS_PER_S, M.WS_PUBLISH_S, M.WS_JOINS}
    for m in lines:
        assert required <= m.keys() <= M.TABLE.keys(), m.keys() - M.TABLE.keys()  # every key namespaced, in the table
        assert m[M.STALENESS_MAX] <= 2, m
        assert sum(m[M.STALENESS_HIST]) == m[M.SAMPLES] == 64
        # the step's wall time is its phases plus the rest: every part measured, none negative
        parts = [m[k] for k in (M.READ_S, M.TRAIN_S, M.PUBLISH_S, M.EVAL_S, M.OTHER_S)]
        assert min(parts) >= 0 and m[M.READ_S] >= m[M.WAIT_S], m
        assert sum(parts) == pytest.approx(m[M.SAMPLES] / m[M.SAMPLES_PER_S], rel=1e-6), m
    # trainer.val_every_s: rank 0's clock decides, both ranks evaluate the same versions (a rank that did not
    # would hang the evaluation's collective); consecutive evaluations at least that far apart
    timed = [m for m in lines[:-1] if M.VAL_REWARD in m]
    assert timed, "no evaluation by the clock before the last step"
    # (the last step is evaluated whatever the clock says.) The clock counts from an evaluation's start: a line is
    # written after its evaluation, whose length varies with what the model generates and with the load (one
    # 0.3 s longer than the next brought their lines closer than the cadence), so each start is its line's time
    # less its evaluation; a few tenths of slack for the Redis calls between the evaluation's end and the line
    starts = [m[M.TIME] - m[M.EVAL_S] for m in timed]
    assert all(b - a >= VAL_EVERY_S - 0.3 for a, b in zip(starts, starts[1:])), \
        [(m[M.STEP], m[M.TIME], m[M.EVAL_S]) for m in timed]
    assert (run / "config.yaml").exists() and any((run / "tb").iterdir())
    status = json.loads((run / "status.json").read_text())
    final = status["checksums"][str(20)]
    assert set(status["members"]) == {"actor-0", "actor-1"}
    for actor, m in status["members"].items():  # after the last broadcast every actor holds the learner's weights
        assert (m["version"], m["checksum"]) == (20, final), actor
    # the exported policy is exactly the learner's final version, in a folder transformers loads
    from transformers import AutoModelForCausalLM

    from weightsync.flat import checksum

    policy = AutoModelForCausalLM.from_pretrained(run / "policy")
    assert checksum(policy.state_dict()) == final
    # Versions arrive while batches generate (counted in updates_mid_batch; how often is a matter of
    # timing), yet no group ever mixes two: swaps wait for the batch boundary.
    assert all("updates_mid_batch" in m for m in status["members"].values())
    assert all(m[M.MIXED_VERSION_GROUPS] == 0 for m in lines)
    # every process's CPU time is on record under its role (what experiments.simulate calibrates from)
    from cluster import cpu

    recorded = cpu.read(run)
    roles = {"learner-0", "learner-1", "actor-0", "actor-1", "ingest", "redis", "launcher"}
    t0 = next(x["time"] for x in recorded if roles <= x["cpu"].keys())  # every process has answered
    used, wall = cpu.used_between(recorded, t0, recorded[-1]["time"])
    assert all(used[r] > 0 for r in ("learner-0", "learner-1", "actor-0", "actor-1")), used
    assert recorded[-1]["cores"] == cpu.node_cores() and sum(used.values()) < wall * cpu.node_cores() * 1.1, used


@pytest.mark.parametrize("layout,overlap,actors", [("padded", False, 1), ("packed", True, 2)],
                         ids=["padded", "packed-overlap"])
def test_max_staleness_zero_is_on_policy(tmp_path, layout, overlap, actors):
    """s = 0: every sample comes from the learner's own weights, and every actor ends on the final version's
    checksum. One run per layout; the packed one also publishes with weightsync.overlap (the learner trains its
    next step while the actors' acks of the last version are awaited on a thread: still on policy, in sync) to two
    actors (the padded one's single actor is a process start less)."""
    run = tmp_path / "run"
    start(run, "--learners", "1", "--actors", str(actors), "max_staleness=0", "trainer.total_steps=8",
          f"learner.pack_sequences={layout == 'packed'}", f"weightsync.overlap={str(overlap).lower()}")
    lines = metrics(run)
    assert [m[M.STEP] for m in lines] == list(range(8))
    for m in lines:
        # every trained sample came from the weights the learner held at that step
        assert m[M.STALENESS_MAX] == 0 and m[M.STALENESS_HIST] == [m[M.SAMPLES]]
        assert m[M.VERSION_START_MIN] == m[M.VERSION_END_MAX] == m[M.STEP]
        assert m[M.MISMATCH_ABS] < 1e-4  # same weights: behavior and learner logprobs agree
    status = json.loads((run / "status.json").read_text())
    assert (run / "config.yaml").read_text().count(f"overlap: {str(overlap).lower()}") == 1
    assert (status["ended"]["how"], status["ended"]["exit_code"]) == ("finished", 0)  # for cluster.status, later
    # the start-up timeline: seconds after launch, in the order things happened, each process's points in its
    # own order, and at s=0 the first step trains groups an actor finished after building its engine
    t = status["startup"]
    # every actor that took part ends on the last version (one whose engine was built after the job's last step,
    # on a loaded machine, never joined: it ends on version 0 and has no first group)
    took_part = [a for a in status["members"] if f"{a}:first_group" in t]
    assert took_part, t
    for actor in took_part:
        m = status["members"][actor]
        assert (m["version"], m["checksum"]) == (8, status["checksums"]["8"]), actor
    assert list(t.values()) == sorted(t.values()) and t["launcher:launched"] == 0.0, t
    order = ["launcher:redis", "launcher:spawned", "learner-0:ready", "learner-0:initial_eval",
             "learner-0:first_batch", "learner-0:first_step"]
    assert [t[k] for k in order] == sorted(t[k] for k in order), t
    assert t["ingest-0:listening"] > t["launcher:redis"], t
    firsts = [t[f"{a}:first_group"] for a in status["members"] if f"{a}:first_group" in t]
    assert firsts and min(firsts) <= t["learner-0:first_batch"], t
    assert all(t[f"{a}:engine"] < t.get(f"{a}:first_group", math.inf) for a in status["members"]), t


def test_bad_config_fails_fast_naming_the_key(tmp_path):
    res = subprocess.run([sys.executable, "-m", "cluster.start", "--run-dir", str(tmp_path / "r"),
                          "learner.lrr=1"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "learner.lrr" in res.stderr


def test_a_tmpdir_too_long_for_rays_sockets_is_named(tmp_path):
    """A long TMPDIR (a scheduler's or CI's per-job folder) puts Ray's Unix sockets past AF_UNIX's 107 bytes: the
    job stops naming the variable and the way out (it ended in Ray's traceback, naming only a socket)."""
    long_tmp = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    long_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_TMPDIR"} | {"TMPDIR": str(long_tmp)}
    res = subprocess.run([sys.executable, "-m", "cluster.start", "--run-dir", str(tmp_path / "r"),
                          "trainer.total_steps=1"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"under TMPDIR={long_tmp}" in res.stderr and "set RAY_TMPDIR to a short directory" in res.stderr, \
        res.stderr[-3000:]


UNWRITABLE_HOME = "/dev/null"   # not a directory: nothing can be made under it, even by root
HOME_ERROR_TIMEOUT_S = 120      # both failures come before any job process starts


def test_an_unwritable_home_is_named_with_what_to_set(tmp_path):
    """The default job writes under HOME twice: the built-in model's cache (~/.cache/asyncrl) and a local Ray's
    auth token (~/.ray). With a read-only or missing HOME the first warmed the model up for minutes, then failed
    with a bare "[Errno 20] Not a directory: '/dev/null/.cache/asyncrl/tiny-reverse-...tmp123'"; the second with
    "Ray could not start: [Errno 20] Not a directory: '/dev/null/.ray'". Each now stops at once, naming the
    directory and the variable to set."""
    env = {**os.environ, "HOME": UNWRITABLE_HOME}
    env.pop("ASYNCRL_CACHE", None)
    cmd = [sys.executable, "-m", "cluster.start", "trainer.total_steps=1"]
    cache = subprocess.run([*cmd, "--run-dir", str(tmp_path / "a")], capture_output=True, text=True, env=env,
                           timeout=HOME_ERROR_TIMEOUT_S)
    assert cache.returncode == 1 and "Traceback" not in cache.stderr, cache.stderr
    assert f"cached in {UNWRITABLE_HOME}/.cache/asyncrl, which cannot be written" in cache.stderr
    assert "set ASYNCRL_CACHE to a writable directory" in cache.stderr
    ray = subprocess.run([*cmd, "--run-dir", str(tmp_path / "b")], capture_output=True, text=True,
                         env={**env, "ASYNCRL_CACHE": os.environ["ASYNCRL_CACHE"]}, timeout=HOME_ERROR_TIMEOUT_S)
    assert ray.returncode == 1 and "Traceback" not in ray.stderr, ray.stderr
    assert f"auth token to {UNWRITABLE_HOME}/.ray, which cannot be written: set HOME" in ray.stderr


def test_weights_travel_in_the_engines_dtype(tmp_path):
    """weightsync.dtype=auto: a bf16 engine beside an fp32 learner is sent bf16 weights (half the bytes of the
    learner's masters), and every actor ends holding exactly the learner's final weights rounded to bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from weightsync.flat import checksum

    run = tmp_path / "run"
    start(run, "--learners", "1", "--actors", "1", "trainer.total_steps=4", "actors.dtype=bfloat16")
    lines = metrics(run)
    policy = AutoModelForCausalLM.from_pretrained(run / "policy")  # the learner's fp32 masters, exported
    sd = policy.state_dict()
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert all(m[M.WS_BYTES] == sum(t.numel() * 2 for t in sd.values()) for m in lines), lines[-1]
    status = json.loads((run / "status.json").read_text())
    final = status["checksums"]["4"]
    assert final == checksum({k: t.to(torch.bfloat16) for k, t in sd.items()}) != checksum(sd)
    for actor, m in status["members"].items():
        assert (m["version"], m["checksum"]) == (4, final), actor


def test_an_eos_logit_bias_is_sampled_and_scored_alike(tmp_path):
    """actors.eos_logit_bias: the actors sample with it and the learner's logprobs include it, so at s = 0 the
    behavior and learner logprobs still agree; the tiny model's 4-letter answers (5 tokens with EOS) end sooner.
    The run's batches are recorded, and bench.scale (the real-model-size rows' summary) reads every sample's length
    from them, as the learner's per-step means say. With trainer.val_before_train=false the base model is not scored
    before the first step: the run's only evaluation is the last step's."""
    from bench.scale import summarise

    run = tmp_path / "run"
    res = start(run, "--learners", "1", "--actors", "1", "max_staleness=0", "trainer.total_steps=4",
                "actors.eos_logit_bias=12", "trainer.record_batches=true", "trainer.val_before_train=false")
    assert "(hf engine on cpu, actors.engine)" in res.stdout.splitlines()[0]   # actors.engine=auto, said as it starts
    lines = metrics(run)
    assert [m[M.STEP] for m in lines] == list(range(4))
    assert M.VAL_REWARD_INITIAL not in lines[0] and M.VAL_ACCURACY_INITIAL not in lines[0], lines[0]
    assert [m[M.STEP] for m in lines if M.VAL_REWARD in m] == [3]
    assert "held-out reward at version 0" not in (run / "logs" / "learner-0.log").read_text()
    for m in lines:
        assert m[M.MISMATCH_ABS] < 1e-4, m  # without the learner's bias the EOS tokens alone put it near 12 / T
        assert m[M.RESPONSE_LEN_MEAN] < 3.5, m
    status = json.loads((run / "status.json").read_text())
    mem = tmp_path / "gpu_mem.csv"  # what nvidia-smi --query-compute-apps writes: pid, MiB
    mem.write_text(f"{status['placement']['learner-0']['pid']}, 2048\n{status['placement']['learner-0']['pid']}, 3072\n"
                   "12345, 512\n")
    s = summarise(run, gpu_mem=mem, peak_tflops=1.0, launched=None)
    n = sum(m[M.SAMPLES] for m in lines)
    assert s["lengths"]["n"] == n and s["lengths"]["max"] == max(m[M.RESPONSE_LEN_MAX] for m in lines)
    assert s["lengths"]["mean"] == pytest.approx(sum(m[M.RESPONSE_LEN_MEAN] * m[M.SAMPLES] for m in lines) / n)
    assert s["lengths"]["p50"] <= s["lengths"]["p99"] <= s["lengths"]["max"]
    assert s["gpu_peak_gib"] == {"learner-0": 3.0, "pid 12345": 0.5}
    assert s["samples_per_s"] > 0 and s["tokens_per_s"] > 0 and 0 < s["mfu_rl_effective"]
    assert s["skipped_steps"] == 2  # bench.scale.SKIP_STEPS: four steps leave two after it
    assert s["launch_to_first_step_s"] == status["startup"]["learner-0:first_step"]
