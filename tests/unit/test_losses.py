"""learner/losses.py against independent NumPy references."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.losses import grpo_advantages, normalize, ppo_clip_terms, token_logprobs

pytestmark = pytest.mark.unit


def np_grpo(r, g, scale=True):
    out = np.zeros_like(r, dtype=np.float64)
    for lab in np.unique(g):
        idx = np.where(g == lab)[0]
        x = r[idx].astype(np.float64)
        c = x - x.mean()
        if scale:
            sd = x.std(ddof=1) if len(x) > 1 else 0.0
            c = c / (sd + 1e-6)
        out[idx] = c
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scale", [True, False])
def test_grpo_matches_numpy_noncontiguous_labels(seed, scale):
    rng = np.random.default_rng(seed)
    labels = rng.choice([-7, 3, 42, 1000, 5], size=40)  # arbitrary, interleaved
    r = rng.normal(size=40)
    got = grpo_advantages(torch.tensor(r), torch.tensor(labels), scale=scale).numpy()
    np.testing.assert_allclose(got, np_grpo(r, labels, scale), rtol=1e-9, atol=1e-9)


def test_grpo_degenerate_groups_are_zero():
    r = torch.tensor([0.7, 0.7, 0.7, 0.9, 0.1, 0.3], dtype=torch.float64)
    g = torch.tensor([9, 9, 9, 4, 2, 2])  # all-equal group, singleton group, normal group
    adv = grpo_advantages(r, g)
    assert torch.all(torch.isfinite(adv))
    torch.testing.assert_close(adv[:4], torch.zeros(4, dtype=torch.float64), rtol=0, atol=1e-6)
    assert adv[4] < 0 < adv[5]
    assert grpo_advantages(r, g, scale=False)[3].item() == 0.0


def np_ppo(lp, blp, adv, mask, lo, hi):
    if adv.ndim == 1:
        adv = adv[:, None]
    ratio = np.exp(np.clip(lp - blp, -20, 20))  # learner/losses.py LOG_RATIO_CLAMP
    un, cl = ratio * adv, np.clip(ratio, 1 - lo, 1 + hi) * adv
    return -np.minimum(un, cl) * mask, (cl < un) & (mask > 0)


@pytest.mark.parametrize("adv_2d", [False, True])
def test_ppo_clip_terms_matches_numpy(adv_2d):
    rng = np.random.default_rng(1)
    B, T = 6, 9
    lp, blp = rng.normal(-1, 0.5, (B, T)), rng.normal(-1, 0.5, (B, T))
    adv = rng.normal(size=(B, T) if adv_2d else B)
    mask = (rng.random((B, T)) < 0.7).astype(np.float64)
    terms, clipped = ppo_clip_terms(*(torch.tensor(x) for x in (lp, blp, adv, mask)), clip_low=0.2, clip_high=0.28)
    ref_t, ref_c = np_ppo(lp, blp, adv, mask, 0.2, 0.28)
    np.testing.assert_allclose(terms.numpy(), ref_t, rtol=1e-12, atol=1e-12)
    assert clipped.dtype == torch.bool
    np.testing.assert_array_equal(clipped.numpy(), ref_c)
    assert ref_c.any() and not ref_c.all()  # the data exercises both branches
    assert not clipped[mask == 0].any() and (terms[mask == 0] == 0).all()


def test_ppo_clipped_flag_direction():
    # ratio e^1 > 1+hi with A>0: clipped; ratio e^-1 < 1-lo with A>0: not clipped (min keeps unclipped).
    lp = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    z = torch.zeros_like(lp)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    _, c = ppo_clip_terms(lp, z, adv, torch.ones_like(lp), clip_low=0.2, clip_high=0.2)
    assert c.tolist() == [[True, False, False, True]]


def _batch(seed, B=8, T=7):
    rng = np.random.default_rng(seed)
    terms = rng.normal(size=(B, T))
    mask = (rng.random((B, T)) < 0.6).astype(np.float64)
    mask[0] = 0  # an all-padding row must not divide by zero
    return terms * mask, mask


def test_normalize_matches_numpy():
    terms, mask = _batch(0)
    tt, tm = torch.tensor(terms), torch.tensor(mask)
    ntok, nseq = mask.sum(), mask.shape[0]
    got = normalize(tt, tm, "token_mean", total_tokens=ntok, total_seqs=nseq)
    np.testing.assert_allclose(got.item(), terms.sum() / ntok, rtol=1e-12)
    per_seq = [terms[i].sum() / max(mask[i].sum(), 1) for i in range(nseq)]
    got = normalize(tt, tm, "seq_mean_token_mean", total_tokens=ntok, total_seqs=nseq)
    np.testing.assert_allclose(got.item(), sum(per_seq) / nseq, rtol=1e-12)
    with pytest.raises(ValueError):
        normalize(tt, tm, "nope", total_tokens=ntok, total_seqs=nseq)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("cut", [1, 3, 5])
def test_normalize_split_sums_to_whole(mode, cut):
    terms, mask = (torch.tensor(x) for x in _batch(cut))
    kw = dict(total_tokens=float(mask.sum()), total_seqs=float(mask.shape[0]))
    whole = normalize(terms, mask, mode, **kw)
    halves = normalize(terms[:cut], mask[:cut], mode, **kw) + normalize(terms[cut:], mask[cut:], mode, **kw)
    torch.testing.assert_close(halves, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_token_logprobs_matches_numpy(temperature):
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (2, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 5))
    z = logits.astype(np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ref = np.take_along_axis(logsm, targets[..., None], -1)[..., 0]
    got = token_logprobs(torch.tensor(logits), torch.tensor(targets), temperature)
    assert got.shape == (2, 5) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-5)


def test_all_equal_group_has_zero_advantage_in_float32():
    for n in (2, 8, 16, 64):
        adv = grpo_advantages(torch.full((n,), 0.7, dtype=torch.float32), torch.zeros(n, dtype=torch.long))
        assert adv.dtype == torch.float32
        assert adv.abs().max().item() < 1e-6, n


@pytest.mark.parametrize("correction", ["ppo_clip", "decoupled", "tis"])
def test_an_impossible_behavior_logprob_cannot_overflow_the_loss(correction):
    """A behavior logprob of -100 (no engine samples that) once gave exp(99) = inf in float32, an infinite
    loss and NaN weights; the log-ratio is clamped before exp, so loss and gradient stay finite."""
    from learner.losses import policy_loss_terms

    lp = torch.full((2, 3), -1.0, requires_grad=True)
    blp = torch.tensor([[-1.0, -100.0, -1.0], [-1.0, -1.0, -1.0]])
    adv, mask = torch.tensor([-1.0, 1.0]), torch.ones(2, 3)
    terms, _ = policy_loss_terms(correction, lp, blp, adv, mask, clip_low=0.2, clip_high=0.2, decoupled_cap=5.0,
                                 tis_cap=2.0)
    terms.sum().backward()
    assert torch.isfinite(terms).all() and torch.isfinite(lp.grad).all()
