"""Response lengths as the simulator draws them (log-normal, part of the spread a prompt's), fitted to what runs
measured: a sigma for a ratio of longest to mean response, a group share for the slots a run's engines used."""
from __future__ import annotations

import functools
import math

from experiments.simulator.runs import length_stats

LEN_DRAWS = 200   # simulated steps behind each estimate of a length statistic (its error ~1%)


@functools.lru_cache(maxsize=8)
def _normals(groups: int, n: int):
    """Fixed standard normals for LEN_DRAWS steps of `groups` groups of n: one per group, one per sample (every
    estimate draws the same ones, so bisections over sigma and share are smooth)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.standard_normal((LEN_DRAWS, groups, 1)), rng.standard_normal((LEN_DRAWS, groups, n))


def _step_lengths(groups: int, n: int, mean: float, sigma: float, cap: int, share: float):
    """LEN_DRAWS steps of lengths as response_lengths draws them (array: step, group, sample)."""
    import numpy as np

    zg, zi = _normals(groups, n)
    z = math.sqrt(share) * zg + math.sqrt(1 - share) * zi
    return np.clip(np.rint(np.exp(math.log(mean) - sigma * sigma / 2 + sigma * z)), 1, cap)


@functools.lru_cache(maxsize=4096)   # a validation solves every window of every run, for each share probed
def sigma_for_ratio(ratio: float, groups: int, n: int, mean: float, cap: int, share: float = 0.0) -> float:
    """The log-normal sigma whose steps of groups x n samples have, on average, `ratio` = longest / mean response
    (bisection: the ratio grows with sigma)."""
    def got(sigma: float) -> float:
        x = _step_lengths(groups, n, mean, sigma, cap, share).reshape(LEN_DRAWS, -1)
        return float((x.max(axis=1) / x.mean(axis=1)).mean())

    lo, hi = 0.0, 3.0
    for _ in range(25):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if got(mid) < ratio else (lo, mid)
    return (lo + hi) / 2


def slot_use(schedule, groups: int, n: int, cap: int, share: float) -> float:
    """Tokens generated per leased sequence-step for lengths that follow `schedule` ((mean, ratio) per window,
    equal samples in each): a group holds n slots until its longest sample ends, so this is the windows' mean
    length over their mean longest-of-a-group."""
    tokens = slots = 0.0
    for mean, ratio in schedule:
        x = _step_lengths(groups, n, round(mean, 1), sigma_for_ratio(round(ratio, 2), groups, n, round(mean, 1),
                                                                        cap, share), cap, share)
        tokens += float(x.mean())
        slots += float(x.max(axis=2).mean())
    return tokens / slots


MAX_GROUP_SHARE = 0.95   # a group's samples are never one draw: each is sampled on its own


def group_share(schedule, measured_use: float, groups: int, n: int, cap: int) -> float:
    """The len_group_share at which lengths following `schedule` use the leased slots as measured (slot_use;
    more share, less idle): 0 when even independent samples use them no worse, MAX_GROUP_SHARE at most."""
    if slot_use(schedule, groups, n, cap, 0.0) >= measured_use:
        return 0.0
    lo, hi = 0.0, MAX_GROUP_SHARE
    for _ in range(12):
        mid = round((lo + hi) / 2, 4)
        lo, hi = (mid, hi) if slot_use(schedule, groups, n, cap, mid) < measured_use else (lo, mid)
    return round((lo + hi) / 2, 4)


def response_workload(ms: list[dict], groups: int, n: int, cap: int, share: float = 0.0) -> dict:
    """len_mean and len_sigma of log-normal lengths with the steps' mean response and their mean ratio of
    longest to mean response over a step's groups x n samples: what the policy generated (the workload)."""
    mean, ratio = length_stats(ms)
    return {"len_mean": mean, "len_sigma": sigma_for_ratio(ratio, groups, n, mean, cap, share)}
