"""buffer/ingest_proc.py: the ingest is configured from its own section, never the root config."""
from __future__ import annotations

import pytest

from buffer.config import BufferConfig
from buffer.ingest_proc import buffer_config, job_limits
from runbase.configload import ConfigError

pytestmark = pytest.mark.unit


def test_buffer_overrides_build_the_ingests_config_and_other_keys_are_refused():
    b = buffer_config(["buffer.max_message_bytes=4096", "buffer.max_reward=2.5"])
    assert (b.max_message_bytes, b.max_reward) == (4096, 2.5)
    assert buffer_config([]) == BufferConfig()
    with pytest.raises(ConfigError, match="learner.lr"):
        buffer_config(["learner.lr=1e-5"])
    with pytest.raises(ConfigError, match="buffer.no_such_key"):
        buffer_config(["buffer.no_such_key=1"])


def test_job_limits_narrow_the_buffers_own_bounds():
    b = BufferConfig(max_response_tokens=100, max_message_bytes=4096)
    lim = job_limits(b, vocab_size=50, max_prompt_tokens=7, max_response_tokens=500, max_positions=300)
    assert (lim.vocab_size, lim.max_prompt_tokens, lim.max_response_tokens, lim.max_positions) == (50, 7, 100, 300)
    assert lim.max_message_bytes == 4096
    assert lim.group_size is None and job_limits(b, group_size=8).group_size == 8


def test_reward_bounds_that_cut_into_the_scorers_range_are_warned_about():
    assert BufferConfig().narrow_reward_bounds() == ""
    assert BufferConfig(min_reward=0.0, max_reward=1.0).narrow_reward_bounds() == ""
    assert "buffer.max_reward=0.9" in BufferConfig(max_reward=0.9).narrow_reward_bounds()
    assert "rejected" in BufferConfig(min_reward=0.1).narrow_reward_bounds()
