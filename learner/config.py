"""Learner and model configuration."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cluster.configload import ConfigError


@dataclass(kw_only=True)
class ModelConfig:
    path: str = "builtin:tiny-reverse"
    """A local Hugging Face model folder, or `builtin:tiny-reverse` (built and cached offline)."""


@dataclass(kw_only=True)
class LearnerConfig:
    lr: float = 1e-3
    """AdamW learning rate (0 freezes the policy: the control run)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    grad_clip: float = 1.0
    """Max global grad norm (0 = no clipping)."""
    groups_per_step: int = 8
    """Prompt groups per optimizer step (verl: data.train_batch_size)."""
    micro_batch_size_per_gpu: int = 32
    """Rows per forward/backward on one rank; gradients accumulate over micro-batches."""
    clip_low: float = 0.2
    """PPO clip: ratio lower bound is 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip: ratio upper bound is 1 + clip_high."""
    correction: Literal["ppo_clip", "decoupled", "tis", "none"] = "ppo_clip"
    """Off-policy correction (learner/losses.py): `ppo_clip` on the ratio to the behavior policy;
    `decoupled` PPO (clip to the learner's pre-update policy, behavior->proximal weight capped at
    `decoupled_cap`); `tis` truncated importance sampling (weight capped at `tis_cap`); `none`
    plain policy gradient (assumes on-policy samples)."""
    decoupled_cap: float = 5.0
    """Decoupled PPO: truncation of the behavior->proximal importance weight (AReaL's default)."""
    tis_cap: float = 2.0
    """Truncated IS: cap of the importance weight pi/pi_behavior (verl's TIS default)."""
    loss_norm: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    """How the summed loss is normalised; always by counts over the whole step batch."""
    scale_adv_by_std: bool = True
    """GRPO: divide group-centred rewards by the group std."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of forward/backward compute (FSDP2 mixed precision); master weights, optimizer state
    and gradient reduction stay float32. `bfloat16` is what GPUs run fast."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: cuda when available, else cpu (the process-group backend follows: nccl/gloo)."""
    torch_threads: int = 1
    """Intra-op threads per learner process on CPU."""
    seed: int = 0
    """Seed of the learner's RNG."""

    def __post_init__(self):
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("betas", "two numbers in [0, 1)")
        if self.lr < 0:
            raise ConfigError("lr", "must be >= 0")
        if self.groups_per_step < 1:
            raise ConfigError("groups_per_step", "must be >= 1")
        if self.micro_batch_size_per_gpu < 1:
            raise ConfigError("micro_batch_size_per_gpu", "must be >= 1")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ConfigError("clip_low", "need 0 <= clip_low < 1 and clip_high >= 0")
        # a cap below 1 would down-weight even exactly on-policy tokens (weight 1)
        if self.decoupled_cap < 1:
            raise ConfigError("decoupled_cap", "must be >= 1")
        if self.tis_cap < 1:
            raise ConfigError("tis_cap", "must be >= 1")
