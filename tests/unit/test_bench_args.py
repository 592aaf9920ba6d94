"""Benchmarks' arguments: a name or value they cannot run is a usage error naming it, not a traceback."""
from __future__ import annotations

import argparse

import pytest


def test_eval_speed_variants_are_checked():
    from bench.eval_speed import variant

    assert variant("no_logprobs") == {"seeded": True, "behavior_logprobs": False}
    assert variant("ngram_3")["vllm_kwargs"]["speculative_config"]["num_speculative_tokens"] == 3
    for bad in ("bogus", "ngram_0", "ngram_x", "ngram"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            variant(bad)


def test_actor_stream_vllm_kwargs_must_be_a_json_object():
    from bench.actor_stream import json_object

    assert json_object('{"async_scheduling": true}') == {"async_scheduling": True}
    with pytest.raises(argparse.ArgumentTypeError, match="got list"):
        json_object("[1]")
    with pytest.raises(argparse.ArgumentTypeError, match="not JSON"):
        json_object("{a")
