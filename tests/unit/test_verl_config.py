"""verl's knob names (cluster/config.py ALIASES + cluster/verl.py): renames, translations, and clear errors."""
from __future__ import annotations

import pytest

from cluster.config import ALIASES, load_config
from runbase.configload import ConfigError

pytestmark = pytest.mark.unit


def test_article_3_2_line_translates():
    """Section 3.2 of the verl article (values scaled down for CPU), plus verl's default estimator."""
    cfg = load_config(overrides=[
        "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.micro_batch_size_per_gpu=16", "critic.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True", "critic.model.fsdp_config.optimizer_offload=True",
        "algorithm.adv_estimator=gae"])
    assert cfg.cluster.learners == 2 and cfg.learner.groups_per_step == 4
    assert cfg.critic.micro_batch_size_per_gpu == 16 and cfg.critic.optimizer_offload
    assert cfg.learner.param_offload and not cfg.learner.optimizer_offload
    assert cfg.algorithm.adv_estimator == "gae"


def test_every_alias_target_is_a_real_key():
    cfg = load_config()
    for verl, ours in ALIASES.items():
        node = cfg
        for part in ours.split("."):   # a nested section's key too (learner.lora.rank)
            assert hasattr(node, part), (verl, ours)
            node = getattr(node, part)


@pytest.mark.parametrize("overrides,check", [
    (["actor_rollout_ref.actor.clip_ratio=0.3"], lambda c: (c.learner.clip_low, c.learner.clip_high) == (0.3, 0.3)),
    # the specific key wins, wherever it stands
    (["actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.clip_ratio=0.1"],
     lambda c: (c.learner.clip_low, c.learner.clip_high) == (0.1, 0.28)),
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"], lambda c: c.learner.loss_norm == "seq_mean_token_mean"),
    (["trainer.save_freq=-1", "trainer.test_freq=5"], lambda c: (c.trainer.checkpoint_every, c.trainer.val_every) == (0, 5)),
    (["trainer.max_actor_ckpt_to_keep=3"], lambda c: c.trainer.keep_checkpoints == 3),
    (["trainer.max_actor_ckpt_to_keep=null"], lambda c: c.trainer.keep_checkpoints == 0),
    (["trainer.nnodes=2", "data.train_batch_size=16"], lambda c: c.cluster.learners == 16),  # verl's 8 GPUs/node
    (["actor_rollout_ref.rollout.gpu_memory_utilization=0.9"], lambda c: c.actors.gpu_memory_utilization == 0.9),
    (["actor_rollout_ref.model.enable_gradient_checkpointing=True"], lambda c: c.learner.activation_checkpointing),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=8"], lambda c: c.learner.groups_per_step == 8),
    (["algorithm.kl_ctrl.kl_coef=0.01", "algorithm.adv_estimator=reinforce_pp", "algorithm.use_kl_in_reward=True"],
     lambda c: c.algorithm.kl_ctrl.kl_coef == 0.01),
    (["actor_rollout_ref.actor.strategy=fsdp2", "trainer.logger=['console','wandb']"],
     lambda c: c.trainer.logger == ["console", "wandb"]),
    (["actor_rollout_ref.model.use_remove_padding=True"], lambda c: c.learner.pack_sequences is False),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
      "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"],
     lambda c: (c.learner.lora.rank, c.learner.lora.alpha, c.learner.lora.target_modules) == (8, 32.0, ["q_proj", "v_proj"])),
    (["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.target_modules=all-linear"],
     lambda c: (c.learner.lora.rank, c.learner.lora.target_modules) == (16, "all-linear")),
    # verl's example scripts pass these at the value that means "not used" (they were refused)
    (["reward_model.enable=False", "actor_rollout_ref.actor.entropy_coeff=0"], lambda c: c.learner.lr > 0),
])
def test_translations(overrides, check):
    assert check(load_config(overrides=overrides))


@pytest.mark.parametrize("overrides,key", [
    (["actor_rollout_ref.actor.ppo_mini_batch_size=2"], "actor_rollout_ref.actor.ppo_mini_batch_size"),
    (["trainer.total_epochs=3"], "trainer.total_epochs"),  # the built-in task has no epochs
    (["actor_rollout_ref.actor.ppo_epochs=4"], "actor_rollout_ref.actor.ppo_epochs"),
    (["actor_rollout_ref.actor.entropy_coeff=0.01"], "actor_rollout_ref.actor.entropy_coeff"),
    (["actor_rollout_ref.actor.strategy=megatron"], "actor_rollout_ref.actor.strategy"),
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum"], "actor_rollout_ref.actor.loss_agg_mode"),
    (["critic.model.foo=1"], "critic.model"),
    (["algorithm.use_kl_in_reward=True"], "algorithm.use_kl_in_reward"),  # with grpo: use the KL loss
    (["trainer.nnodes=0"], "trainer.nnodes"),
    (["reward_model.enable=True"], "reward_model.enable"),
])
def test_unsupported_verl_keys_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert e.value.key == key and key in str(e.value)


def test_total_epochs_from_dataset_size(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    def write(name, n):
        t = pa.table({"data_source": ["reverse"] * n, "prompt": [[{"role": "user", "content": "abcd"}]] * n,
                      "reward_model": [{"style": "rule", "ground_truth": "dcba"}] * n})
        pq.write_table(t, tmp_path / name)
        return str(tmp_path / name)

    train, val = write("train.parquet", 50), write("val.parquet", 4)
    base = [f"data.train_files={train}", f"data.val_files={val}", "data.train_batch_size=8"]
    cfg = load_config(overrides=base + ["trainer.total_epochs=3"])
    assert cfg.data.train_files == [train]  # a single path, as verl takes it, becomes our list
    assert cfg.trainer.total_steps == 19  # ceil(3 x 50 / 8)
    # verl: total_training_steps wins over epochs
    assert load_config(overrides=base + ["trainer.total_epochs=3", "trainer.total_training_steps=5"]).trainer.total_steps == 5
