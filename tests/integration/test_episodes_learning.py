"""Multi-turn, tool-using episodes end to end (configs/tool_toy.yaml): the built-in tiny-tool model calls the
`reverse` tool and answers with its result, through the same actors, buffer and learner as single-turn samples.
The held-out reward (the same episodes, played by the learner's evaluation) beats step 0, and the lr=0 control
stays flat; the trained samples carry the model's turns in their loss mask and each turn's versions."""
from __future__ import annotations

import json
from pathlib import Path

import msgpack
import numpy as np
import pytest

from buffer.schema import decode
from data.tasks import TaskConfig
from data.tiny_model import resolve_model_path
from test_cluster import start
from test_learning import CONTROL_ACTORS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tool_toy.yaml")
STEPS = "trainer.total_steps=30"
# The control's weights never move and its held-out episodes are seeded: start and end agree at any length, so ten
# steps say what thirty would (the run above is the one whose length matters).
CONTROL_STEPS = "trainer.total_steps=10"


@pytest.fixture(scope="module", autouse=True)
def tiny_tool_model():
    """The built-in tiny-tool model built here, once, before any job: on a fresh cache its warm-up would otherwise
    run inside the first job's start-up and count against its timeout (minutes on a loaded 2-core machine)."""
    return resolve_model_path("builtin:tiny-tool", TaskConfig())


def summary(res) -> dict:
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("done: "))
    return json.loads(line[len("done: "):])


def test_tool_toy_improves_held_out_reward_and_trains_the_model_turns_only(tmp_path):
    run = tmp_path / "rl"
    s = summary(start(run, "--config", CONFIG, STEPS, "trainer.record_batches=true"))
    assert s["val_reward_end"] - s["val_reward_start"] >= 0.1, s
    groups = [decode(p) for p in msgpack.unpackb((run / "batches" / "step-00000029.msgpack").read_bytes())]
    for sample in (smp for g in groups for smp in g.samples):
        turns = np.asarray(sample.turns).reshape(-1, 3)
        mask = np.asarray(sample.loss_mask)
        assert sample.end_reason and len(turns) >= 1 and mask[0] == 1
        if sample.end_reason == "answered" and len(turns) == 2:   # call, result, answer
            assert 0 < turns[1, 0] < len(mask) and mask[turns[1, 0] - 1] == 0 and 0 < mask.sum() < len(mask)
            assert not np.any(np.asarray(sample.behavior_logprobs)[mask == 0])
    assert any(smp.end_reason == "answered" for g in groups for smp in g.samples)


def test_tool_toy_lr_zero_control_stays_flat(tmp_path):
    s = summary(start(tmp_path / "control", "--config", CONFIG, *CONTROL_ACTORS, CONTROL_STEPS, "learner.lr=0"))
    assert abs(s["val_reward_end"] - s["val_reward_start"]) < 0.03, s
