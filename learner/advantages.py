"""Token-level advantages (GAE, REINFORCE++), the clipped value loss and KL estimators.

Pure tensor functions, tested against NumPy loops in tests/unit/test_advantages.py. They follow
verl's `trainer/ppo/core_algos.py` so that numbers carry over (REINFORCE++'s returns differ only where a
mask has zeros inside a row: see `discounted_returns`), with one addition: every batch-wide
statistic (the whitening mean and variance, the KL controller's batch KL) takes a `reduce`
callback that sums a float64 tensor over the learner group. With `reduce` = identity the
functions are plain single-process math; with an all-reduce they give the same numbers on any
number of ranks (each rank holds only its share of the step batch).

Shapes: `[B, T]` over response tokens, right-padded, `mask` 1 on the tokens trained on (the model's;
0 on padding and on a multi-turn row's environment tokens). Within the learner the grid is the
per-rank response grid built by `learner.batching.response_grid`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

WHITEN_EPS = 1e-8        # verl's masked_whiten epsilon: keeps an all-equal batch at 0, not 0/0
KL_CLAMP = 20.0          # low_var_kl: log-ratio clamp before exp (verl), avoids inf on outliers
KL_VALUE_CLAMP = 10.0    # low_var_kl: the estimate itself is clamped (verl), bounding one token's pull
ADAPTIVE_KL_STEP = 0.2   # adaptive controller: at most +-20% proportional error per update (Ziegler et al.)

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def token_level_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Outcome reward on the last masked token of each row, zero elsewhere ([B] -> [B, T]): the
    model's last token, also when a multi-turn row's mask has environment tokens inside or after it.

    A row without masked tokens gets nothing (there is no action to credit).
    """
    scores = torch.zeros(mask.shape, dtype=torch.float64)
    on = mask > 0
    has = on.any(-1)
    last = torch.where(on, torch.arange(mask.shape[-1]), -1).amax(-1)  # -1 on rows without one
    rows = torch.arange(mask.shape[0])[has]
    scores[rows, last[has]] = rewards.double()[has]
    return scores


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from the sampled token's logprobs (verl's kl_penalty).

    `k1`/`kl`: log pi - log ref (unbiased, high variance, can be negative); `abs`: its absolute
    value; `k2`/`mse`: half its square; `k3`/`low_var_kl`: ref/pi - log(ref/pi) - 1 (Schulman's
    unbiased non-negative low-variance estimator), clamped like verl's.
    """
    d = logprobs - ref_logprobs
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("k2", "mse"):
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        lr = (-d).clamp(-KL_CLAMP, KL_CLAMP)
        return (lr.exp() - lr - 1).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; choose from {KL_KINDS}")


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, reduce: Reduce = _identity) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries of the whole (global) batch.

    Unbiased variance (Bessel), as verl's masked_whiten. Two passes (mean, then centred squares),
    each one float64 sum reduced over ranks, so the result does not depend on the split.
    """
    x, m = values.double(), mask.double()
    s = reduce(torch.stack([(x * m).sum(), m.sum()]))
    count = float(s[1])
    if count < 2:  # no spread to normalise by: centre only
        return ((x - s[0] / max(count, 1.0)) * m).to(values.dtype)
    mean = s[0] / count
    ss = reduce(((x - mean).square() * m).sum().reshape(1))[0]
    var = ss / count * (count / (count - 1))
    return ((x - mean) * torch.rsqrt(var + WHITEN_EPS) * m).to(values.dtype)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens; returns (advantages, returns), raw.

    delta_t = r_t + gamma V_{t+1} - V_t (V after the last real token is 0: the episode ends),
    A_t = delta_t + gamma lam A_{t+1}; returns = A + V (the critic's regression target).
    Padding carries the recursion through unchanged (verl's masked form), so right padding never
    leaks into real tokens, and a multi-turn row's environment tokens are passed over: its model
    tokens make one sequence. Whitening is separate (`masked_whiten`), as it needs the global batch.
    """
    r, v, m = token_rewards.double(), values.double() * mask.double(), mask.double()
    b, t_len = r.shape
    next_value = torch.zeros(b, dtype=torch.float64)
    last = torch.zeros(b, dtype=torch.float64)
    adv = torch.zeros_like(r)
    for t in reversed(range(t_len)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        new = delta + gamma * lam * last
        next_value = v[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = new * m[:, t] + (1 - m[:, t]) * last
        adv[:, t] = last
    return adv * m, (adv + v) * m


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """REINFORCE++ returns: G_t = r_t + gamma G_{t+1} over each row's masked tokens, 0 elsewhere.

    Unmasked positions are no step: the return passes them unchanged (as GAE's masked form does), so a
    multi-turn row's environment tokens neither discount nor cut the reward on its way to earlier turns;
    right padding, after the last token, adds nothing (its rewards are ignored).
    """
    r, m = token_rewards.double(), mask.double()
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=torch.float64)
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t] > 0, r[:, t] + gamma * running, running)
        out[:, t] = running
    return out * m


def compute_advantages(estimator: str, token_rewards: torch.Tensor, mask: torch.Tensor, *,
                       values: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
                       reduce: Reduce = _identity) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-level (advantages, returns) for `gae` or `reinforce_pp`, whitened over the global batch.

    `gae` needs the critic's `values` and gives returns for its loss; `reinforce_pp` (REINFORCE++,
    Hu 2025) needs no critic: discounted returns whitened over the batch are the advantages.
    """
    if estimator == "gae":
        if values is None:
            raise ValueError("gae needs the critic's values")
        adv, ret = gae(token_rewards, values, mask, gamma=gamma, lam=lam)
        return masked_whiten(adv, mask, reduce=reduce), ret
    if estimator == "reinforce_pp":
        ret = discounted_returns(token_rewards, mask, gamma=gamma)
        return masked_whiten(ret, mask, reduce=reduce), None
    raise ValueError(f"token-level advantages for {estimator!r}: choose gae or reinforce_pp")


def value_loss_terms(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                     *, cliprange: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped value loss per token: 0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2), masked.

    Returns (terms [B, T], clipped [B, T] bool: the clipped branch was the larger). As the policy
    losses, these are sums to be normalised by global counts (`losses.normalize`).
    """
    clipped_v = old_values + (values - old_values).clamp(-cliprange, cliprange)
    l1 = (values - returns).square()
    l2 = (clipped_v - returns).square()
    terms = 0.5 * torch.maximum(l1, l2) * mask
    return terms, (l2 > l1) & mask.bool()


class FixedKL:
    """Constant KL-in-reward coefficient (verl algorithm.kl_ctrl.type=fixed)."""

    def __init__(self, coef: float):
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKL:
    """Ziegler et al.'s controller (verl algorithm.kl_ctrl.type=adaptive): moves the coefficient so
    the measured KL approaches `target`, by at most ADAPTIVE_KL_STEP x n_steps / horizon per update."""

    def __init__(self, coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(current_kl / self.target - 1, -ADAPTIVE_KL_STEP), ADAPTIVE_KL_STEP)
        self.value *= 1 + err * n_steps / self.horizon
