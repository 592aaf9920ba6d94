"""bench.scale's summary of a run of few steps: the real-size rows' long steps leave 3-5 in a window."""
import pytest

from bench.scale import SKIP_STEPS, steps_to_skip


def test_a_short_run_is_summarised_over_its_last_two_steps_at_least():
    assert [steps_to_skip(n) for n in (2, 3, 4, 10)] == [0, 1, 2, SKIP_STEPS]
    with pytest.raises(ValueError, match="1 step"):
        steps_to_skip(1)


def test_each_members_receipt_is_its_mean_over_the_versions_it_received():
    from bench.scale import member_receive_s

    status = {"members": {"actor-0": {"weights_received": 4, "weights_receive_s": 0.2},
                          "actor-1": {"weights_received": 0, "weights_receive_s": 0.0},
                          "evaluator": {"groups": 0}}}
    assert member_receive_s(status) == {"actor-0": pytest.approx(0.05)}
    assert member_receive_s({}) == {}


def test_each_members_receipt_by_phase_is_its_mean_per_version():
    from bench.scale import member_phases_s

    status = {"members": {"actor-0": {"weights_received": 2, "weights_phase_s": {"open": 0.01, "copy": 0.03}},
                          "actor-1": {"weights_received": 1},
                          "actor-2": {"weights_received": 0, "weights_phase_s": {"open": 0.5}}}}
    got = member_phases_s(status)
    assert got == {"actor-0": {"open": pytest.approx(0.005), "copy": pytest.approx(0.015)}, "actor-1": {}}
