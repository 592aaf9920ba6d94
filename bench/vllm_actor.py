"""Our vLLM actor vs raw vLLM vs our HF engine: generation tokens/s on the same prompts.

    python -m bench.vllm_actor --model DIR [--prompts 256] [--tokens 512] [--json OUT]

Rows (one engine instance, so the comparison is like for like):
- raw vLLM `LLM.generate`, no logprobs            (the limit)
- raw vLLM `LLM.generate`, logprobs=0             (what per-token logprob objects cost)
- our actor: the streaming VLLMEngine (submit every prompt, step until done; behavior logprobs from the
  worker's sampler hook, engines/vllm_sampled.py) + build + msgpack encode of every group (logprobs included)
- the same actor with vLLM's own `logprobs=0` (flat) instead of the hook
- our HF engine (transformers generate + one scoring prefill), when --hf
All runs generate exactly --tokens per sample (ignore_eos).
"""
from __future__ import annotations

import argparse
import json
import time

from actors.config import ActorConfig
from buffer.schema import Group, Sample, encode
from engines.core import SamplingParams


def timed(fn, reps: int = 2):
    fn()  # warm-up: first-call allocations, graph capture
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def parse_args(argv=None) -> argparse.Namespace:
    """The command line of `python -m bench.vllm_actor`."""
    p = argparse.ArgumentParser(prog="python -m bench.vllm_actor")
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    p.add_argument("--hf", action="store_true", help="also time the HF engine")
    p.add_argument("--gpu-mem", type=float, default=0.6)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json")
    return p.parse_args(argv)


def vllm_rows(engine, prompts: list, tokens: int) -> dict:
    """Seconds of raw vLLM (without and with logprobs) and of our streaming actor, on the same engine."""
    import numpy as np
    import vllm
    from vllm.inputs import TokensPrompt

    rows = {}

    def raw(logprobs):
        sp = vllm.SamplingParams(n=1, temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=logprobs,
                                 detokenize=False, seed=0)
        return lambda: engine.llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], sp, use_tqdm=False)

    rows["raw vLLM, no logprobs"] = timed(raw(None))
    rows["raw vLLM, logprobs=0"] = timed(raw(0))

    def ours():
        params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=tokens, seed=0, ignore_eos=True)
        outs = engine.generate(prompts, params)
        for i, (q, comps) in enumerate(zip(prompts, outs)):
            encode(Group(group_id=f"g{i}", prompt_id=str(i), actor_id="bench", created_at=0.0,
                         prompt_ids=np.asarray(q, dtype=np.int32),
                         samples=[Sample(response_ids=c.token_ids, behavior_logprobs=c.logprobs, reward=0.0,
                                         finish_reason=c.finish_reason, version_start=0, version_end=0)
                                  for c in comps]))

    rows["our streaming vLLM actor (submit/step, sampler-hook logprobs, encode)"] = timed(ours)
    hook, engine._sampled = engine._sampled, None   # the same actor on vLLM's logprobs=0 (flat)
    try:
        rows["our streaming vLLM actor, vLLM's logprobs=0 (flat)"] = timed(ours)
    finally:
        engine._sampled = hook
    return rows


def hf_seconds(args, prompts: list) -> float:
    """Seconds of our HF engine on the same prompts, loaded once the vLLM engine's memory is released."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    from engines.hf_engine import HFEngine  # lazy: imports torch

    hf = HFEngine(args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=args.tokens, seed=0, ignore_eos=True)
    return timed(lambda: hf.generate(prompts, params), reps=1)


def report(args, rows: dict, total: int, start_s: float) -> None:
    """Print the table of tokens/s against raw vLLM without logprobs, and write --json."""
    limit = total / rows["raw vLLM, no logprobs"]
    print(f"\n{args.prompts} prompts x {args.tokens} tokens, model {args.model}, engine start {start_s:.1f}s, "
          f"{'eager' if args.eager else 'CUDA graphs'}")
    print("| engine | tokens/s | vs raw vLLM without logprobs |\n|---|---|---|")
    result = {}
    for name, sec in rows.items():
        tps = total / sec
        result[name] = {"seconds": sec, "tokens_per_s": tps, "ratio": tps / limit}
        print(f"| {name} | {tps:,.0f} | {tps / limit:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "engine_start_s": start_s, "rows": result}, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np

    from engines.vllm_engine import VLLMEngine  # lazy: imports torch

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, args.prompt_len).tolist() for _ in range(args.prompts)]
    total = args.prompts * args.tokens
    cfg = ActorConfig(engine="vllm", device=args.device, dtype=args.dtype, enforce_eager=args.eager,
                      gpu_memory_utilization=args.gpu_mem, max_model_len=args.prompt_len + args.tokens + 8)
    t0 = time.perf_counter()
    engine = VLLMEngine(args.model, cfg)
    start_s = time.perf_counter() - t0
    rows = vllm_rows(engine, prompts, args.tokens)
    engine = None  # free the vLLM engine (and its GPU memory) before the HF one loads
    if args.hf:
        rows["our HF engine (generate + scoring prefill)"] = hf_seconds(args, prompts)
    report(args, rows, total, start_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
