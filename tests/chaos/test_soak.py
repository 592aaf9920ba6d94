"""The soak's short forms (tests/chaos/soak.py). A minute of the embedded job under a seeded random schedule of the
faults it rides out (actor, ingest and Redis kills, pauses, scaling, Redis connections and actor-to-ingest links
cut by the proxies): the books balance, no stall passes the bound, no process grows, publication does not slow
down, and the held-out reward beats step 0. Then the faults that end a job (the learner killed, a checkpoint the
file system refuses), each followed by `--resume`: the books balance over the whole chain of incarnations."""
from __future__ import annotations

import json
import os
import sys

import pytest

from soak import FAULTS, KEEP_CHECKPOINTS, MIN_LEFT_STEPS, RESTARTING, planned_steps, publish_by_hour, soak
from jobs import Drained
from soak_plot import course

from learner import metric_names as M

STEPS = 100      # about a minute of the embedded job on 2 cores, faults included (a step alone is ~0.1 s)
EVERY_S = 2.5    # a fault every 2.5 s on average: every kind at least once in the minute
STALL_S = 60.0   # a Redis restart, a killed ingest and a scale-up may overlap; none may stop training this long
# Each learner fault costs a job's start-up (~15-20 s on 2 cores): a chain of about three jobs. A learner fault
# waits for its incarnation's first checkpoint (soak.CHECKPOINT_EVERY), so each job moves the run on.
RESTART_STEPS = 40
RESTART_EVERY_S = 2.0   # soon after each incarnation's first checkpoint: the chain stays short
RESTARTS = 2            # one of each kind (the bag runs through both before repeating): three jobs in all
RESTART_MINUTES = 0.5   # the chain's length on the clock: its second and third jobs' steps re-planned from the pace


def summary(result: dict) -> dict:
    return {k: result[k] for k in ("checks", "longest_stall_s", "restart_gaps_s", "publish_s_first_last_quarter",
                                   "val_reward_start_end", "faults", "incarnations", "connections_cut")}


def test_a_minute_of_random_faults_loses_nothing(tmp_path):
    kinds = tuple(k for k in FAULTS if k not in RESTARTING)
    result = soak(tmp_path, steps=STEPS, seed=7, every_s=EVERY_S, stall_s=STALL_S, overrides=[], kinds=kinds)
    print(json.dumps({k: v for k, v in result.items() if k != "processes"}, indent=1))
    assert result["ok"], summary(result)
    assert sum(result["faults"].values()) >= 3, result["faults"]
    # the seed's order of kinds puts the links' cuts first: each cut something (a proxy with nothing open to cut
    # does not count the fault), and both are counted in connections_cut
    assert result["faults"]["drop_redis"] >= 1 and result["faults"]["drop_ingest_link"] >= 1, summary(result)
    assert result["connections_cut"]["redis"] >= 1 and result["connections_cut"]["ingest"] >= 1, summary(result)
    assert result["incarnations"] == 1, summary(result)


def test_a_killed_learner_and_an_unwritable_checkpoint_are_resumed_losing_nothing(tmp_path):
    # its jobs join the test process's Ray (a job's start-up less each): the books and the resumes are judged here,
    # the processes' growth by the soak above
    result = soak(tmp_path, steps=RESTART_STEPS, seed=3, every_s=RESTART_EVERY_S, stall_s=STALL_S, overrides=[],
                  kinds=RESTARTING, max_restarts=RESTARTS, own_ray=False, minutes=RESTART_MINUTES)
    print(json.dumps({k: v for k, v in result.items() if k != "processes"}, indent=1))
    assert result["ok"], summary(result)   # the books (check_ledger) balanced over every incarnation
    assert all(result["faults"][k] == 1 for k in RESTARTING), summary(result)
    # every learner fault ended one job, which the soak resumed (an unexplained failure fails the soak itself)
    assert result["incarnations"] == 1 + sum(result["faults"].values()), summary(result)
    # the restarts' gaps are reported apart from the stall check (a resumed incarnation whose every step a later
    # one redid leaves none of its own)
    assert 1 <= len(result["restart_gaps_s"]) <= result["incarnations"] - 1, summary(result)
    # a timed soak: each resumed job's length was planned on the clock, and the run ended at the last plan
    lengths = result["lengths"]
    assert len(lengths) == result["incarnations"] and lengths[0] == RESTART_STEPS, lengths
    assert result["steps"] == lengths[-1] and lengths[-1] != RESTART_STEPS, (lengths, result["steps"])
    # one checkpoint every soak.CHECKPOINT_EVERY steps, the newest kept: a long soak's disk stays bounded
    assert 1 <= result["checkpoints_left"] <= KEEP_CHECKPOINTS, summary(result)


def test_a_timed_soak_plans_its_length_from_its_pace():
    """planned_steps: the steps done plus what the pace so far fits in the time left; never fewer than a resumed
    job needs to pass its first checkpoint and end, also once the time is up."""
    assert planned_steps(300, elapsed_s=60.0, left_s=30.0) == 450
    assert planned_steps(300, elapsed_s=60.0, left_s=0.0) == 300 + MIN_LEFT_STEPS
    assert planned_steps(300, elapsed_s=60.0, left_s=-5.0) == 300 + MIN_LEFT_STEPS
    assert planned_steps(0, elapsed_s=0.0, left_s=100.0) == MIN_LEFT_STEPS


def test_publication_is_reported_by_hour_of_the_run():
    lines = [{M.TIME: 1000.0 + t, M.WS_PUBLISH_S: s} for t, s in ((0, 0.01), (1800, 0.03), (3599, 0.02), (3600, 0.05),
                                                                 (7300, 0.07), (7400, 0.09))]
    lines.append({M.TIME: 1000.0 + 5000})   # a line without a publication counts in no hour
    assert publish_by_hour(lines) == [[0, 0.02, 3, 3599], [1, 0.05, 1, 0], [2, 0.08, 2, 100]]
    assert publish_by_hour([]) == []


def test_the_course_is_reward_and_zero_gradient_share_per_window():
    lines = [{M.STEP: i, M.REWARD_MEAN: i / 10, M.GRAD_NORM: 0.0 if i % 4 == 0 else 0.5} for i in range(10)]
    # two whole windows of 4 (the last two steps fill none); a line without a gradient norm is not a zero one
    assert course(lines, 4) == [(0, pytest.approx(0.15), 0.25), (4, pytest.approx(0.55), 0.25)]
    assert course([{M.STEP: 0, M.REWARD_MEAN: 1.0}], 1) == [(0, 1.0, 0.0)]


def test_a_job_writing_more_than_a_pipe_holds_runs_to_its_end():
    """The harness reads a job's output as it comes: a launcher that writes past a pipe's 64 KiB (a long soak's
    progress lines) is not blocked in its write, and every line is kept."""
    code = "import sys\nfor i in range(20000): print(f'line {i:05d} ' + 'x' * 40); print(i, file=sys.stderr)"
    p = Drained([sys.executable, "-c", code], env=dict(os.environ))
    assert p.proc.wait(timeout=60) == 0
    out, err = p.ended()
    assert len(out) == 20000 * 52 > 15 * 65536 and out.splitlines()[-1].startswith("line 19999 ")
    assert err.splitlines()[-1] == "19999" and len(err.splitlines()) == 20000
