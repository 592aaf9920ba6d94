"""Pure logic of the sampler-hook logprobs (engines/vllm_sampled.py): matching the rows filed for a sample to
the tokens vLLM returned, and draining the per-step records in order."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from engines.vllm_sampled import align, ready_steps

pytestmark = pytest.mark.unit


def test_rows_that_start_with_the_tokens_give_their_logprobs_and_extra_rows_are_dropped():
    assert align([5, 6, 7], [-0.1, -0.2, -0.3], [5, 6, 7]) == [-0.1, -0.2, -0.3]
    # async scheduling samples one step past a stop: the row after the last token is not the sample's
    assert align([5, 6, 7, 9], [-0.1, -0.2, -0.3, -0.4], [5, 6, 7]) == [-0.1, -0.2, -0.3]
    assert align([], [], []) == []


def test_a_thrown_away_row_inside_the_sample_is_skipped():
    # the scheduler dropped the row of token 8 (a preempted request's step in flight), then 7 was resampled
    assert align([5, 8, 7, 4], [-0.1, -2.0, -0.3, -0.4], [5, 7, 4]) == [-0.1, -0.3, -0.4]


def test_rows_that_lack_a_token_are_refused_not_guessed():
    assert align([5, 6], [-0.1, -0.2], [5, 6, 7]) is None          # a token without its row
    assert align([5, 7, 6], [-0.1, -0.2, -0.3], [5, 6, 7]) is None   # out of order
    assert align([], [], [1]) is None


def test_records_drain_oldest_first_and_stop_at_one_not_landed():
    class Pending:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    steps = collections.deque([
        (["a", "b"], np.array([True, False]), torch.tensor([3, 4]), torch.tensor([-0.5, -0.25]), None),
        (["a"], torch.tensor([True]), torch.tensor([5]), torch.tensor([-1.0]), Pending(True)),
        (["b"], np.array([True]), torch.tensor([6]), torch.tensor([-2.0]), Pending(False)),
        (["a"], np.array([True]), torch.tensor([7]), torch.tensor([-3.0]), None),
    ])
    got = list(ready_steps(steps))
    assert [(r, v.tolist(), t, lp) for r, v, t, lp in got] == [
        (["a", "b"], [True, False], [3, 4], [-0.5, -0.25]), (["a"], [True], [5], [-1.0])]
    assert len(steps) == 2   # the record whose copy has not landed, and everything after it, wait


def test_records_still_in_flight_are_waited_for_when_asked():
    class Pending:
        waited = False

        def query(self):
            return self.waited

        def synchronize(self):
            self.waited = True

    ev = Pending()
    steps = collections.deque([(["a"], np.array([True]), torch.tensor([5]), torch.tensor([-1.0]), ev)])
    assert list(ready_steps(steps)) == [] and len(steps) == 1
    assert [r for r, *_ in ready_steps(steps, wait=True)] == [["a"]] and ev.waited and not steps


def test_waiting_takes_only_the_oldest_record_in_flight():
    """With async scheduling the newest record is the step the GPU runs now: waiting for it would
    serialise the engine, so one wait lands one record."""
    class Pending:
        def __init__(self):
            self.waited = False

        def query(self):
            return self.waited

        def synchronize(self):
            self.waited = True

    first, second = Pending(), Pending()
    steps = collections.deque([(["a"], np.array([True]), torch.tensor([5]), torch.tensor([-1.0]), first),
                               (["a"], np.array([True]), torch.tensor([6]), torch.tensor([-2.0]), second)])
    assert [t for _r, _v, t, _lp in ready_steps(steps, wait=True)] == [[5]]
    assert first.waited and not second.waited and len(steps) == 1
