"""Abstract bases at the buffer's process boundaries."""
from __future__ import annotations

import abc
from typing import Sequence

from buffer.schema import Group


class TrajectorySink(abc.ABC):
    """Where actors put finished groups. `send` returns once each group is acknowledged
    (stored) or rejected; it raises when the buffer cannot be reached."""

    @abc.abstractmethod
    def send(self, groups: Sequence[Group]) -> list[str | None]:
        """Send groups; returns per group None if stored, else the rejection reason."""

    def close(self) -> None:
        pass


class TrajectorySource(abc.ABC):
    """Where the learner takes batches from. Entries handed out stay pending until `ack`."""

    @abc.abstractmethod
    def next_batch(self, learner_version: int) -> "Batch":
        """Block until a full step batch of fresh-enough groups is available."""

    @abc.abstractmethod
    def ack(self, batch: "Batch") -> None:
        """Mark a batch as trained (call after the optimizer step)."""

    @abc.abstractmethod
    def ack_ids(self, entry_ids) -> None:
        """Mark the entries of batches already handed out as trained, by their buffer entry ids (a learner
        that defers its acks to the checkpoint covering their step keeps only the ids)."""

    def skip(self, batch: "Batch", reason: str, step: int) -> int:
        """A batch the learner did not apply (`reason`): never handed out again. Returns how many of its
        groups were dead-lettered (none here: a recorded batch is only read)."""
        self.ack(batch)
        return 0


class Batch:
    """Groups for one step, their raw payloads and buffer entry ids, and what was dropped."""

    def __init__(self, groups, payloads, entry_ids, dropped_stale: int, wait_s: float):
        self.groups = groups
        self.payloads = payloads
        self.entry_ids = entry_ids
        self.dropped_stale = dropped_stale
        self.wait_s = wait_s
