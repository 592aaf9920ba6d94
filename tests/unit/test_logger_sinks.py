"""trainer.logger: verl's list forms, the trainer.tensorboard alias, clear errors, what is forwarded."""
from __future__ import annotations

import sys

import pytest

from cluster.config import load_config
from learner import loggers
from learner import metric_names as M
from runbase.configload import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("overrides,want", [
    ([], ["console", "tensorboard"]),
    (["trainer.logger=[console,wandb]"], ["console", "wandb"]),
    (["trainer.logger=['console','wandb']"], ["console", "wandb"]),   # verl's docs, quotes kept
    (['trainer.logger=["console","wandb"]'], ["console", "wandb"]),
    (["trainer.logger=wandb"], ["wandb"]),                            # one name, as verl also takes
    (["trainer.logger=[]"], []),                                      # metrics.jsonl only
    (["trainer.logger=[console,console,wandb]"], ["console", "wandb"]),
    (["trainer.tensorboard=false"], ["console"]),                     # the older switch still works
    (["trainer.logger=[wandb]", "trainer.tensorboard=true"], ["wandb", "tensorboard"]),
])
def test_logger_list_forms(overrides, want):
    tc = load_config(overrides=overrides).trainer
    assert tc.logger == want and tc.tensorboard == ("tensorboard" in want)


def test_unknown_logger_names_the_key_and_the_choices():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["trainer.logger=[console,wandbb]"])
    assert e.value.key == "trainer.logger" and "'wandbb'" in str(e.value)
    assert all(name in str(e.value) for name in loggers.SINKS)


def test_logger_without_its_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without wandb looks like to imports
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["trainer.logger=[console,wandb]"])
    assert e.value.key == "trainer.logger" and "pip install -e '.[wandb]'" in str(e.value)


def test_sinks_get_scalars_only_and_their_settings_travel():
    m = {M.STEP: 3, M.REWARD_MEAN: 0.5, M.SAMPLES: 64, M.STALENESS_HIST: [1, 2], M.LOSS_NORM: "token_mean",
         M.GROUPS_TRAINED: ["g1"], M.VAL_ACCURACY: 0.25}
    assert loggers.scalars(m) == {M.REWARD_MEAN: 0.5, M.SAMPLES: 64.0, M.VAL_ACCURACY: 0.25}
    env = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": "http://x", "HOME": "/root", "XWANDB_": "no"}
    assert loggers.forwarded_env(env) == {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": "http://x"}
