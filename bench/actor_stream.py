"""One streaming vLLM actor alone on real prompts: production (samples/s) as the rollout loop makes it.

    python -m bench.actor_stream --model DIR --data train.parquet [--inflight 256 512] [--seconds 20]
        [--no-compile] [--profile PREFIX] [--json OUT.json]

The actor's own work, without Redis or the learner: keep K sequences in flight (groups of n samples of
one prompt, leased whenever a group fits), step the engine, and for every finished group decode and
score each sample and encode the group for the wire, as `actors/rollout.py` does. Beside it, in the
same process and on the same engine, the synchronous peer's way: `LLM.generate` of one step's prompts
(`--groups` x n, logprobs=0, as TRL's GRPOTrainer asks vLLM in colocate mode), timed per call.
Prompts are the parquet's rows in order (chat template applied, as the learner queues them), sampled
at the config's temperature until EOS or --max-tokens, so response lengths are the task's own.
"""
from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import numpy as np

from actors.config import ActorConfig
from actors.groups import build_group
from buffer.schema import encode
from cluster.proc import profiled
from data.dataset import DataConfig, build_prompts
from engines.core import SamplingParams
from rewards.scorers import record_scorer



def stream(engine, prompts, params, *, inflight: int, seconds: float, score) -> dict:
    """Keep `inflight` sequences in flight for `seconds`; what finished in that window."""
    n, k, waits0 = params.n, 0, engine.row_waits
    t0 = time.perf_counter()
    samples = tokens = steps = seqs_stepped = groups = 0
    while time.perf_counter() - t0 < seconds:
        while engine.in_flight() + n <= inflight:
            p = prompts[k % len(prompts)]
            engine.submit((k, p), list(p.prompt_ids), params)
            k += 1
        seqs_stepped += engine.in_flight()
        steps += 1
        for (i, p), comps in engine.step():  # the rollout loop's work per finished group
            encode(build_group(f"g{i}", p.record(), p.prompt_ids, comps, score=score, tokenizer=engine.tokenizer,
                               actor_id="bench", created_at=0.0))
            samples += len(comps)
            tokens += sum(len(c.token_ids) for c in comps)
            groups += 1
    wall = time.perf_counter() - t0
    engine.abort()
    return {"inflight": inflight, "seconds": wall, "samples_per_s": samples / wall, "tokens_per_s": tokens / wall,
            "steps_per_s": steps / wall, "mean_seqs_per_step": seqs_stepped / max(steps, 1),
            "mean_response_tokens": tokens / max(samples, 1), "groups": groups,
            "row_waits": engine.row_waits - waits0}


def generate_calls(engine, prompts, *, groups: int, n: int, temperature: float, max_tokens: int, calls: int) -> dict:
    """The synchronous peer: one `LLM.generate` of `groups` prompts x n per step (logprobs=0)."""
    import vllm
    from vllm.inputs import TokensPrompt

    sp = vllm.SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0)
    times, samples, tokens = [], 0, 0
    for c in range(calls + 1):
        batch = [TokensPrompt(prompt_token_ids=list(prompts[(c * groups + i) % len(prompts)].prompt_ids))
                 for i in range(groups)]
        t0 = time.perf_counter()
        outs = engine.llm.generate(batch, sp, use_tqdm=False)
        if c:  # the first call warms up
            times.append(time.perf_counter() - t0)
            samples += sum(len(o.outputs) for o in outs)
            tokens += sum(len(s.token_ids) for o in outs for s in o.outputs)
    return {"seconds_per_call": float(np.median(times)), "samples_per_s": samples / sum(times),
            "tokens_per_s": tokens / sum(times), "mean_response_tokens": tokens / max(samples, 1)}


def json_object(text: str) -> dict:
    """--vllm-kwargs: a JSON object (vllm.LLM's keyword arguments), else a usage error naming it."""
    try:
        got = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(got, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of vllm.LLM arguments, got {type(got).__name__}")
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.actor_stream")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="verl-schema parquet (the run's train file)")
    p.add_argument("--inflight", type=int, nargs="+", default=[256, 512])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--groups", type=int, default=16, help="prompts per generate call (the peer's step)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-gib", type=float, default=4.0)
    p.add_argument("--no-compile", action="store_true", help="actors.vllm_compile=false")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--profile", help="cProfile the last --inflight run into PREFIX.txt and PREFIX.prof")
    p.add_argument("--vllm-kwargs", type=json_object, default={},
                   help='more vllm.LLM arguments as JSON, e.g. \'{"async_scheduling": true}\'')
    p.add_argument("--json")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from engines.vllm_engine import VLLMEngine  # imports torch and vLLM

    tok = AutoTokenizer.from_pretrained(args.model)
    dcfg = DataConfig(max_prompt_length=512, overlong_prompt="filter")
    prompts = build_prompts([args.data], tok, dcfg, limit=4096)
    cfg = ActorConfig(engine="vllm", device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                      kv_cache_memory_bytes=int(args.kv_gib * 2**30) if args.device.startswith("cuda") else 0,
                      vllm_compile=not args.no_compile, n=args.n, temperature=args.temperature,
                      max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    engine = VLLMEngine(args.model, cfg, vllm_kwargs=args.vllm_kwargs)
    start_s = time.perf_counter() - t0
    score = record_scorer(DataConfig(format_score=0.1).reward_options())
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=1.0, max_tokens=args.max_tokens)

    stream(engine, prompts, params, inflight=args.inflight[0], seconds=3, score=score)
    rows = {}
    for i, k in enumerate(args.inflight):
        run = functools.partial(stream, engine, prompts, params, inflight=k, seconds=args.seconds, score=score)
        last = i == len(args.inflight) - 1
        rows[f"stream_{k}"] = profiled(run, Path(args.profile)) if args.profile and last else run()
    rows["generate"] = generate_calls(engine, prompts, groups=args.groups, n=args.n, temperature=args.temperature,
                                      max_tokens=args.max_tokens, calls=args.calls)
    _report(args, start_s, rows)
    return 0


def _report(args, start_s: float, rows: dict) -> None:
    print(f"\nmodel {args.model}, data {args.data}, n={args.n}, T={args.temperature}, max_tokens={args.max_tokens}, "
          f"{'no compile' if args.no_compile else 'compiled'}, engine start {start_s:.1f} s")
    print("| mode | samples/s | tokens/s | engine steps/s | seqs per step | response tokens |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['samples_per_s']:.0f} | {r['tokens_per_s']:,.0f} | {r.get('steps_per_s', 0):.0f} | "
              f"{r.get('mean_seqs_per_step', 0):.0f} | {r['mean_response_tokens']:.1f} |")
    print(f"generate: {rows['generate']['seconds_per_call']:.3f} s per call of {args.groups} x {args.n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "engine_start_s": start_s, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
