"""Weight publication configuration."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runbase.configload import ConfigError

MIN_TIMEOUT_S = 0.1   # torch.distributed stores count whole milliseconds: a shorter timeout is 0 ms, at once


@dataclass(kw_only=True)
class WeightSyncConfig:
    backend: Literal["auto", "gloo", "cuda_ipc", "nccl"] = "auto"
    """Transport for weights: `gloo` (through host memory, works everywhere), `cuda_ipc` (actors on
    learner rank 0's GPU: device-to-device, no host copy), `nccl` (actors on other GPUs). `auto`:
    from where processes sit (cluster/placement.py): CPU anywhere -> gloo; actors on GPUs the
    learners leave free -> nccl; no GPU left for actors -> they share GPU 0 with cuda_ipc."""
    sync_every: int = 1
    """Publish a new version every this many optimizer steps."""
    timeout_s: float = 30.0
    """Broadcast timeout: a member silent this long in a publication is dropped and the
    publication retried without it (also the time a new epoch's group may take to form)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype the floating-point weights travel and are held in by every subscriber: `auto` is the
    engines' own (actors.dtype), so a bf16 engine's buffers are half an fp32 copy's size (a 1.5B model:
    3.3 instead of 6.6 GiB per member) and the checksum covers the bits the engine serves."""
    bucket_mb: float = 1024.0
    """Weights are gathered and sent in buckets of about this size (a larger tensor gets its own)."""
    overlap: bool = False
    """With one learner rank: the learner sends a version's buckets, then takes its next step while a
    thread waits for the actors' acks and the checksum round (the next publication, and the last one,
    wait for it). A version that reaches nobody is then not retried: the next one is. False: every
    publication completes, with retries, before the next step."""

    def __post_init__(self):
        if self.sync_every < 1:
            raise ConfigError("sync_every", "must be >= 1")
        if self.timeout_s < MIN_TIMEOUT_S:
            raise ConfigError("timeout_s", f"must be >= {MIN_TIMEOUT_S} s, got {self.timeout_s}")
        if self.bucket_mb <= 0:
            raise ConfigError("bucket_mb", "must be > 0")
