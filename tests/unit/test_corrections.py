"""Off-policy corrections (learner/losses.py) against independent NumPy references.

Each correction is checked on its loss values, on its `bounded` flags and, through autograd,
on its gradient with respect to the learner logprobs (which is what the optimizer sees; two
corrections can share values and differ in gradient, e.g. TIS's weight carries none).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.config import LearnerConfig
from learner.losses import (CORRECTIONS, decoupled_ppo_terms, pg_terms, policy_loss_terms, ppo_clip_terms,
                            tis_terms)

pytestmark = pytest.mark.unit

LO, HI = 0.2, 0.28


def _data(seed, B=6, T=9, adv_2d=False, spread=0.8):
    rng = np.random.default_rng(seed)
    lp = rng.normal(-1, spread, (B, T))
    prox = lp + rng.normal(0, 0.3, (B, T))  # proximal: close to current, not equal
    blp = rng.normal(-1, spread, (B, T))
    adv = rng.normal(size=(B, T) if adv_2d else B)
    mask = (rng.random((B, T)) < 0.7).astype(np.float64)
    return lp, prox, blp, adv, mask


def _adv2(adv, shape):
    return np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, shape)


# ---- NumPy references: value, bounded flag, d(loss)/d(logprobs) ----------------------------------

def np_decoupled(lp, prox, blp, adv, mask, lo, hi, cap):
    a = _adv2(adv, lp.shape)
    raw_w = np.exp(np.clip(prox - blp, -20, 20))
    w = np.minimum(raw_w, cap)
    r = np.exp(np.clip(lp - prox, -20, 20))
    un, cl = r * a, np.clip(r, 1 - lo, 1 + hi) * a
    take_un = un <= cl  # min picks the unclipped term: gradient flows through r
    val = -w * np.minimum(un, cl) * mask
    grad = np.where(take_un, -w * r * a, 0.0) * mask
    return val, ((cl < un) | (raw_w > cap)) & (mask > 0), grad


def np_tis(lp, blp, adv, mask, cap):
    a = _adv2(adv, lp.shape)
    raw_w = np.exp(np.clip(lp - blp, -20, 20))
    w = np.minimum(raw_w, cap)
    return -w * a * lp * mask, (raw_w > cap) & (mask > 0), -w * a * mask


def np_pg(lp, adv, mask):
    a = _adv2(adv, lp.shape)
    return -a * lp * mask, np.zeros(lp.shape, bool), -a * mask


def np_ppo(lp, blp, adv, mask, lo, hi):
    a = _adv2(adv, lp.shape)
    r = np.exp(lp - blp)
    un, cl = r * a, np.clip(r, 1 - lo, 1 + hi) * a
    return -np.minimum(un, cl) * mask, (cl < un) & (mask > 0), np.where(un <= cl, -r * a, 0.0) * mask


def _run(fn, lp, *rest, **kw):
    """Call a torch correction; returns (values, bounded, d sum(values) / d lp) as NumPy."""
    t_lp = torch.tensor(lp, requires_grad=True)
    terms, bounded = fn(t_lp, *(torch.tensor(x) for x in rest), **kw)
    terms.sum().backward()
    return terms.detach().numpy(), bounded.numpy(), t_lp.grad.numpy()


def _check(got, ref):
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-12, atol=1e-12)
    assert got[1].dtype == bool
    np.testing.assert_array_equal(got[1], ref[1])
    np.testing.assert_allclose(got[2], ref[2], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("adv_2d", [False, True])
@pytest.mark.parametrize("cap", [1.0, 1.5, 5.0])
def test_decoupled_matches_numpy(adv_2d, cap):
    lp, prox, blp, adv, mask = _data(0, adv_2d=adv_2d)
    got = _run(decoupled_ppo_terms, lp, prox, blp, adv, mask, clip_low=LO, clip_high=HI, cap=cap)
    ref = np_decoupled(lp, prox, blp, adv, mask, LO, HI, cap)
    _check(got, ref)
    raw_w = np.exp(prox - blp)[mask > 0]
    assert (raw_w > cap).any() and (raw_w < cap).any()  # the data exercises both sides of the cap


def test_decoupled_gets_no_gradient_through_proximal_or_behavior():
    lp, prox, blp, adv, mask = (torch.tensor(x) for x in _data(1))
    lp.requires_grad_(True)
    prox.requires_grad_(True)
    blp.requires_grad_(True)
    terms, _ = decoupled_ppo_terms(lp, prox, blp, adv, mask, clip_low=LO, clip_high=HI, cap=3.0)
    terms.sum().backward()
    assert lp.grad is not None and lp.grad.any()
    assert prox.grad is None and blp.grad is None


@pytest.mark.parametrize("adv_2d", [False, True])
@pytest.mark.parametrize("cap", [1.0, 2.0])
def test_tis_matches_numpy(adv_2d, cap):
    lp, _, blp, adv, mask = _data(2, adv_2d=adv_2d)
    got = _run(tis_terms, lp, blp, adv, mask, cap=cap)
    ref = np_tis(lp, blp, adv, mask, cap)
    _check(got, ref)
    raw_w = np.exp(lp - blp)[mask > 0]
    assert (raw_w > cap).any() and (raw_w < cap).any()


@pytest.mark.parametrize("adv_2d", [False, True])
def test_plain_pg_matches_numpy(adv_2d):
    lp, _, _, adv, mask = _data(3, adv_2d=adv_2d)
    _check(_run(pg_terms, lp, adv, mask), np_pg(lp, adv, mask))


def test_ppo_clip_gradient_matches_numpy():
    lp, _, blp, adv, mask = _data(4)
    got = _run(ppo_clip_terms, lp, blp, adv, mask, clip_low=LO, clip_high=HI)
    ref = np_ppo(lp, blp, adv, mask, LO, HI)
    _check(got, ref)
    assert ref[1].any() and (ref[2] != 0).any()


def test_dispatch_selects_each_correction():
    lp, prox, blp, adv, mask = _data(5)
    kw = dict(clip_low=LO, clip_high=HI, decoupled_cap=3.0, tis_cap=2.0)
    refs = {"ppo_clip": np_ppo(lp, blp, adv, mask, LO, HI),
            # without explicit proximal logprobs the dispatcher uses the current ones, detached
            "decoupled": np_decoupled(lp, lp, blp, adv, mask, LO, HI, 3.0),
            "tis": np_tis(lp, blp, adv, mask, 2.0), "none": np_pg(lp, adv, mask)}
    assert set(refs) == set(CORRECTIONS)
    for name, ref in refs.items():
        _check(_run(lambda *a, **k: policy_loss_terms(name, *a, **k), lp, blp, adv, mask, **kw), ref)
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        policy_loss_terms("vtrace", *(torch.tensor(x) for x in (lp, blp, adv, mask)), **kw)


def test_all_corrections_agree_on_policy():
    """Behavior == current (staleness 0, exact engine): every correction is the same policy
    gradient -A grad log pi, so on-policy training does not depend on the choice."""
    lp, _, _, adv, mask = _data(6)
    kw = dict(clip_low=LO, clip_high=HI, decoupled_cap=5.0, tis_cap=2.0)
    grads = [_run(lambda *a, **k: policy_loss_terms(name, *a, **k), lp, lp.copy(), adv, mask, **kw)[2]
             for name in CORRECTIONS]
    for g in grads[1:]:
        np.testing.assert_allclose(g, grads[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads[0], -_adv2(adv, lp.shape) * mask, rtol=1e-12)


def test_decoupled_stale_weight_is_what_separates_it_from_ppo_clip():
    """With proximal == current, decoupled's gradient is PPO-clip's one-step gradient (clip inactive
    at r = 1) times the truncated behavior weight: a stale token with a large weight is capped."""
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    blp = torch.tensor([[-3.0, 0.5]])  # weights e^3 ~ 20 (capped at 5) and e^-0.5
    adv = torch.tensor([1.0])
    terms, bounded = policy_loss_terms("decoupled", lp, blp, adv, torch.ones(1, 2), clip_low=LO, clip_high=HI,
                                       decoupled_cap=5.0, tis_cap=2.0)
    terms.sum().backward()
    np.testing.assert_allclose(lp.grad.numpy(), [[-5.0, -np.exp(-0.5)]], rtol=1e-6)
    assert bounded.tolist() == [[True, False]]


def test_config_rejects_bad_corrections():
    from runbase.configload import ConfigError

    assert LearnerConfig().correction == "ppo_clip"  # today's behaviour stays the default
    with pytest.raises(ConfigError, match="tis_cap"):
        LearnerConfig(tis_cap=0.5)
    with pytest.raises(ConfigError, match="decoupled_cap"):
        LearnerConfig(decoupled_cap=0.9)
