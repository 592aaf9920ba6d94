"""learner.pack_sequences with attn_implementation=flex_attention (the attention packing is for: it
computes only each row's own blocks): packed rows give the padded sdpa logprobs. Forward only: CPU
flex_attention has no backward (training with it is for CUDA)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("pack_multiple", [0, 32])
def test_flex_attention_keeps_packed_rows_apart(pack_multiple):
    from test_fsdp import make_rows
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from data.tiny_model import ARCH
    from learner.batching import collate, from_shifted
    from learner.model import response_logprobs

    torch.manual_seed(0)
    sdpa = Qwen2ForCausalLM(Qwen2Config(**ARCH, attn_implementation="sdpa"))
    flex = Qwen2ForCausalLM(Qwen2Config(**ARCH, attn_implementation="flex_attention"))
    flex.load_state_dict(sdpa.state_dict())
    rows = make_rows(5, seed=4)
    with torch.no_grad():
        padded = from_shifted(response_logprobs(sdpa, collate(rows, 0), 1.0, 0), rows)
        packed = from_shifted(response_logprobs(flex, collate(rows, 0, packed=True, pack_multiple=pack_multiple), 1.0, 64), rows)
    for a, b in zip(padded, packed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_flex_attention_is_refused_for_a_cpu_learner():
    from learner.config import LearnerConfig
    from runbase.configload import ConfigError

    with pytest.raises(ConfigError, match="attn_implementation"):
        LearnerConfig(attn_implementation="flex_attention", device="cpu")
    for bad in (dict(pack_multiple=1024), dict(pack_sequences=True, pack_multiple=-1)):
        with pytest.raises(ConfigError, match="pack_multiple"):
            LearnerConfig(**bad)
