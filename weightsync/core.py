"""Abstract bases of the weight plane: learner rank 0 publishes, every actor subscribes."""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class WeightVersion:
    """A complete set of weights received by an actor, ready to swap in."""
    version: int
    checksum: str
    state_dict: dict[str, torch.Tensor]


class WeightPublisher(abc.ABC):
    @abc.abstractmethod
    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> str:
        """Send a full state dict to every member; returns its checksum once all have it."""

    def close(self) -> None:
        pass


class WeightSubscriber(abc.ABC):
    @abc.abstractmethod
    def take(self) -> WeightVersion | None:
        """The newest fully received version not yet taken, or None. Never a partial one."""

    def close(self) -> None:
        pass
