"""PPO's extra models in the learner group: the critic (value model) and the frozen reference policy.

`PPOExtras` is built when `algorithm.adv_estimator` is `gae`/`reinforce_pp` or a reference KL is
asked for; with the default GRPO and no KL, none of this exists and `train_step` runs exactly as
before. Per step (inside `learner.step.train_step`, collective over the learner group):

1. `prepare`: forward passes without gradient on this rank's share: the critic's values (gae) and
   the reference logprobs (KL); token rewards (outcome reward on the last token, minus the in-reward
   KL penalty); token advantages and returns (learner/advantages.py), whitened over the global batch.
   Values come from the *current* critic at learn time, so advantages stay right however stale the
   samples are; the policy side handles staleness with `learner.correction`, unchanged.
2. the policy step uses those token advantages, plus `kl_loss_coef x KL(pi || ref)` when asked;
3. `update_critic`: `critic.ppo_epochs` optimizer steps of the clipped value loss on the same rows.

Both models are FSDP2-sharded like the policy (`learner.model.shard`), each optionally offloaded.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from learner import metric_names as M
from learner.advantages import AdaptiveKL, FixedKL, compute_advantages, kl_penalty, token_level_scores, value_loss_terms
from learner.batching import (collate, from_shifted, layout, micro_batches, model_inputs, response_grid,
                              split_by_tokens, to_device, token_budget_count)
from learner.losses import normalize
from learner.model import (clip_grad_norm, load_critic, load_policy, optimizer_step, response_logprobs,
                           set_eos_logit_bias, shard)

log = logging.getLogger(__name__)

CRITIC_SEED_OFFSET = 7919  # the critic head's init seed = learner.seed + this (same on every rank)
CRITIC_TOKEN_FACTOR = 2    # critic token budget / policy's when unset: no vocabulary logits (verl)


def needs_extras(cfg) -> bool:
    al, lc = cfg.algorithm, cfg.learner
    return al.adv_estimator != "grpo" or lc.use_kl_loss or al.use_kl_in_reward


def plan_micro_batches(share, size: int, max_tokens: int, group=None, *, packed: bool = False) -> list:
    """Fixed-size micro-batches, or (max_tokens > 0) micro-batches within a token budget (real tokens
    when `packed`, else rows x longest), as many on every rank as the rank that needs the most
    (collective when max_tokens > 0)."""
    if not max_tokens:
        return micro_batches(share, size)
    n = torch.tensor([token_budget_count([r.num_tokens for r in share], max_tokens, packed)])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    return split_by_tokens(share, max_tokens, int(n), packed)


def _sum_over_ranks(group):
    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.double().clone()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
        return t
    return reduce


class Prepared:
    """Learn-time per-token values of one step's share, looked up per row for any micro-batching."""

    def __init__(self):
        self.fields: dict[str, dict[int, torch.Tensor]] = {}
        self.kl_loss = False
        self.stats: dict[str, float] = {}

    def put(self, name: str, rows, values) -> None:
        d = self.fields.setdefault(name, {})
        for r, v in zip(rows, values):
            d[id(r)] = v

    def token_fields(self, mb, names=None) -> dict[str, list]:
        names = [n for n in (names or self.fields) if n in self.fields]
        return {n: [self.fields[n][id(r)] for r in mb] for n in names}


