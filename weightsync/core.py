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
    """One publication attempt = begin(), send() per bucket in plan order, finish().

    Bucket i is handed over while the caller gathers bucket i+1; finish() returns the version's
    checksum once every member holds it, or None if the attempt failed (retry: members that
    went silent are left out of the next one)."""

    @abc.abstractmethod
    def begin(self, version: int, lay: list[list], buckets: list[dict]) -> None: ...

    @abc.abstractmethod
    def send(self, bucket: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> None: ...

    @abc.abstractmethod
    def finish(self) -> str | None: ...

    def publish(self, version: int, state_dict: dict[str, torch.Tensor], bucket_bytes: int = 2**30) -> str | None:
        """A whole, already gathered state dict in one attempt (tests, benchmarks)."""
        from weightsync.flat import layout, plan_buckets

        lay = layout(state_dict)
        buckets = plan_buckets(lay, bucket_bytes)
        self.begin(version, lay, buckets)
        for b in buckets:
            named = [(n, state_dict[n]) for n in b["names"]]
            self.send(torch.cat([t.detach().reshape(-1) for _, t in named]), named)
        return self.finish()

    def close(self) -> None:
        pass


class WeightSubscriber(abc.ABC):
    @abc.abstractmethod
    def take(self) -> WeightVersion | None:
        """The newest fully received version not yet taken, or None. Never a partial one."""

    def close(self) -> None:
        pass
