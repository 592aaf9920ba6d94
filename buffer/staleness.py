"""The staleness rule of docs/design.md as pure functions."""
from __future__ import annotations


def staleness(learner_version: int, version_start: int) -> int:
    """Versions between the weights that started a sample and the learner's current ones."""
    return learner_version - version_start


def admissible(learner_version: int, version_start: int, max_staleness: int) -> bool:
    """Hard filter: may a sample started at `version_start` be trained at `learner_version`?"""
    return staleness(learner_version, version_start) <= max_staleness


def admission_cap(learner_version: int, max_staleness: int, groups_per_step: int, dropped: int = 0) -> int:
    """Groups actors may have started in total (AReaL's rule, plus replacements for dropped ones)."""
    return (learner_version + max_staleness + 1) * groups_per_step + dropped


def histogram(values, max_value: int) -> list[int]:
    """Counts of 0..max_value (anything larger lands in the last bin)."""
    out = [0] * (max_value + 1)
    for v in values:
        out[min(max(v, 0), max_value)] += 1
    return out
