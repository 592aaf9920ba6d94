"""Replay buffer configuration: ingest limits and the staleness rule."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from runbase.configload import ConfigError, local_path


@dataclass(kw_only=True)
class BufferConfig:
    max_staleness: int = 2
    """s: a sample may be trained at learner version k only if k - version_start <= s (0 = on-policy)."""
    admission: Literal["actor", "learner"] = "actor"
    """What the admission cap counts from: `actor` (default) the older of the learner's version and the leasing
    actor's weights, so an actor whose weights lag a publication leases only groups it can deliver in time;
    `learner`: the learner's version alone (AReaL's rule, (k + s + 1) * groups_per_step started in total). See
    buffer/staleness.py `lease_version`. At s = 0 both are the same rule."""
    max_message_bytes: int = 64 * 2**20
    """Largest trajectory message the ingest accepts. The ingest's socket drops a larger frame as it
    arrives (ZeroMQ's MAXMSGSIZE: it is never read into memory, and its sender gets no reply);
    such drops are counted as `peers_dropped` in the status."""
    max_response_tokens: int = 32768
    """Longest response the ingest accepts (it also holds responses to the job's actors.max_tokens)."""
    min_reward: float = -10.0
    """Lowest reward the ingest accepts; a group with a sample below it is rejected (`reward_range`).
    Every reward the actors compute is clamped to [0, 1] (rewards/scorers.py compute_score)."""
    max_reward: float = 10.0
    """Highest reward the ingest accepts (one 1e308 reward would swamp every advantage of its step)."""
    ingest_port: int = 0
    """TCP port the ingest binds (0 = any free port, announced through Redis); shard i binds port + i."""
    ingest_shards: int = 1
    """Ingest servers (processes `ingest-0..k-1`; one is `ingest`): actor i sends to shard i % k. All
    shards store into the one trajectory stream with the same idempotent script, so the sampler,
    its consumer group and acks are unchanged. More shards when validation, not Redis, is the limit."""
    deadletter_maxlen: int = 10000
    """Approximate cap of the dead-letter stream (rejected messages kept for inspection)."""

    replay_dir: str = ""
    """Train on the batches an earlier run recorded (`trainer.record_batches`, its <run_dir>/batches)
    instead of live actors: step k trains on recorded batch k. Use with `cluster.actors=0`. `~` expanded, relative
    to the launcher's directory."""

    def narrow_reward_bounds(self) -> str:
        """A warning when the reward bounds cut into [0, 1], where the scorers clamp every reward: the
        ingest then rejects each group with a reward outside them and the learner trains on the rest."""
        if self.min_reward <= 0 and self.max_reward >= 1:
            return ""
        return (f"buffer.min_reward={self.min_reward}, buffer.max_reward={self.max_reward} cut into [0, 1] (the "
                "scorers' range): groups with a reward outside are rejected (reward_range) and training sees "
                "only the rest")

    def __post_init__(self):
        self.replay_dir = local_path(self.replay_dir)   # read by the learner, in its own cwd
        if self.max_staleness < 0:
            raise ConfigError("max_staleness", "must be >= 0")
        if self.admission not in ("actor", "learner"):
            raise ConfigError("admission", f"must be actor or learner, not {self.admission!r}")
        if self.max_message_bytes < 1024:
            raise ConfigError("max_message_bytes", "must be >= 1024")
        for key in ("min_reward", "max_reward"):
            if not math.isfinite(getattr(self, key)):
                raise ConfigError(key, "must be finite")
        if not self.min_reward < self.max_reward:
            raise ConfigError("min_reward", f"must be < buffer.max_reward ({self.max_reward})")
        if self.max_response_tokens < 1:
            raise ConfigError("max_response_tokens", "must be >= 1")
        if self.deadletter_maxlen < 0:
            raise ConfigError("deadletter_maxlen", "must be >= 0 (Redis refuses a negative MAXLEN)")
        if self.ingest_shards < 1:
            raise ConfigError("ingest_shards", "must be >= 1")
        if not 0 <= self.ingest_port < 65536 - self.ingest_shards:
            raise ConfigError("ingest_port", "must be a TCP port or 0")
