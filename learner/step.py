"""The train step: one optimizer step of the policy on a rank's share of a batch, collective over the
learner group (every rank calls it with the same number of rows) and identical on any number of ranks."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from learner import metric_names as M
from learner.advantages import kl_penalty
from learner.batching import collate, layout, to_device
from learner.losses import normalize, policy_loss_terms
from learner.model import clip_grad_norm, optimizer_step, response_logprobs, shadow_of
from learner.ppo import plan_micro_batches


@torch.no_grad()
def _micro_batch_sums(loss, clipped, lp, b) -> torch.Tensor:
    """One micro-batch's share of train_step's accumulator: loss, clipped tokens, tokens, |lp - behavior|,
    k3 KL, then tokens, |lp - behavior| and k3 over its staleness-0 rows (b["fresh"])."""
    d = (lp - b["behavior_logprobs"]) * b["mask"]
    k3 = (d.exp() - 1 - d) * b["mask"]
    f = b["fresh"]
    return torch.stack([loss.detach(), clipped.sum(), b["mask"].sum(), d.abs().sum(), k3.sum(),
                        (b["mask"] * f).sum(), (d.abs() * f).sum(), (k3 * f).sum()]).double().cpu()


def _step_stats(acc: torch.Tensor, grad_norm: float) -> dict:
    """The step's metrics from train_step's all-reduced accumulator (its layout is written there)."""
    fresh_tokens = max(float(acc[5]), 1.0)
    return {M.LOSS: float(acc[0]), M.CLIP_FRAC: float(acc[1] / acc[2]), M.GRAD_NORM: grad_norm,
            M.MISMATCH_ABS: float(acc[3] / acc[2]), M.MISMATCH_KL: float(acc[4] / acc[2]),
            M.FRESH_TOKENS: float(acc[5]), M.ENGINE_MISMATCH_ABS: float(acc[6]) / fresh_tokens,
            M.ENGINE_MISMATCH_KL: float(acc[7]) / fresh_tokens}


def _micro_batches(model, plan, prep, lc, acc, kl_sum, rows, *, world, pad_id, device, temperature,
                   total_tokens) -> None:
    """Forward and backward of each micro-batch of the step's `plan`; its sums go into `acc` (train_step's
    layout) and the reference KL into `kl_sum`."""
    for mb in plan:
        fields = prep.token_fields(mb, ["advantages", "ref_logprobs"]) if prep else None
        b = to_device(collate(mb, pad_id, fields, **layout(lc)), device)
        lp = response_logprobs(model, b, temperature, lc.logprob_chunk_tokens)
        # decoupled: proximal = lp.detach(), the pre-update policy (one optimizer step per batch)
        terms, clipped = policy_loss_terms(lc.correction, lp, b["behavior_logprobs"], b["advantages"], b["mask"],
                                           clip_low=lc.clip_low, clip_high=lc.clip_high,
                                           decoupled_cap=lc.decoupled_cap, tis_cap=lc.tis_cap)
        if "ref_logprobs" in b:
            kl = kl_penalty(lp, b["ref_logprobs"], lc.kl_loss_type) * b["mask"]
            if prep.kl_loss:  # verl: policy loss + kl_loss_coef x KL, aggregated like the policy loss
                terms = terms + lc.kl_loss_coef * kl
            kl_sum += kl.detach().sum().double().cpu()
        loss = normalize(terms, b["mask"], lc.loss_norm, total_tokens=total_tokens, total_seqs=len(rows),
                         seq_weight=b["seq_weight"])
        (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already global
        acc[:8] += _micro_batch_sums(loss, clipped, lp, b)


def train_step(model, opt, share, rows, lc, *, temperature: float, world: int, pad_id: int, device,
               group=None, extras=None) -> dict:
    """One optimizer step on this rank's share; identical on any number of ranks (see losses.py).

    Collective over the learner group: every rank must call it with the same number of rows.
    `extras` (learner/ppo.py PPOExtras): learn-time token advantages from the critic or REINFORCE++,
    the reference KL loss, and the critic's own update after the policy's.
    """

    total_tokens = float(sum(r.loss_tokens for r in rows))  # the model's tokens: environment tokens are no loss
    # loss, clipped tokens, tokens, |lp - behavior|, k3 KL, and the last three again over staleness-0
    # rows only: same weights on both sides, so that is the engine-vs-learner numerical noise floor;
    # then a non-finite flag per rank (summed by the all-reduce: ranks skip a step together).
    acc = torch.zeros(9, dtype=torch.float64)
    plan = plan_micro_batches(share, lc.micro_batch_size_per_gpu,
                              lc.max_tokens_per_micro_batch if lc.use_dynamic_bsz else 0, group, packed=lc.pack_sequences)
    prep = extras.prepare(share, rows, plan, pad_id=pad_id, temperature=temperature) if extras else None
    kl_sum = torch.zeros(1, dtype=torch.float64)  # KL(pi || ref) summed over tokens (with a reference)
    model.train()
    shadow = shadow_of(model)  # learner.plain_compute=shadow: the step computes on a bf16 copy of the weights
    if shadow:  # the weights as they are now: last step's update, or a checkpoint loaded since
        shadow.refresh()
    with shadow.computing(model) if shadow else contextlib.nullcontext():
        _micro_batches(model, plan, prep, lc, acc, kl_sum, rows, world=world, pad_id=pad_id, device=device,
                       temperature=temperature, total_tokens=total_tokens)
    if shadow:
        shadow.to_masters()
    grad_norm = clip_grad_norm(model, lc.grad_clip, group)
    acc[8] = float(not (math.isfinite(float(acc[0])) and math.isfinite(grad_norm)))  # this rank's verdict
    dist.all_reduce(acc, group=group)  # one verdict for all: a non-finite loss or norm on any rank skips
    if acc[8] > 0:  # never apply it: optimizer state untouched (no Adam moments fed a NaN), no version
        opt.zero_grad(set_to_none=True)
        return {M.SKIPPED: 1, M.SKIP_REASON: "non-finite " + ("loss" if not math.isfinite(float(acc[0]))
                                                              else "grad norm")}
    if grad_norm == 0.0:
        # No sample carried a signal (every group's rewards alike, no KL term): AdamW would still move the weights
        # by its momentum and shrink its second moments, so that the next real gradient's step comes out several
        # times its usual size. Over a long run of such steps (a near-deterministic policy) that drifted a policy
        # until it froze (BENCHMARKS.md, the soak); nothing is applied instead, the optimizer's state kept as it is.
        opt.zero_grad(set_to_none=True)
    else:
        optimizer_step(opt, model, optimizer_offload=lc.optimizer_offload, device=device)
    stats = _step_stats(acc, grad_norm)
    if lc.use_dynamic_bsz:
        stats[M.MICRO_BATCHES] = len(plan)
    if prep is not None:
        stats.update(prep.stats)
        if extras.ref is not None:
            dist.all_reduce(kl_sum, group=group)
            stats[M.KL_REF] = float(kl_sum[0] / acc[2])
        if extras.critic is not None:
            stats.update(extras.update_critic(share, rows, prep, pad_id=pad_id, world=world))
    return stats
