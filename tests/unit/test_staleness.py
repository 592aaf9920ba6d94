"""buffer/staleness.py: the staleness rule."""
from __future__ import annotations

import pytest

from buffer.staleness import admissible, admission_cap, histogram, staleness

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("s", [0, 1, 3])
def test_admissible_boundary(s):
    v = 10
    assert staleness(v, v - s) == s
    assert admissible(v, v - s, s)          # exactly s versions old: allowed
    assert not admissible(v, v - s - 1, s)  # one more: rejected
    assert admissible(v, v, s)


@pytest.mark.parametrize("v,s,g,d", [(0, 0, 1, 0), (0, 2, 8, 0), (5, 1, 4, 3), (7, 3, 16, 11)])
def test_admission_cap(v, s, g, d):
    expected = sum(g for _ in range(v + s + 1)) + d  # g groups for each of versions 0..v+s
    assert admission_cap(v, s, g, dropped=d) == expected
    assert admission_cap(v, s, g) == expected - d
    assert admission_cap(v + 1, s, g) - admission_cap(v, s, g) == g


def test_histogram_clipping():
    vals = [0, 1, 1, 2, 5, 100, -3, -1]
    h = histogram(vals, 2)
    ref = [0, 0, 0]
    for x in vals:
        ref[0 if x < 0 else min(x, 2)] += 1
    assert h == ref == [3, 2, 3]
    assert sum(h) == len(vals)
    assert histogram([], 3) == [0, 0, 0, 0]
    assert histogram([4], 0) == [1]


def test_lease_version_counts_from_the_older_weights_under_actor_admission():
    from buffer.staleness import lease_version

    assert lease_version(5, 4, "actor") == 4 and lease_version(5, 5, "actor") == 5
    assert lease_version(5, 4, "learner") == 5
    # an actor never holds weights newer than the learner's published version; if a clock race says so, the
    # learner's version bounds the cap
    assert lease_version(5, 6, "actor") == 5
    with pytest.raises(ValueError, match="admission"):
        lease_version(5, 4, "both")
