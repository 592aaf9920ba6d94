"""learner.plain_compute=shadow: the plain one-rank step computes on a bf16 copy of the weights (no autocast)
and steps the fp32 weights; compared with the autocast step on the same rows (bf16 differences only)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from learner import metric_names as M
from learner.config import LearnerConfig
from learner.step import train_step
from learner.train import build_policy
from runbase.net import free_port
from test_logprob_head import _model, make_rows

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def one_rank_group():
    """train_step all-reduces its statistics over the learner group: a one-rank gloo group."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _step(model, compute: str, rows):
    lc = LearnerConfig(plain_one_rank=True, param_dtype="bfloat16", plain_compute=compute, lr=1e-3, device="cpu",
                       micro_batch_size_per_gpu=4)
    model, opt = build_policy(lc, "", torch.device("cpu"), model=model)
    before = [p.detach().clone() for p in model.parameters()]
    stats = train_step(model, opt, rows, rows, lc, temperature=1.0, world=1, pad_id=0, device=torch.device("cpu"))
    update = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    return model, stats, update


@pytest.mark.parametrize("tied", [False, True])
def test_shadow_step_equals_the_autocast_step_to_bf16_precision(one_rank_group, tied):
    rows = make_rows(8)
    base = _model(tied)
    auto, s_auto, u_auto = _step(copy.deepcopy(base), "autocast", rows)
    shadow, s_shadow, u_shadow = _step(copy.deepcopy(base), "shadow", rows)
    assert s_shadow[M.LOSS] == pytest.approx(s_auto[M.LOSS], rel=0.05, abs=1e-3)
    assert s_shadow[M.GRAD_NORM] == pytest.approx(s_auto[M.GRAD_NORM], rel=0.05)
    # the same update, to bf16 precision, on fp32 weights the optimizer stepped (every one of them moved)
    assert torch.nn.functional.cosine_similarity(u_auto, u_shadow, dim=0) > 0.99
    assert all(p.dtype == torch.float32 for p in shadow.parameters()) and u_shadow.abs().gt(0).float().mean() > 0.5
    copies = shadow._shadow.copies
    assert all(c.dtype == torch.bfloat16 and c.grad is None for c in copies)  # gradients handed to the weights
    assert all(v.dtype == torch.float32 for v in shadow.state_dict().values() if v.is_floating_point())
    shadow._shadow.refresh()  # what the next step starts with: the stepped weights, rounded once
    assert all(torch.equal(c, p.detach().to(torch.bfloat16)) for c, p in zip(copies, shadow.parameters()))


def test_shadow_needs_the_plain_path_below_float32():
    from runbase.configload import ConfigError

    with pytest.raises(ConfigError, match="plain_compute"):
        LearnerConfig(plain_compute="shadow", param_dtype="bfloat16")
    with pytest.raises(ConfigError, match="plain_compute"):
        LearnerConfig(plain_compute="shadow", plain_one_rank=True)


def test_shadow_gradients_are_each_steps_own_over_two_steps(one_rank_group):
    """The fp32 gradient buffers are reused from step to step: the second step's gradients are its own
    (equal to the bf16 copies' of that step), not added to the first's, and the copies hold the stepped
    weights before the second step computes."""
    rows, model = make_rows(8), _model(True)
    lc = LearnerConfig(plain_one_rank=True, param_dtype="bfloat16", plain_compute="shadow", lr=1e-3, device="cpu",
                       micro_batch_size_per_gpu=4)
    model, opt = build_policy(lc, "", torch.device("cpu"), model=model)
    sh = model._shadow
    seen = []
    original = sh.to_masters

    def record():  # the copies' gradients as the step hands them over, then the hand-over itself
        seen.append([None if c.grad is None else c.grad.float().clone() for c in sh.copies])
        original()
        seen[-1] = (seen[-1], [None if p.grad is None else p.grad.clone() for p in sh.masters],
                    [c.detach().float().clone() for c in sh.copies])

    sh.to_masters = record
    for _ in range(2):
        train_step(model, opt, rows, rows, lc, temperature=1.0, world=1, pad_id=0, device=torch.device("cpu"))
    (g1, m1, w1), (g2, m2, w2) = seen
    for copy_grad, master_grad in zip(g2, m2):
        if copy_grad is not None:
            assert master_grad.dtype == torch.float32 and torch.equal(master_grad, copy_grad)
    assert any(not torch.equal(a, b) for a, b in zip(g1, g2) if a is not None)  # a different step's gradients
    assert any(not torch.equal(a, b) for a, b in zip(w1, w2))  # step 2 computed on the stepped weights


def test_bf16_master_weights_train_in_half_the_memory(one_rank_group):
    """learner.master_dtype=bfloat16: weights, gradients and AdamW's two moments all bf16 (8 bytes a parameter
    instead of 16), and a step still moves the weights the way the fp32 step does (to bf16 precision)."""
    from runbase.configload import ConfigError

    rows, base = make_rows(8), _model(False)
    lc = LearnerConfig(plain_one_rank=True, param_dtype="bfloat16", master_dtype="bfloat16", lr=1e-2, device="cpu",
                       micro_batch_size_per_gpu=4)
    model, opt = build_policy(lc, "", torch.device("cpu"), model=copy.deepcopy(base).to(torch.bfloat16))
    before = [p.detach().clone() for p in model.parameters()]
    stats = train_step(model, opt, rows, rows, lc, temperature=1.0, world=1, pad_id=0, device=torch.device("cpu"))
    update = torch.cat([(p.detach() - b).float().flatten() for p, b in zip(model.parameters(), before)])
    n = sum(p.numel() for p in model.parameters())
    state = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and all(t.dtype == torch.bfloat16 for t in state)
    assert sum(t.numel() * t.element_size() for t in [*model.parameters(), *state]) + \
        sum(p.grad.numel() * 2 for p in model.parameters() if p.grad is not None) <= 8 * n
    fp32_lc = LearnerConfig(plain_one_rank=True, param_dtype="bfloat16", lr=1e-2, device="cpu", micro_batch_size_per_gpu=4)
    ref, ref_opt = build_policy(fp32_lc, "", torch.device("cpu"), model=copy.deepcopy(base))
    ref_before = [p.detach().clone() for p in ref.parameters()]
    ref_stats = train_step(ref, ref_opt, rows, rows, fp32_lc, temperature=1.0, world=1, pad_id=0, device=torch.device("cpu"))
    ref_update = torch.cat([(p.detach() - b).flatten() for p, b in zip(ref.parameters(), ref_before)])
    assert stats[M.LOSS] == pytest.approx(ref_stats[M.LOSS], rel=0.05, abs=1e-3)
    assert torch.nn.functional.cosine_similarity(update, ref_update, dim=0) > 0.9
    with pytest.raises(ConfigError, match="master_dtype"):
        LearnerConfig(master_dtype="bfloat16")  # fp32 compute over bf16 weights: refused
