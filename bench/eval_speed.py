"""Held-out evaluation on one vLLM engine, alone: seconds per evaluation, engine steps and rows per step,
for the evaluator's variants (the goal: an evaluation within 1 s, off the learner's clock).

    python -m bench.eval_speed --config configs/gsm8k_smollm2.yaml [--repeats 2] [--json OUT] [overrides..]

An evaluation lasts as many engine steps as its longest answer, and each step costs what vLLM's host
does per step and per row. The variants change one thing each against the evaluator as it runs:
- `seeded`: today's evaluator (per-prompt seeds, behavior logprobs recorded by the sampler hook);
- `no_logprobs`: the sampler hook off (an evaluation scores text only);
- `unseeded`: no per-request seeds either (vLLM's GPU sampler draws a seeded row's noise one row at a time);
- `ngram_K`: no hook, seeded, vLLM's n-gram speculative decoding proposing K tokens a step (same
  distribution; fewer steps where answers repeat themselves, as a small model's long tails do).
Every variant evaluates the same prompts on the same weights (the model folder: version 0).
"""
from __future__ import annotations

import argparse
import json
import logging
import time

from cluster.config import load_config
from data.dataset import prompt_sources
from data.tiny_model import resolve_model_path
from engines.evaluate import evaluate_prompts
from rewards.scorers import record_scorer


class _Counted:
    """The engine with its steps and the rows each step ran counted (what an evaluation's time is made of)."""

    def __init__(self, engine):
        self.engine, self.steps, self.rows = engine, 0, 0
        inner = engine.step

        def step():
            occ = engine.occupancy()
            self.steps += 1
            self.rows += occ[0] if occ else 0
            return inner()

        engine.step = step


PLAIN = {"seeded": {"seeded": True, "behavior_logprobs": True},
         "no_logprobs": {"seeded": True, "behavior_logprobs": False},
         "unseeded": {"seeded": False, "behavior_logprobs": False}}


def variant(name: str) -> dict:
    """A variant's engine and sampling settings; argparse's type check (an unknown name is a usage error)."""
    if name in PLAIN:
        return PLAIN[name]
    head, _, k = name.partition("_")
    if head != "ngram" or not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"{name!r}: one of {', '.join(PLAIN)} or ngram_K (K >= 1 proposed tokens)")
    spec = {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return {"behavior_logprobs": False, "seeded": True, "vllm_kwargs": {"speculative_config": spec}}


def variant_name(name: str) -> str:
    variant(name)
    return name


def run_variant(cfg, name: str, repeats: int) -> dict:
    from engines.vllm_engine import VLLMEngine  # lazy: imports torch and vLLM

    v = variant(name)
    t0 = time.perf_counter()
    engine = VLLMEngine(resolve_model_path(cfg.model.path, cfg.task), cfg.actors, seed=cfg.trainer.val_seed,
                        behavior_logprobs=v["behavior_logprobs"], vllm_kwargs=v.get("vllm_kwargs"))
    start_s = time.perf_counter() - t0
    _train, val = prompt_sources(cfg, engine.tokenizer)
    score = record_scorer(cfg.data.reward_options())
    counted = _Counted(engine)
    rows = []
    for r in range(repeats + 1):   # the first warms up (CUDA graphs of the batch sizes met)
        counted.steps = counted.rows = 0
        t1 = time.perf_counter()
        res = evaluate_prompts(engine, val, score, samples=cfg.trainer.val_samples,
                               temperature=cfg.actors.temperature, max_tokens=cfg.actors.max_tokens,
                               seed=cfg.trainer.val_seed if v["seeded"] else None)
        wall = time.perf_counter() - t1
        if r:
            rows.append({"eval_s": wall, "steps": counted.steps, "ms_per_step": 1e3 * wall / counted.steps,
                         "rows_per_step": counted.rows / counted.steps, **res})
    del engine
    out = {"variant": name, "start_s": start_s, "eval_s": min(x["eval_s"] for x in rows), "runs": rows}
    print(json.dumps({k: (round(x, 3) if isinstance(x, float) else x) for k, x in out.items() if k != "runs"}),
          json.dumps([{k: round(x, 3) if isinstance(x, float) else x for k, x in r.items()} for r in rows]), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.eval_speed")
    p.add_argument("--config", required=True)
    p.add_argument("--variants", nargs="+", type=variant_name,
                   default=["seeded", "no_logprobs", "unseeded", "ngram_4", "ngram_8"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)
    results = []
    for name in args.variants:
        try:
            results.append(run_variant(cfg, name, args.repeats))
        except Exception as e:   # a variant this vLLM build cannot run is a row, not the end of the benchmark
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
            results.append({"variant": name, "error": f"{type(e).__name__}: {e}"})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
