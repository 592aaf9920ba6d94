"""bench.scale's summary of a run of few steps: the real-size rows' long steps leave 3-5 in a window."""
import pytest

from bench.scale import SKIP_STEPS, steps_to_skip


def test_a_short_run_is_summarised_over_its_last_two_steps_at_least():
    assert [steps_to_skip(n) for n in (2, 3, 4, 10)] == [0, 1, 2, SKIP_STEPS]
    with pytest.raises(ValueError, match="1 step"):
        steps_to_skip(1)
