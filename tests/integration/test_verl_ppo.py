"""On CPU: PPO with a critic (GAE) learns the default task, and a verl guide's command lines run through
`cluster.start` once translated with the alias table (docs/verl.md).

The article (../shared/reference/000_dc5af427c7cf89b5.txt) runs verl's main_ppo, whose default
estimator is gae: the translated lines say `algorithm.adv_estimator=gae` explicitly (ours defaults to
grpo). Sizes are scaled to a 2-core CPU (batch 1024 -> 4, 8 GPUs -> 1-2 learner ranks, Qwen2-7B -> the
built-in tiny model, vLLM with TP 2 -> the HF engine with TP 1); every key is the article's.
"""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_cluster import metrics, start
from learner import metric_names as M

pytestmark = pytest.mark.integration

GAE_MARGIN = 0.1          # held-out reward gain the default task shows in 60 steps (0.42 -> ~0.7 measured)
GAE_STEPS = 60            # ~30 s on 2 idle cores
VALUE_BIAS = 0.08         # |mean value - mean return| over the last 10 steps: 0.001 measured, ~0.01 in a failed CI window
VALUE_GAP = 0.15          # mean per-step |value - return| over the last 10 steps: 0.06 measured, ~0.1 in a failed CI window
VF_FALL = 0.7             # value loss of the last 10 steps over the first 10: 0.34-0.38 on idle cores, 0.51 in a loaded CI run


def summary(res) -> dict:
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("done: "))
    return json.loads(line[len("done: "):])


def test_gae_improves_held_out_reward_and_its_critic_is_checkpointed_and_resumed(tmp_path):
    """The GAE run learns and its critic tracks the returns; its last checkpoint holds the critic and its
    optimizer, and a --resume carries the critic on (one run, resumed for 2 more steps: before, a second job
    trained 3 steps from scratch only to checkpoint and resume a critic)."""
    from torch.distributed.checkpoint import FileSystemReader

    run = tmp_path / "gae"
    common = ["algorithm.adv_estimator=gae", f"trainer.checkpoint_every={GAE_STEPS}"]
    s = summary(start(run, *common, f"trainer.total_steps={GAE_STEPS}"))
    assert s["val_reward_end"] > s["val_reward_start"] + GAE_MARGIN, s
    lines = metrics(run)
    assert len(lines) == GAE_STEPS
    # the critic is trained and tracks the returns: its loss falls and its mean value nears the mean return
    first, last = lines[:10], lines[-10:]
    fall = sum(m[M.VF_LOSS] for m in last) / sum(m[M.VF_LOSS] for m in first)
    print(f"vf_loss ratio last/first: {fall:.3f}")
    assert fall < VF_FALL, fall
    # One step's mean return is a mean over a few dozen 0/1-ish rewards (noise ~0.05-0.1 per step, and 0.12 seen
    # in one step of a passing run), so the critic is judged on the window: no bias, and a small typical gap.
    gaps = [m[M.VALUES_MEAN] - m[M.RETURNS_MEAN] for m in last]
    assert abs(sum(gaps) / len(gaps)) < VALUE_BIAS, gaps
    assert sum(abs(g) for g in gaps) / len(gaps) < VALUE_GAP, gaps

    keys = FileSystemReader(str(run / "checkpoints" / f"step-{GAE_STEPS:08d}")).read_metadata().state_dict_metadata
    assert any(k.startswith("critic.") for k in keys) and any(k.startswith("critic_optim.") for k in keys)
    start(run, "--resume", *common, "--actors", "1", "trainer.export_hf=false", f"trainer.total_steps={GAE_STEPS + 2}")
    v = [m[M.VALUES_MEAN] for m in metrics(run)]
    assert len(v) == GAE_STEPS + 2
    # a critic restarted from scratch would value the resumed step's batch like step 0's (fresh head); the
    # resumed one carries on from where the last step before the checkpoint left it
    n = GAE_STEPS
    assert abs(v[n] - v[n - 1]) < abs(v[n] - v[0]), (v[0], v[n - 1], v[n])


def test_article_section_3_2_single_node_line(tmp_path):
    """python3 -m verl.trainer.main_ppo trainer.n_gpus_per_node=8 trainer.nnodes=1 data.train_batch_size=1024
    actor_rollout_ref.rollout.micro_batch_size_per_gpu=16 critic.ppo_micro_batch_size_per_gpu=16
    actor_rollout_ref.actor.fsdp_config.param_offload=True critic.model.fsdp_config.optimizer_offload=True"""
    run = tmp_path / "3_2"
    res = start(run, "--actors", "1", "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "data.train_batch_size=4",
                "actor_rollout_ref.rollout.micro_batch_size_per_gpu=16", "critic.ppo_micro_batch_size_per_gpu=16",
                "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                "critic.model.fsdp_config.optimizer_offload=True",
                "algorithm.adv_estimator=gae", "trainer.total_training_steps=3", "trainer.export_hf=false")
    lines = metrics(run)
    assert [m[M.STEP] for m in lines] == [0, 1, 2]
    assert all(m[M.SAMPLES] == 4 * 8 and M.VF_LOSS in m for m in lines)
    cfg = (run / "config.yaml").read_text()
    assert "learners: 2" in cfg and "param_offload: true" in cfg
    assert "micro_batch_size_per_gpu" in res.stderr  # the ignored rollout knob is said to be ignored


def test_article_section_3_3_main_ppo_line(tmp_path):
    """python3 -m verl.trainer.main_ppo data.train_files="../data/gsm8k/train.parquet"
    data.val_files="../data/gsm8k/test.parquet" data.train_batch_size=1024
    actor_rollout_ref.model.path="Qwen/Qwen2-7B-Instruct" actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.9
    trainer.n_gpus_per_node=8 trainer.nnodes=2 trainer.total_epochs=15"""
    from test_datasets import verl_gsm8k_rows

    for split in ("train", "test"):  # verl's examples/data_preprocess/gsm8k.py layout, 4 rows each
        pq.write_table(pa.Table.from_pylist(verl_gsm8k_rows(split)), tmp_path / f"{split}.parquet")
    run = tmp_path / "3_3"
    start(run, "--actors", "1", f"data.train_files={tmp_path}/train.parquet",
          f"data.val_files={tmp_path}/test.parquet", "data.train_batch_size=2",
          "actor_rollout_ref.model.path=builtin:tiny-reverse", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
          "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
          "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.total_epochs=2",
          "algorithm.adv_estimator=gae", "trainer.val_samples=1", "trainer.export_hf=false")
    lines = metrics(run)
    assert [m[M.STEP] for m in lines] == [0, 1, 2, 3]  # 2 epochs x 4 rows / 2 prompts per step
    assert all(m[M.SAMPLES] == 2 * 8 for m in lines)


def test_one_sample_per_prompt_runs_without_a_group_baseline(tmp_path):
    """verl's PPO and REINFORCE++ examples sample once per prompt (`actor_rollout_ref.rollout.n=1`): the
    baseline is the critic's values or the batch's mean, not a group's. GRPO refuses it
    (tests/unit/test_config.py); the ingest takes groups of one."""
    run = tmp_path / "n1"
    start(run, "--actors", "1", "--learners", "2", "actor_rollout_ref.rollout.n=1",
          "algorithm.adv_estimator=reinforce_pp", "data.train_batch_size=4", "trainer.total_training_steps=3",
          "trainer.export_hf=false")
    lines = metrics(run)
    assert [m[M.STEP] for m in lines] == [0, 1, 2]
    assert all(m[M.SAMPLES] == 4 for m in lines)
