"""Reward functions: pure, total (any string in, a finite float in [0, 1] out)."""
from __future__ import annotations

from typing import Callable


def reverse_reward(completion: str, answer: str) -> float:
    """Fraction of positions right; extra or missing characters count as wrong.

    Partial credit gives GRPO a dense signal on a tiny model; an exact answer scores 1.
    """
    denom = max(len(answer), len(completion))
    if denom == 0:
        return 1.0
    return sum(a == b for a, b in zip(completion, answer)) / denom


REWARDS: dict[str, Callable[[str, str], float]] = {"reverse": reverse_reward}


def get_reward_fn(task: str) -> Callable[[str, str], float]:
    try:
        return REWARDS[task]
    except KeyError:
        raise KeyError(f"no reward function for task {task!r}; known: {sorted(REWARDS)}") from None
