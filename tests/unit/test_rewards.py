"""rewards/scorers.py: reverse_reward is total, in [0, 1], exact = 1."""
from __future__ import annotations

import random

import pytest

from rewards.scorers import get_reward_fn, reverse_reward

pytestmark = pytest.mark.unit


def ref(c, a):
    n = max(len(c), len(a))
    return 1.0 if n == 0 else sum(1 for i in range(min(len(c), len(a))) if c[i] == a[i]) / n


def test_exact_and_empty():
    assert reverse_reward("dcba", "dcba") == 1.0
    assert reverse_reward("", "dcba") == 0.0


def test_extra_and_partial():
    assert reverse_reward("dcbaX", "dcba") < 1.0
    assert reverse_reward("dcbaXY", "dcba") < reverse_reward("dcbaX", "dcba")
    assert reverse_reward("dcbx", "dcba") == pytest.approx(3 / 4)
    assert reverse_reward("dc", "dcba") == pytest.approx(2 / 4)
    assert 0.0 < reverse_reward("xcxa", "dcba") < 1.0


def test_total_on_unicode_and_bounded():
    rng = random.Random(0)
    alphabet = "ab\u00e9\u0301\U0001F600\x00\ud800 \n" + "".join(chr(rng.randrange(0x110000)) for _ in range(50))
    for _ in range(2000):
        c = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 10)))
        a = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 10)))
        r = reverse_reward(c, a)
        assert isinstance(r, float) and 0.0 <= r <= 1.0
        assert r == pytest.approx(ref(c, a))


def test_get_reward_fn():
    assert get_reward_fn("reverse") is reverse_reward
    with pytest.raises(KeyError, match="no_such_task"):
        get_reward_fn("no_such_task")
