"""Held-out evaluation: the same prompts, sampling settings and seed every time."""
from __future__ import annotations

import torch

from data.tasks import token_ids
from engines.core import SamplingParams
from rewards.scorers import FULL_SCORE

# Rows (prompts x samples) per generate call: bounds the KV cache, while a GPU still gets a full batch.
EVAL_CHUNK_ROWS = 256


def cut_at_stop(text: str, stop) -> str:
    """`text` up to and including its first stop string, as vLLM ends a sample (include_stop_str_in_output)."""
    ends = [i + len(s) for s in stop if (i := text.find(s)) >= 0]
    return text[:min(ends)] if ends else text


def evaluate_prompts(engine, prompts, score, *, samples: int, temperature: float, max_tokens: int,
                     seed: int | None, stop=(), eos_logit_bias: float = 0.0, episodes=None) -> dict:
    """Mean reward and accuracy (share of samples scoring FULL_SCORE) of `samples` completions per
    prompt, and their mean and longest length in tokens (an evaluation lasts as long as its longest).
    `score(record, completion) -> float`; prompts carry their token ids when the data source tokenized
    them (datasets), else their text is tokenized here. Deterministic for given weights (seed None: not).
    `stop`: actors.stop, applied to the text scored by an engine that does not apply them (the HF engine; vLLM
    ended its samples there already), so held-out answers end where the actors' do. `eos_logit_bias`:
    actors.eos_logit_bias, so the held-out answers come from the policy the actors sample. `episodes`: a player
    of multi-turn episodes (envs/episode.py EpisodePlayer): each sample is an episode, its reward the
    environment's return and its length its response tokens (the environment's included)."""

    state = torch.get_rng_state()
    tok = engine.tokenizer
    scores, lengths = [], []
    try:
        per_call = max(1, EVAL_CHUNK_ROWS // samples)
        for c0 in range(0, len(prompts), per_call):
            chunk = prompts[c0:c0 + per_call]
            recs = [p.record() for p in chunk]
            params = SamplingParams(n=samples, temperature=temperature, top_p=1.0, max_tokens=max_tokens,
                                    seed=None if seed is None else seed + c0, eos_logit_bias=eos_logit_bias)
            if episodes is not None:
                for eps in episodes.play(engine, recs, params):
                    scores += [e.total_reward for e in eps]
                    lengths += [len(e.response_ids) for e in eps]
                continue
            outs = engine.generate([token_ids(rec, tok) for rec in recs], params)
            for rec, comps in zip(recs, outs):
                scores += [score(rec, cut_at_stop(tok.decode(c.token_ids, skip_special_tokens=True), stop))
                           for c in comps]
                lengths += [len(c.token_ids) for c in comps]
    finally:
        torch.set_rng_state(state)
    return {"reward": sum(scores) / len(scores), "accuracy": sum(s >= FULL_SCORE for s in scores) / len(scores),
            "samples": len(scores), "len_mean": sum(lengths) / len(lengths), "len_max": max(lengths)}
