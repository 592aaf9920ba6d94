"""Held-out evaluation: the same prompts, sampling settings and seed every time."""
from __future__ import annotations

import torch

from actors.core import SamplingParams


def held_out_reward(engine, prompts, reward_fn, *, samples: int, temperature: float, max_tokens: int,
                    seed: int) -> float:
    """Mean reward of `samples` completions per held-out prompt (0..1)."""
    state = torch.get_rng_state()
    try:
        ids = [engine.tokenizer(p.text)["input_ids"] for p in prompts]
        outs = engine.generate(ids, SamplingParams(n=samples, temperature=temperature, top_p=1.0,
                                                   max_tokens=max_tokens, seed=seed))
        tok = engine.tokenizer
        scores = [reward_fn(tok.decode(c.token_ids, skip_special_tokens=True), p.answer)
                  for p, comps in zip(prompts, outs) for c in comps]
    finally:
        torch.set_rng_state(state)
    return sum(scores) / len(scores)