class PPOExtras:
    """The critic and/or reference policy of one learner rank, and the KL controller."""

    def __init__(self, cfg, model_path: str, device: torch.device, *, group=None):
        self.al, self.lc, self.cc = cfg.algorithm, cfg.learner, cfg.critic
        self.device, self.group = device, group
        self.ref = self.critic = self.critic_opt = None
        if self.lc.use_kl_loss or self.al.use_kl_in_reward:
            ref = load_policy(model_path, device, self.lc.attn_implementation, self.lc.master_dtype)
            set_eos_logit_bias(ref, model_path, cfg.actors.eos_logit_bias)  # the reference is scored as the policy
            self.ref = shard(ref, device, param_dtype=self.lc.param_dtype, offload=self.lc.ref_param_offload)
            self.ref.requires_grad_(False)
            self.ref.eval()
        if self.al.adv_estimator == "gae":
            with torch.random.fork_rng(devices=[]):  # leaves the learner's own RNG stream untouched
                torch.manual_seed(self.lc.seed + CRITIC_SEED_OFFSET)
                critic = load_critic(self.cc.model_path or model_path, device, self.lc.attn_implementation)
            self.critic = shard(critic, device, param_dtype=self.lc.param_dtype,
                                activation_checkpointing=self.cc.activation_checkpointing,
                                offload=self.cc.param_offload)
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=self.cc.lr,
                                                weight_decay=self.cc.weight_decay)
        k = self.al.kl_ctrl
        self.kl_ctrl = AdaptiveKL(k.kl_coef, k.target_kl, k.horizon) if k.type == "adaptive" else FixedKL(k.kl_coef)

    # ---- checkpoint state beyond the DCP'd critic (kept in the COMPLETE marker) -----------------
    def scalar_state(self) -> dict:
        return {"kl_coef": self.kl_ctrl.value}

    def load_scalar_state(self, state: dict) -> None:
        if "kl_coef" in state:
            self.kl_ctrl.value = float(state["kl_coef"])

    def _critic_budget(self) -> int:
        if not self.lc.use_dynamic_bsz:
            return 0
        return self.cc.max_tokens_per_micro_batch or CRITIC_TOKEN_FACTOR * self.lc.max_tokens_per_micro_batch

    def _values(self, b) -> torch.Tensor:
        return self.critic(**model_inputs(b)).logits[..., 0][:, :-1].float()

    def prepare(self, share, rows, policy_plan, *, pad_id: int, temperature: float) -> Prepared:
        """Step 1 of the module docstring. Collective: every rank calls it with its equal share."""
        prep, dev, reduce = Prepared(), self.device, _sum_over_ranks(self.group)
        with torch.no_grad():
            if self.ref is not None:
                for mb in policy_plan:
                    b = to_device(collate(mb, pad_id, **layout(self.lc)), dev)
                    lp = response_logprobs(self.ref, b, temperature, self.lc.logprob_chunk_tokens)
                    prep.put("ref_logprobs", mb, [t.cpu() for t in from_shifted(lp, mb)])
                prep.kl_loss = self.lc.use_kl_loss
            if self.critic is not None:
                self.critic.eval()
                self.critic_plan = plan_micro_batches(share, self.cc.micro_batch_size_per_gpu, self._critic_budget(),
                                                      self.group, packed=self.lc.pack_sequences)
                for mb in self.critic_plan:
                    b = to_device(collate(mb, pad_id, **layout(self.lc)), dev)
                    prep.put("old_values", mb, [t.cpu() for t in from_shifted(self._values(b), mb)])
        if self.al.adv_estimator == "grpo":
            return prep  # row advantages from groups_to_rows; the reference only feeds the KL loss
        lengths = [len(r.response_ids) for r in share]
        # the model's tokens: the reward lands on the last of them, and GAE and the returns pass over a multi-turn
        # row's environment tokens as over padding
        mask = response_grid([r.response_mask() for r in share], lengths)
        token_rewards = token_level_scores(torch.tensor([r.reward for r in share], dtype=torch.float64), mask)
        if self.al.use_kl_in_reward:
            behavior = response_grid([r.behavior_logprobs for r in share], lengths)
            ref = response_grid([prep.fields["ref_logprobs"][id(r)] for r in share], lengths)
            kl = kl_penalty(behavior, ref, self.al.kl_penalty) * mask
            beta = self.kl_ctrl.value
            token_rewards = token_rewards - beta * kl
            per_seq = kl.sum(-1) / mask.sum(-1).clamp(min=1)  # verl: mean over sequences of token means
            s = reduce(torch.stack([per_seq.sum(), torch.tensor(float(len(share)), dtype=torch.float64)]))
            current = float(s[0] / s[1])
            if math.isfinite(current):  # a step skipped for a non-finite value must not poison the controller
                self.kl_ctrl.update(current, n_steps=len(rows))
            prep.stats.update({M.KL_IN_REWARD: current, M.KL_COEF: beta})
        values = None
        if self.critic is not None:
            values = response_grid([prep.fields["old_values"][id(r)] for r in share], lengths)
        adv, ret = compute_advantages(self.al.adv_estimator, token_rewards, mask, values=values, gamma=self.al.gamma,
                                      lam=self.al.lam, reduce=reduce)
        prep.put("advantages", share, [adv[i, :n].float() for i, n in enumerate(lengths)])
        if ret is not None:
            prep.put("returns", share, [ret[i, :n].float() for i, n in enumerate(lengths)])
            tot = reduce(torch.stack([(ret * mask).sum(), (values * mask).sum(), mask.sum()]))
            prep.stats.update({M.RETURNS_MEAN: float(tot[0] / tot[2]), M.VALUES_MEAN: float(tot[1] / tot[2])})
        return prep

    def update_critic(self, share, rows, prep: Prepared, *, pad_id: int, world: int) -> dict:
        """Step 3: `critic.ppo_epochs` optimizer steps of the clipped value loss. Collective."""

        total_tokens = float(sum(r.loss_tokens for r in rows))
        acc = torch.zeros(3, dtype=torch.float64)  # loss (summed over epochs), clipped tokens, tokens
        norms = []
        self.critic.train()
        for _ in range(self.cc.ppo_epochs):
            for mb in self.critic_plan:
                b = to_device(collate(mb, pad_id, prep.token_fields(mb, ["old_values", "returns"]), **layout(self.lc)),
                              self.device)
                terms, clipped = value_loss_terms(self._values(b), b["old_values"], b["returns"], b["mask"],
                                                  cliprange=self.cc.cliprange_value)
                loss = normalize(terms, b["mask"], self.lc.loss_norm, total_tokens=total_tokens, total_seqs=len(rows),
                                 seq_weight=b["seq_weight"])
                (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already global
                acc += torch.stack([loss.detach(), clipped.sum(), b["mask"].sum()]).double().cpu()
            norms.append(clip_grad_norm(self.critic, self.cc.grad_clip, self.group))
            optimizer_step(self.critic_opt, self.critic, optimizer_offload=self.cc.optimizer_offload, device=self.device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(acc, group=self.group)
        e = self.cc.ppo_epochs
        return {M.VF_LOSS: float(acc[0]) / e, M.VF_CLIPFRAC: float(acc[1] / max(float(acc[2]), 1.0)),
                M.CRITIC_GRAD_NORM: norms[0]}
