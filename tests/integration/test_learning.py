"""The embedded default really learns, and the lr=0 control really does not.

Held-out reward is measured on a fixed prompt set disjoint from training prompts, with the
same sampling settings and seed at step 0 and at the end.
"""
from __future__ import annotations

import json

from test_cluster import start


def summary(res) -> dict:
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("done: "))
    return json.loads(line[len("done: "):])


def test_default_job_improves_held_out_reward(tmp_path):
    s = summary(start(tmp_path / "rl"))
    assert s["val_reward_end"] - s["val_reward_start"] >= 0.1, s


# The control's steps: with lr=0 the weights never move, so the held-out reward must not either, however long the
# run; an lr that did reach the optimizer would show by then (the default job's train reward is up ~0.1 by step 20).
CONTROL_STEPS = 25
# The control's actors: its held-out reward is the learner's seeded evaluation of weights that never move, the same
# whoever made the training groups; a second actor was ~5 CPU-s of start-up for nothing it judges.
CONTROL_ACTORS = ("--actors", "1")


def test_lr_zero_control_stays_flat(tmp_path):
    s = summary(start(tmp_path / "control", *CONTROL_ACTORS, "learner.lr=0", f"trainer.total_steps={CONTROL_STEPS}"))
    assert abs(s["val_reward_end"] - s["val_reward_start"]) < 0.03, s
