"""PPO in the learner group: critic + GAE, reference KL, dynamic batch size and offload keep
the learner's contract: a 2-rank step equals a 1-rank step (real processes, gloo), and parameter
offload changes where tensors live, not the numbers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ranks
from test_fsdp import make_rows
from learner import metric_names as M
from runbase.net import free_port

pytestmark = pytest.mark.integration

PPO = ["algorithm.adv_estimator=gae", "algorithm.gamma=0.99", "algorithm.lam=0.95",
       "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.05", "learner.use_kl_loss=true",
       "learner.kl_loss_coef=0.1", "learner.use_dynamic_bsz=true", "learner.max_tokens_per_micro_batch=40",
       "critic.ppo_epochs=2", "critic.cliprange_value=0.05", "learner.lr=1e-2", "critic.lr=1e-2"]


def rank_proc(rank, world, port, out, model_dir, overrides):
    import torch.distributed as dist

    from cluster.config import load_config
    from learner.batching import split_rows
    from learner.model import full_state_dict, load_policy, wrap_policy
    from learner.ppo import PPOExtras
    from learner.step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = load_config(overrides=overrides)
    lc, dev = cfg.learner, torch.device("cpu")
    model = wrap_policy(load_policy(model_dir, dev, lc.attn_implementation), lc, dev, world)
    opt = torch.optim.AdamW(model.parameters(), lr=lc.lr)
    extras = PPOExtras(cfg, model_dir, dev)
    rows = make_rows(8)
    for r in rows:  # outcome rewards in [0, 1], as the reward functions give
        r.reward = float(abs(r.advantage) % 1)
    stats = [train_step(model, opt, split_rows(rows, world)[rank], rows, lc, temperature=1.0, world=world,
                        pad_id=0, device=dev, extras=extras) for _ in range(2)]
    sd, critic = full_state_dict(model), full_state_dict(extras.critic)
    if rank == 0:
        torch.save({"sd": sd, "critic": critic, "stats": stats}, out)
    dist.barrier()


def run_world(world, tmp_path, model_dir, overrides, tag=""):
    port = free_port()  # below the ephemeral range: the spawned ranks bind it seconds later
    out = str(tmp_path / f"world{world}{tag}.pt")
    ctx = ranks.context()
    procs = [ctx.Process(target=rank_proc, args=(r, world, port, out, model_dir, overrides)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    return torch.load(out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from data.tiny_model import random_tiny_model

    d = tmp_path_factory.mktemp("tiny")
    random_tiny_model(seed=0).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def one_rank_ppo(tmp_path_factory, model_dir):
    """The 1-rank padded FSDP PPO reference (two steps), trained once for the module: four tests compare
    against exactly this run (same model, rows and overrides) and only read it."""
    return run_world(1, tmp_path_factory.mktemp("ppo-one-rank"), model_dir, PPO)


# k_proj biases get a gradient that is zero in exact arithmetic (softmax ignores a shift shared by all
# keys); Adam divides that rounding noise by its own size, so those entries differ by ~lr x noise
# between rank counts, a few 1e-5 after two steps at lr 1e-2, while every other entry agrees to ~2e-6
ADAM_NOISE_ATOL = 5e-5


# Packed and padded micro-batches also sum in different orders, so any entry whose gradient is
# rounding-sized can land on Adam's noise: seen once on an AMD EPYC VM, 1 entry of 12,288 in the
# critic 6.6e-5 apart (every other within 2e-6). A packing bug moves whole rows and columns, far more
# than this share; and the few noisy entries still stay within a hundredth of one Adam step.
NOISY_SHARE = 1e-3
NOISY_ATOL = 1e-4


def assert_same(a, b, rtol=1e-4, atol=ADAM_NOISE_ATOL, noisy_share=0.0):
    assert a.keys() == b.keys()
    for k in a:
        if noisy_share == 0:
            torch.testing.assert_close(b[k], a[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
            continue
        off = ~torch.isclose(b[k], a[k], rtol=rtol, atol=atol)
        diff = (b[k] - a[k]).abs().max().item()
        assert off.float().mean().item() <= noisy_share and diff <= NOISY_ATOL, \
            f"{k}: {int(off.sum())} of {off.numel()} entries differ, by up to {diff:.2e}"


def test_ppo_two_ranks_equal_one_rank(tmp_path, model_dir, one_rank_ppo):
    one = one_rank_ppo
    two = run_world(2, tmp_path, model_dir, PPO)
    assert_same(one["sd"], two["sd"])
    assert_same(one["critic"], two["critic"])
    from transformers import AutoModelForTokenClassification

    init = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1).state_dict()
    assert all(not torch.equal(one["critic"][k], init[k]) for k in init if not k.startswith("score"))
    for s1, s2 in zip(one["stats"], two["stats"]):
        for k in (M.LOSS, M.GRAD_NORM, M.KL_REF, M.KL_IN_REWARD, M.VF_LOSS, M.VF_CLIPFRAC, M.VALUES_MEAN,
                  M.RETURNS_MEAN, M.CRITIC_GRAD_NORM):
            assert s2[k] == pytest.approx(s1[k], rel=1e-4, abs=1e-6), k
    st = one["stats"]
    assert st[0][M.MICRO_BATCHES] > 1  # the 40-token budget really cut the share
    assert st[1][M.KL_REF] > 0 and st[1][M.VF_CLIPFRAC] > 0  # the policy moved off the reference; epoch 2 clips
    assert st[1][M.VF_LOSS] < st[0][M.VF_LOSS]  # the critic fits the returns


def test_param_offload_same_numbers(tmp_path, model_dir):
    base = ["algorithm.adv_estimator=gae", "critic.lr=1e-2", "learner.lr=1e-2"]
    off = run_world(1, tmp_path, model_dir, base, "off")
    on = run_world(1, tmp_path, model_dir, base + ["learner.param_offload=true", "critic.param_offload=true",
                                                   "learner.optimizer_offload=true"], "on")
    assert_same(off["sd"], on["sd"], rtol=1e-6, atol=1e-7)
    assert_same(off["critic"], on["critic"], rtol=1e-6, atol=1e-7)
    assert np.isclose(off["stats"][1][M.LOSS], on["stats"][1][M.LOSS], rtol=1e-6)


def test_packed_sequences_two_ranks_equal_padded_one_rank(tmp_path, model_dir, one_rank_ppo):
    """learner.pack_sequences (verl's use_remove_padding, by name) for the policy, reference and critic passes:
    no padding, a token budget of real tokens, and the same numbers as right-padded micro-batches."""
    one = one_rank_ppo
    two = run_world(2, tmp_path, model_dir, PPO + ["learner.pack_sequences=true"], "packed")
    assert_same(one["sd"], two["sd"], noisy_share=NOISY_SHARE)
    assert_same(one["critic"], two["critic"], noisy_share=NOISY_SHARE)
    for s1, s2 in zip(one["stats"], two["stats"]):
        for k in (M.LOSS, M.GRAD_NORM, M.KL_REF, M.VF_LOSS, M.VALUES_MEAN, M.RETURNS_MEAN):
            assert s2[k] == pytest.approx(s1[k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("variant", ["varlen", "plain"])
def test_varlen_and_plain_one_rank_equal_padded_fsdp(tmp_path, model_dir, one_rank_ppo, variant):
    """attn_implementation=varlen (packed rows, no mask; row-by-row SDPA on CPU, torch's varlen flash kernel
    on CUDA) on 2 ranks, and the one-rank path without FSDP (learner.plain_one_rank), train to the numbers of
    padded FSDP micro-batches on one rank: policy, reference and critic."""
    over = {"varlen": ["learner.pack_sequences=true", "learner.attn_implementation=varlen"],
            "plain": ["learner.plain_one_rank=true"]}[variant]
    one = one_rank_ppo
    other = run_world(2 if variant == "varlen" else 1, tmp_path, model_dir, PPO + over, variant)
    assert_same(one["sd"], other["sd"], noisy_share=NOISY_SHARE)
    assert_same(one["critic"], other["critic"], noisy_share=NOISY_SHARE)
    for s1, s2 in zip(one["stats"], other["stats"]):
        for k in (M.LOSS, M.GRAD_NORM, M.KL_REF, M.VF_LOSS, M.VALUES_MEAN, M.RETURNS_MEAN):
            assert s2[k] == pytest.approx(s1[k], rel=1e-4, abs=1e-6), k
