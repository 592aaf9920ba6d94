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


def lease_version(learner_version: int, actor_version: int, by: str) -> int:
    """The version the admission cap is counted from (`buffer.admission`): the learner's (`learner`, AReaL's
    rule), or the older of the learner's and the leasing actor's (`actor`). Groups are trained roughly in the
    order they were started, so the ((a + s + 1) * G + 1)-th group started can be trained no earlier than
    step a + s + 1: leased under weights a it would be too stale on arrival. With publication overlapped,
    the learner's version moves before its weights reach the actors, and counting from it let actors still
    holding the previous weights lease one step's worth of groups doomed at s = 1 (45% of all groups on the
    H200, 2026-12-03)."""
    if by not in ("actor", "learner"):
        raise ValueError(f"admission counts from 'actor' or 'learner', not {by!r}")
    return min(learner_version, actor_version) if by == "actor" else learner_version


def histogram(values, max_value: int) -> list[int]:
    """Counts of 0..max_value (anything larger lands in the last bin)."""
    out = [0] * (max_value + 1)
    for v in values:
        out[min(max(v, 0), max_value)] += 1
    return out
