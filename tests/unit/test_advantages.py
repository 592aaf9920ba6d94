"""learner/advantages.py against NumPy loops written from the papers' definitions, row by row."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.advantages import (AdaptiveKL, FixedKL, compute_advantages, discounted_returns, gae, kl_penalty,
                                masked_whiten, token_level_scores, value_loss_terms)

pytestmark = pytest.mark.unit


def ragged(rng, b=6, t=9):
    """A right-padded batch: lengths 0..t (one empty row), random values everywhere (padding too,
    so a leak from padding into real tokens would show)."""
    lengths = rng.integers(1, t + 1, b)
    lengths[0] = 0
    lengths[1] = t
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    return lengths, mask


def np_gae_row(r, v, gamma, lam):
    """Textbook GAE on one episode of length n (V after the end is 0)."""
    n = len(r)
    adv = np.zeros(n)
    last = 0.0
    for t in reversed(range(n)):
        nv = v[t + 1] if t + 1 < n else 0.0
        delta = r[t] + gamma * nv - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, adv + v


def np_whiten(x, mask):
    vals = x[mask > 0]
    return (x - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8) * mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.5)])
def test_gae_matches_numpy_per_row(seed, gamma, lam):
    rng = np.random.default_rng(seed)
    lengths, mask = ragged(rng)
    r, v = rng.normal(size=mask.shape), rng.normal(size=mask.shape)
    adv, ret = gae(torch.tensor(r), torch.tensor(v), torch.tensor(mask), gamma=gamma, lam=lam)
    for i, n in enumerate(lengths):
        a_ref, ret_ref = np_gae_row(r[i, :n], v[i, :n], gamma, lam)
        np.testing.assert_allclose(adv[i, :n].numpy(), a_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ret[i, :n].numpy(), ret_ref, rtol=1e-12, atol=1e-12)
        assert np.all(adv[i, n:].numpy() == 0) and np.all(ret[i, n:].numpy() == 0)


def test_gae_lambda_one_is_return_minus_value():
    rng = np.random.default_rng(3)
    lengths, mask = ragged(rng)
    r, v = rng.normal(size=mask.shape) * mask, rng.normal(size=mask.shape)
    adv, ret = gae(torch.tensor(r), torch.tensor(v), torch.tensor(mask), gamma=1.0, lam=1.0)
    mc = np.flip(np.cumsum(np.flip(r, 1), 1), 1) * mask  # undiscounted reward-to-go
    np.testing.assert_allclose(ret.numpy(), mc, atol=1e-12)
    np.testing.assert_allclose(adv.numpy(), (mc - v) * mask, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_discounted_returns_match_numpy(seed, gamma):
    rng = np.random.default_rng(seed)
    lengths, mask = ragged(rng)
    r = rng.normal(size=mask.shape)
    got = discounted_returns(torch.tensor(r), torch.tensor(mask), gamma=gamma).numpy()
    for i, n in enumerate(lengths):
        g, ref = 0.0, np.zeros(n)
        for t in reversed(range(n)):
            g = r[i, t] + gamma * g
            ref[t] = g
        np.testing.assert_allclose(got[i, :n], ref, rtol=1e-12, atol=1e-12)
        assert np.all(got[i, n:] == 0)


@pytest.mark.parametrize("seed", range(3))
def test_masked_whiten_matches_numpy_and_splits(seed):
    rng = np.random.default_rng(seed)
    _, mask = ragged(rng, b=8)
    x = rng.normal(3.0, 2.0, size=mask.shape)
    got = masked_whiten(torch.tensor(x), torch.tensor(mask)).numpy()
    np.testing.assert_allclose(got, np_whiten(x, mask), rtol=1e-10, atol=1e-10)
    # two "ranks" holding halves, with a summing reduce, give the same numbers as one batch
    halves = [slice(0, 3), slice(3, 8)]
    calls = []

    def reduce_over_halves(t):  # stands in for all_reduce: the same statistic of the other half is added
        calls.append(t)
        return t + other[len(calls) - 1]

    # the other half's contributions, computed as a rank would
    xa, ma = torch.tensor(x[halves[1]]), torch.tensor(mask[halves[1]])
    mean = (x * mask).sum() / mask.sum()
    other = [torch.stack([(xa * ma).sum(), ma.sum()]), (((xa - mean) ** 2) * ma).sum().reshape(1)]
    part = masked_whiten(torch.tensor(x[halves[0]]), torch.tensor(mask[halves[0]]), reduce=reduce_over_halves)
    np.testing.assert_allclose(part.numpy(), got[halves[0]], rtol=1e-10, atol=1e-10)


def test_token_level_scores_on_last_token():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    s = token_level_scores(torch.tensor([0.5, 9.0, -1.0, 2.0]), mask)
    expect = torch.zeros(4, 4, dtype=torch.float64)
    expect[0, 2], expect[2, 0], expect[3, 3] = 0.5, -1.0, 2.0
    assert torch.equal(s, expect)  # the empty row gets nothing


# ---- multi-turn rows: the mask has environment tokens (0) inside a row, not only padding after it --------

def multi_turn_mask(seed: int) -> np.ndarray:
    """Right-padded rows of 2-3 model turns (1) with environment spans (0) between them, one row ending in
    environment tokens too, and one single-turn row."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(5):
        row = []
        for turn in range(int(rng.integers(2, 4))):
            row += [0] * int(rng.integers(1, 4) if turn else 0) + [1] * int(rng.integers(1, 4))
        rows.append(row + ([0, 0] if k == 1 else []))
    rows.append([1] * 6)
    mask = np.zeros((len(rows), max(map(len, rows)) + 2))
    for i, row in enumerate(rows):
        mask[i, :len(row)] = row
    return mask


