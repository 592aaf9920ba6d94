"""Advantages and policy losses: pure tensor functions, no I/O, tested against NumPy.

Shapes: `[B, T]` over response tokens, with `mask` 1 for real tokens and 0 for padding.
Every loss returns the *sum* of per-token (or per-sequence) terms and leaves normalisation
to `normalize`, so that splitting a batch over ranks and micro-batches gives the same
gradient as one big batch (the caller divides by a global count).
"""
from __future__ import annotations

import torch

from engines.logprobs import token_logprobs  # noqa: F401 - the losses' logprob op lives below engines and learner

GROUP_STD_EPS = 1e-6  # keeps all-equal-reward groups at advantage 0 instead of 0/0



# Log-ratios (policy vs behavior, proximal vs behavior) are clamped before exp, as verl does: a stale or
# corrupt behavior logprob (-100, say) must cost a clipped ratio, not an infinite loss and NaN weights.
LOG_RATIO_CLAMP = 20.0


def safe_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of a log-ratio clamped to +-LOG_RATIO_CLAMP (finite in float32 whatever the inputs)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, scale: bool = True) -> torch.Tensor:
    """Per-sample GRPO advantage: reward minus its group mean, optionally over the group std.

    `rewards` [N] float, `group_index` [N] int (samples of one prompt share an index).
    The std is the unbiased sample std (torch's default, as in verl/TRL). Computed in float64:
    in float32 the rounding error of an all-equal group's mean, divided by its tiny std,
    would leave non-zero advantages where there is no signal.
    """
    out_dtype = rewards.dtype
    rewards = rewards.double()
    groups, inverse = torch.unique(group_index, return_inverse=True)
    g = len(groups)
    counts = torch.zeros(g, dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(g, dtype=rewards.dtype).index_add_(0, inverse, rewards) / counts
    centered = rewards - mean[inverse]
    if not scale:
        return centered.to(out_dtype)
    var = torch.zeros(g, dtype=rewards.dtype).index_add_(0, inverse, centered**2) / (counts - 1).clamp(min=1)
    return (centered / (var.sqrt()[inverse] + GROUP_STD_EPS)).to(out_dtype)


def ppo_clip_terms(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, *, clip_low: float, clip_high: float):
    """Per-token PPO-clip loss on the ratio to the behavior policy, and clip statistics.

    Returns (loss_terms [B, T] masked, clipped [B, T] bool masked). `advantages` is [B] or [B, T].
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = safe_ratio(logprobs - behavior_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    terms = -torch.minimum(unclipped, clipped) * mask
    was_clipped = (clipped < unclipped) & mask.bool()
    return terms, was_clipped


def normalize(terms: torch.Tensor, mask: torch.Tensor, mode: str, *, total_tokens: float,
              total_seqs: float, seq_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of loss terms divided by a *global* count, so any split of the batch agrees.

    token_mean: sum over all tokens / tokens in the whole step batch.
    seq_mean_token_mean: per-sequence token mean, summed, / sequences in the step batch. With
    `seq_weight` (1 / its sequence's loss tokens at each of them: `collate` makes it, for either layout) the per-sequence means need no sequence-per-row layout; without it, each
    batch row is one sequence.
    """
    if mode == "token_mean":
        return terms.sum() / total_tokens
    if mode == "seq_mean_token_mean":
        if seq_weight is not None:
            return (terms * seq_weight).sum() / total_seqs
        per_seq = terms.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / total_seqs
    raise ValueError(f"unknown loss normalisation {mode!r}")


# ---- off-policy corrections (learner.correction) -----------------------------------------------
# Every function returns (loss_terms [B, T] masked, bounded [B, T] bool masked): `bounded` marks
# tokens where the correction limited the update (PPO clip or a truncated importance weight).
CORRECTIONS = ("ppo_clip", "decoupled", "tis", "none")


def decoupled_ppo_terms(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                        advantages: torch.Tensor, mask: torch.Tensor, *, clip_low: float, clip_high: float,
                        cap: float):
    """Decoupled PPO (Hilton et al. 2021; AReaL): clip the ratio to the *proximal* policy and
    correct behavior -> proximal with an importance weight truncated at `cap`.

    loss = -w * min(r A, clip(r) A), r = pi/pi_prox, w = min(pi_prox/pi_behav, cap) (no gradient
    through w: proximal and behavior logprobs are constants). The trust region is anchored at
    the learner's own recent policy, so stale behavior samples widen nothing but their weight.
    """
    proximal_logprobs = proximal_logprobs.detach()
    raw_w = safe_ratio(proximal_logprobs - behavior_logprobs.detach())
    terms, clipped = ppo_clip_terms(logprobs, proximal_logprobs, advantages, mask, clip_low=clip_low,
                                    clip_high=clip_high)
    return raw_w.clamp(max=cap) * terms, clipped | ((raw_w > cap) & mask.bool())


def tis_terms(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, cap: float):
    """Truncated importance sampling: policy gradient weighted by min(pi/pi_behav, cap).

    loss = -sg(w) * A * log pi: the weight corrects the sampling distribution but carries no
    gradient (the gradient is w A grad log pi, unbiased up to the truncation).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    raw_w = safe_ratio(logprobs.detach() - behavior_logprobs.detach())
    w = raw_w.clamp(max=cap)
    terms = -w * advantages * logprobs * mask
    return terms, (raw_w > cap) & mask.bool()


def pg_terms(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor):
    """Plain policy gradient (REINFORCE with GRPO advantages): assumes samples are on-policy."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    terms = -advantages * logprobs * mask
    return terms, torch.zeros_like(mask, dtype=torch.bool)


def policy_loss_terms(correction: str, logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                      advantages: torch.Tensor, mask: torch.Tensor, *, clip_low: float, clip_high: float,
                      decoupled_cap: float, tis_cap: float, proximal_logprobs: torch.Tensor | None = None):
    """The configured correction. For `decoupled` without explicit proximal logprobs, the proximal
    policy is the current weights before the update (`logprobs` detached): exact when each batch
    gets one optimizer step, as here (micro-batches only accumulate gradients)."""
    if correction == "ppo_clip":
        return ppo_clip_terms(logprobs, behavior_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    if correction == "decoupled":
        prox = logprobs.detach() if proximal_logprobs is None else proximal_logprobs
        return decoupled_ppo_terms(logprobs, prox, behavior_logprobs, advantages, mask, clip_low=clip_low,
                                   clip_high=clip_high, cap=decoupled_cap)
    if correction == "tis":
        return tis_terms(logprobs, behavior_logprobs, advantages, mask, cap=tis_cap)
    if correction == "none":
        return pg_terms(logprobs, advantages, mask)
    raise ValueError(f"unknown off-policy correction {correction!r}; choose from {CORRECTIONS}")
