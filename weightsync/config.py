"""Weight publication configuration."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cluster.configload import ConfigError


@dataclass(kw_only=True)
class WeightSyncConfig:
    backend: Literal["auto", "gloo"] = "auto"
    """Transport for weights: `gloo` (CPU). `auto` picks from where processes sit."""
    sync_every: int = 1
    """Publish a new version every this many optimizer steps."""
    timeout_s: float = 300.0
    """How long a publication may wait for a member before the learner fails with a message."""

    def __post_init__(self):
        if self.sync_every < 1:
            raise ConfigError("sync_every", "must be >= 1")
        if self.timeout_s <= 0:
            raise ConfigError("timeout_s", "must be > 0")