def np_returns(r, gamma):
    """Discounted reward-to-go of one episode."""
    g, out = 0.0, np.zeros(len(r))
    for t in reversed(range(len(r))):
        g = r[t] + gamma * g
        out[t] = g
    return out


def test_the_reward_lands_on_the_last_model_token():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0], [1, 0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [0] * 7],
                        dtype=torch.float64)
    s = token_level_scores(torch.tensor([0.5, -1.0, 2.0, 9.0]), mask)
    expect = torch.zeros(4, 7, dtype=torch.float64)
    expect[0, 4], expect[1, 3], expect[2, 2] = 0.5, -1.0, 2.0
    assert torch.equal(s, expect)
    for seed in range(3):
        m = multi_turn_mask(seed)
        s = token_level_scores(torch.arange(1.0, len(m) + 1), torch.tensor(m)).numpy()
        for i, row in enumerate(m):
            assert s[i, np.flatnonzero(row)[-1]] == i + 1 and np.count_nonzero(s[i]) == 1


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95)])
def test_returns_and_gae_run_over_the_model_tokens_as_one_sequence(seed, gamma, lam):
    """Environment tokens are passed over: the returns and GAE of a masked row equal the textbook ones of its
    model tokens alone (the reward from the last turn reaches the first), zero on every other position."""
    m = multi_turn_mask(seed)
    rng = np.random.default_rng(seed + 10)
    rewards = token_level_scores(torch.tensor(rng.normal(size=len(m))), torch.tensor(m))
    rewards = rewards + torch.tensor(rng.normal(size=m.shape) * m * 0.1)  # per-token terms too (a KL penalty)
    values = rng.normal(size=m.shape)  # random on environment tokens and padding: they must not leak in
    ret = discounted_returns(rewards, torch.tensor(m), gamma=gamma).numpy()
    adv, vret = (x.numpy() for x in gae(rewards, torch.tensor(values), torch.tensor(m), gamma=gamma, lam=lam))
    for i, row in enumerate(m):
        on = row > 0
        r_model, v_model = rewards[i].numpy()[on], values[i][on]
        np.testing.assert_allclose(ret[i, on], np_returns(r_model, gamma), rtol=1e-12, atol=1e-12)
        a_ref, ret_ref = np_gae_row(r_model, v_model, gamma, lam)
        np.testing.assert_allclose(adv[i, on], a_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(vret[i, on], ret_ref, rtol=1e-12, atol=1e-12)
        assert not ret[i, ~on].any() and not adv[i, ~on].any() and not vret[i, ~on].any()


def np_kl(lp, ref, kind):
    d = lp - ref
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return np.abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    x = np.clip(ref - lp, -20, 20)
    return np.clip(np.exp(x) - x - 1, -10, 10)


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_kl_penalty_matches_numpy(kind):
    rng = np.random.default_rng(1)
    lp, ref = -rng.random(50) * 4, -rng.random(50) * 4
    lp[0], ref[0] = -30.0, -1.0  # exercises the clamps
    got = kl_penalty(torch.tensor(lp), torch.tensor(ref), kind).numpy()
    np.testing.assert_allclose(got, np_kl(lp, ref, kind), rtol=1e-12, atol=1e-12)


def test_k3_is_an_unbiased_nonnegative_kl_estimate():
    """E_{x~p}[k3] = KL(p || q) for samples from p: check on a small discrete pair."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    k3 = kl_penalty(p.log(), q.log(), "k3")
    assert torch.all(k3 >= 0)
    assert float((p * k3).sum()) == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-12)
    with pytest.raises(ValueError, match="unknown KL"):
        kl_penalty(p, q, "full")


@pytest.mark.parametrize("seed", range(3))
def test_value_loss_matches_numpy_and_gradient(seed):
    rng = np.random.default_rng(seed)
    _, mask = ragged(rng)
    v, old, ret = rng.normal(size=mask.shape), rng.normal(size=mask.shape), rng.normal(size=mask.shape)
    c = 0.3
    vt = torch.tensor(v, requires_grad=True)
    terms, clipped = value_loss_terms(vt, torch.tensor(old), torch.tensor(ret), torch.tensor(mask), cliprange=c)
    vc = old + np.clip(v - old, -c, c)
    l1, l2 = (v - ret) ** 2, (vc - ret) ** 2
    np.testing.assert_allclose(terms.detach().numpy(), 0.5 * np.maximum(l1, l2) * mask, atol=1e-12)
    assert np.array_equal(clipped.numpy(), (l2 > l1) & (mask > 0))
    terms.sum().backward()
    # gradient: (v - R) where the unclipped branch is the max; 0 where the clipped, saturated one is
    sat = np.abs(v - old) > c
    grad = np.where((l2 > l1) & sat, 0.0, v - ret) * mask
    np.testing.assert_allclose(vt.grad.numpy(), grad, atol=1e-12)


def test_value_loss_unclipped_when_values_equal_old():
    """One critic step per batch: the learn-time values are the old values, so clipping never binds."""
    v = torch.randn(4, 5, dtype=torch.float64)
    terms, clipped = value_loss_terms(v, v.clone(), torch.randn(4, 5, dtype=torch.float64), torch.ones(4, 5),
                                      cliprange=0.01)
    assert not clipped.any()


def test_compute_advantages_estimators():
    rng = np.random.default_rng(5)
    lengths, mask = ragged(rng)
    r = token_level_scores(torch.tensor(rng.random(len(lengths))), torch.tensor(mask))
    v = torch.tensor(rng.normal(size=mask.shape))
    adv, ret = compute_advantages("gae", r, torch.tensor(mask), values=v, gamma=0.99, lam=0.95)
    raw, ret_ref = gae(r, v, torch.tensor(mask), gamma=0.99, lam=0.95)
    np.testing.assert_allclose(adv.numpy(), np_whiten(raw.numpy(), mask), atol=1e-10)
    assert torch.equal(ret, ret_ref)
    adv, ret = compute_advantages("reinforce_pp", r, torch.tensor(mask), gamma=1.0)
    g = discounted_returns(r, torch.tensor(mask), gamma=1.0).numpy()
    np.testing.assert_allclose(adv.numpy(), np_whiten(g, mask), atol=1e-10)
    assert ret is None
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", r, torch.tensor(mask))


def test_kl_controllers():
    fixed = FixedKL(0.05)
    fixed.update(10.0, 100)
    assert fixed.value == 0.05
    ctl = AdaptiveKL(0.1, target=0.02, horizon=1000)
    ctl.update(0.04, n_steps=100)  # KL at twice the target: error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    ctl.update(0.0, n_steps=100)  # below target: the coefficient falls
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.98)
