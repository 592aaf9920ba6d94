"""The learner's logprob head: plain full-batch logits vs the chunked, response-only head, in one run.

    python -m bench.logprob [--shape 0.5b] [--chunks 0,2048,512] [--device cuda|cpu] [--rows 8]
                            [--prompt 256] [--response 32-768] [--steps 3] [--json F]

For each `learner.logprob_chunk_tokens` value, a fresh process builds the same randomly initialised
Qwen2-shaped model, wraps it with the learner's `shard` and runs the learner's own `train_step` on the
same RL-shaped batch (`--rows` sequences: a `--prompt`-token prompt and a response whose length is
drawn uniformly from `--response`, right-padded as the learner collates them). It reports the step
time and the peak memory (torch.cuda.max_memory_allocated on CUDA, max RSS on CPU) beside the raw
limit measured in the same process: the three GEMMs the output head needs for the response tokens
alone (forward logits, gradient of the hidden states, gradient of the weight), timed with no
softmax, no padding and no prompt positions. `0` is the plain path: logits for every position of
the batch, then an fp32 copy for the log-softmax.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from bench.common import run_each, timed_steps
from data.shapes import QWEN2_SHAPES
from learner.config import LearnerConfig


def make_rows(vocab: int, rows: int, prompt: int, lo: int, hi: int, seed: int = 0):
    from learner.batching import Row  # lazy: imports torch

    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        n = int(rng.integers(lo, hi + 1))
        out.append(Row(prompt_ids=rng.integers(0, vocab, prompt), response_ids=rng.integers(0, vocab, n),
                       behavior_logprobs=np.zeros(n, np.float32), advantage=1.0, reward=1.0, staleness=0,
                       group_id=f"b{i}"))
    return out


def _raw_head_s(hidden: int, vocab: int, tokens: int, dtype, dev, reps: int = 3) -> float:
    """Forward logits + the two backward GEMMs of the head for `tokens` response tokens."""
    import torch

    h = torch.randn(tokens, hidden, dtype=dtype, device=dev)
    w = torch.randn(vocab, hidden, dtype=dtype, device=dev)
    best = float("inf")
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        g = h @ w.T          # logits
        _ = g @ w            # d hidden
        _ = g.T @ h          # d weight
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def run_setting(chunk: int, args, port: int, out) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.model import shard  # lazy: imports torch

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(os.cpu_count() or 1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = dist.new_group(backend="gloo") if cuda else None
    dev = torch.device("cuda:0" if cuda else "cpu")
    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN2_SHAPES[args.shape], attn_implementation="sdpa")
    with torch.device(dev):
        model = Qwen2ForCausalLM(cfg)
    shard(model, dev, param_dtype="bfloat16" if cuda else "float32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    lo, hi = (int(x) for x in args.response.split("-"))
    rows = make_rows(cfg.vocab_size, args.rows, args.prompt, lo, hi)
    lc = LearnerConfig(micro_batch_size_per_gpu=args.micro_batch, correction="none", logprob_chunk_tokens=chunk)
    times, losses, peak = timed_steps(model, opt, rows, lc, dev=dev, group=group, steps=args.steps)
    response = sum(len(r.response_ids) for r in rows)
    raw = _raw_head_s(cfg.hidden_size, cfg.vocab_size, response, torch.bfloat16 if cuda else torch.float32, dev)
    out.put({"chunk": chunk, "step_s": min(times), "peak_gib": peak, "losses": losses, "raw_head_s": raw,
             "response_tokens": response, "positions": sum(r.num_tokens for r in rows)})
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.logprob", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--chunks", default="0,2048,512")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", default="32-768", help="response lengths, uniform in LO-HI")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    results = run_each(run_setting, [int(c) for c in args.chunks.split(",")], args)
    ref = results[0]
    mem = "peak GPU memory" if args.device == "cuda" else "host max RSS"
    print(f"\nlogprob head bench: Qwen2 {args.shape} shape, 1 x {args.device}, {args.rows} rows of {args.prompt} prompt "
          f"+ {args.response} response tokens ({ref['response_tokens']} response of {ref['positions']} positions), "
          f"micro-batch {args.micro_batch}, best of {args.steps} steps")
    print(f"| logprob_chunk_tokens | step time | vs first | {mem} | raw head GEMMs (response tokens) | loss (last) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['chunk'] or '0 (plain logits)'} | {r['step_s']:.3f} s | {ref['step_s'] / r['step_s']:.2f}x | "
              f"{r['peak_gib']:.2f} GiB | {r['raw_head_s']:.3f} s | {r['losses'][-1]:.5f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
