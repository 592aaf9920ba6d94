"""Learner throughput and MFU beside the measured matmul peak of the same device, in one run.

    python -m bench.learner [--shape 0.5b|1.5b|tiny] [--gpus 1] [--batch dense|rl|rl-packed|both|all] [--attn sdpa]
                            [--ckpt off|on|both] [--steps 4] [--device cuda|cpu] [--scale 1] [--json F]

Each rank builds a randomly initialised Qwen2-shaped model (data/shapes.py), wraps it with the
learner's own FSDP2 code (learner/model.py: bf16 compute, fp32 master weights and optimizer)
and runs the learner's own `train_step` (policy loss with per-token logprobs over the full
vocabulary) on two kinds of batch: `dense` (8 rows of 2048 tokens per rank, no padding) and `rl`
(groups of 8 responses of long-tailed lengths after a prompt, as the buffer hands them over,
padded per micro-batch; `rl-packed`: the same rows with `learner.pack_sequences`, each micro-batch one
sequence without padding). FLOPs per token: 6 x (parameters without the input embedding) plus
causal attention (6 x layers x hidden x context); MFU = achieved / measured bf16 matmul peak.
On `rl` batches, padding is waste: effective MFU counts real tokens only. `--scale` multiplies every
length of the synthetic rows (a quick CPU check of the plumbing: 0.25).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

from bench.common import fresh_processes
from data.shapes import QWEN2_SHAPES
from learner.config import LearnerConfig
from runbase.net import free_port

MATMUL_N = 8192          # square bf16 matmul for the peak: large enough to saturate an H200
DENSE_ROWS, DENSE_LEN = 8, 2048   # per rank: the usual FSDP2 MFU anchor (plain HF Qwen2 on 8 x 2048)
RL_GROUPS_PER_RANK, RL_N = 2, 8   # 16 rows per rank: 2 prompts x 8 responses
RL_PROMPT = (64, 512)              # prompt length range
RL_RESPONSE_MEDIAN, RL_RESPONSE_MAX = 600, 3072  # long-tailed (lognormal) response lengths
MICRO_BATCH = 8


def matmul_peak(device: str, n: int = MATMUL_N, reps: int = 20) -> float:
    """Measured dense bf16 matmul FLOP/s of this device (the roofline the MFU is against)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = n if device == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def make_rows(kind: str, vocab: int, rank: int, seed: int = 0, scale: float = 1.0):
    """A rank's rows of one batch kind, every length times `scale`."""
    from learner.batching import Row  # lazy: imports torch

    rng = np.random.default_rng(seed + rank)
    rows = []
    if kind == "dense":
        n = int(DENSE_LEN * scale)
        for i in range(DENSE_ROWS):
            p = n // 4
            rows.append(Row(prompt_ids=rng.integers(0, vocab, p), response_ids=rng.integers(0, vocab, n - p),
                            behavior_logprobs=np.full(n - p, -1.0, np.float32), advantage=1.0 - 2 * (i % 2),
                            reward=0.0, staleness=0, group_id=f"d{i}"))
        return rows
    prompt = tuple(int(x * scale) for x in RL_PROMPT)
    return rl_groups(rng, vocab, RL_GROUPS_PER_RANK, RL_N, prompt, RL_RESPONSE_MEDIAN * scale, 0.8,
                     (16, int(RL_RESPONSE_MAX * scale)))


def rl_groups(rng, vocab: int, groups: int, n: int, prompt_len: tuple, median: float, sigma: float,
              clip: tuple) -> list:
    """Prompt groups as the buffer hands them over: one random prompt of a length in `prompt_len` per
    group, n responses of lognormal lengths (median, sigma) clipped to `clip`, random advantages."""
    from learner.batching import Row  # lazy: imports torch

    rows = []
    for g in range(groups):
        prompt = rng.integers(0, vocab, int(rng.integers(*prompt_len)))
        for _ in range(n):
            k = int(min(clip[1], max(clip[0], rng.lognormal(np.log(median), sigma))))
            rows.append(Row(prompt_ids=prompt, response_ids=rng.integers(0, vocab, k),
                            behavior_logprobs=np.full(k, -1.0, np.float32), advantage=float(rng.normal()),
                            reward=0.0, staleness=0, group_id=f"g{g}"))
    return rows


def flops_per_token(cfg, context: float) -> float:
    h, layers, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * cfg.intermediate_size   # q,o + k,v + MLP
    params = layers * per_layer + v * h                                   # + LM head
    return 6 * params + 6 * layers * h * context                          # causal attention: half of 12


def kind_batch(kind: str, vocab: int, rank: int, world: int, pack_multiple: int, scale: float = 1.0) -> tuple:
    """The learner config and the step batch of one batch kind, with this rank's share, its real and collated
    (padded) token counts and its mean causal context per token."""
    from learner.batching import collated_shape, micro_batches, split_rows  # lazy: imports torch

    packed = kind == "rl-packed"
    lc = LearnerConfig(micro_batch_size_per_gpu=MICRO_BATCH, lr=1e-6, pack_sequences=packed,
                       pack_multiple=pack_multiple if packed else 0)
    # the step batch of all ranks, dealt to ranks as the learner does (longest first, snake order)
    rows = [x for rk in range(world) for x in make_rows("rl" if packed else kind, vocab, rk, scale=scale)]
    share = split_rows(rows, world)[rank]
    real = sum(r.num_tokens for r in share)
    # every slot collate computes, padding and a packed batch's filler included
    padded = sum(math.prod(collated_shape(mb, packed, lc.pack_multiple))
                 for mb in micro_batches(share, MICRO_BATCH))
    context = sum(r.num_tokens ** 2 for r in share) / real / 2  # mean causal context per token
    return lc, rows, share, real, padded, context


def median_step_s(model, opt, share: list, rows: list, lc, steps: int, world: int, dev, cpu_group) -> float:
    """Median seconds of `steps` train steps after a warm-up one, all ranks starting each step together."""
    import torch
    import torch.distributed as dist

    from learner.step import train_step  # lazy: imports torch

    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 1):  # the first step warms allocator and kernels up
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        train_step(model, opt, share, rows, lc, temperature=1.0, world=world, pad_id=0, device=dev,
                   group=cpu_group)
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def rank_main(rank: int, world: int, port: int, args, out) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.model import shard  # lazy: imports torch

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    # the learner's small host-side collectives (step statistics) go over gloo, as in learner/train.py
    cpu_group = dist.new_group(backend="gloo") if device == "cuda" else None
    peak = matmul_peak(device)
    cfg = Qwen2Config(**QWEN2_SHAPES[args.shape], attn_implementation=args.attn)
    results = []
    for ckpt in (["off", "on"] if args.ckpt == "both" else [args.ckpt]):
        torch.manual_seed(0)
        with torch.device(dev):
            model = Qwen2ForCausalLM(cfg)
        shard(model, dev, param_dtype="bfloat16" if device == "cuda" else "float32",
              activation_checkpointing=ckpt == "on", compile=args.compile)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")
        kinds = {"both": ["dense", "rl"], "all": ["dense", "rl", "rl-packed"]}.get(args.batch, [args.batch])
        for kind in kinds:
            lc, rows, share, real, padded, context = kind_batch(kind, cfg.vocab_size, rank, world, args.pack_multiple,
                                                                args.scale)
            step = median_step_s(model, opt, share, rows, lc, args.steps, world, dev, cpu_group)
            fpt = flops_per_token(cfg, context)
            results.append({"rank": rank, "ckpt": ckpt, "batch": kind, "step_s": step,
                            "tokens_per_s": real / step, "padded_tokens_per_s": padded / step,
                            "mfu": fpt * padded / step / peak, "effective_mfu": fpt * real / step / peak,
                            "padding_waste": 1 - real / padded, "peak_flops": peak,
                            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0})
        del model, opt
        if device == "cuda":
            torch.cuda.empty_cache()
    out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def parse_args(argv=None) -> argparse.Namespace:
    """The command line of `python -m bench.learner`."""
    p = argparse.ArgumentParser(prog="python -m bench.learner", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--gpus", type=int, default=1, help="ranks (GPUs, or CPU processes with --device cpu)")
    p.add_argument("--batch", choices=["dense", "rl", "rl-packed", "both", "all"], default="all")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flex_attention", "flash_attention_2"],
                   help="attention of the model (packing pays off with flex_attention or flash_attention_2)")
    p.add_argument("--pack-multiple", type=int, default=0,
                   help="rl-packed: learner.pack_multiple (1024 lets compiled flex_attention reuse a few lengths)")
    p.add_argument("--ckpt", choices=["off", "on", "both"], default="both")
    p.add_argument("--compile", choices=["off", "inductor", "aot_eager"], default="off",
                   help="learner.compile: each decoder layer torch.compiled (the warm-up step compiles)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--scale", type=float, default=1.0,
                   help="every length of the synthetic rows times this (0.25: a quick check of the plumbing)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.scale <= 0:
        p.error("--scale: must be > 0")
    return args


def gather_results(procs: list, out) -> list:
    """Every rank's results from the queue; ends the bench (killing the ranks) as soon as a rank has died."""
    import queue

    results, got = [], 0
    while got < len(procs):  # a rank that dies must end the bench, not leave it waiting
        try:
            results += out.get(timeout=5)
            got += 1
        except queue.Empty:
            dead = [i for i, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
            if dead:
                for pr in procs:
                    pr.kill()
                raise SystemExit(f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]})")
    return results


def merge_ranks(results: list) -> list:
    """One row per (ckpt, batch): the slowest rank's step, tokens/s of all ranks, the other figures averaged."""
    rows = []
    for key in sorted({(x["ckpt"], x["batch"]) for x in results}):
        mine = [x for x in results if (x["ckpt"], x["batch"]) == key]
        step = max(x["step_s"] for x in mine)  # the slowest rank sets the pace
        rows.append({"ckpt": key[0], "batch": key[1], "step_s": step,
                     "tokens_per_s": sum(x["tokens_per_s"] * x["step_s"] for x in mine) / step,
                     "mfu": float(np.mean([x["mfu"] for x in mine])),
                     "effective_mfu": float(np.mean([x["effective_mfu"] for x in mine])),
                     "padding_waste": float(np.mean([x["padding_waste"] for x in mine])),
                     "peak_tflops": float(np.mean([x["peak_flops"] for x in mine])) / 1e12,
                     "peak_mem_gib": max(x["peak_mem_gib"] for x in mine)})
    return rows


def report(args, rows: list, results: list) -> None:
    """Print the table of step time, throughput and MFU per batch kind, and write --json."""
    print(f"\nlearner bench: Qwen2 {args.shape} shape, {args.gpus} x {args.device}, {args.attn}, compile "
          f"{args.compile}, median of {args.steps} steps")
    print("| batch | act. ckpt | step | tokens/s (all ranks) | MFU | effective MFU (real tokens) | padding | "
          "matmul peak / GPU | peak mem |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['batch']} | {x['ckpt']} | {x['step_s']:.2f} s | {x['tokens_per_s']:,.0f} | {x['mfu']:.1%} | "
              f"{x['effective_mfu']:.1%} | {x['padding_waste']:.0%} | {x['peak_tflops']:.0f} TFLOP/s | "
              f"{x['peak_mem_gib']:.1f} GiB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "ranks": results}, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = fresh_processes()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args.gpus, port, args, out)) for r in range(args.gpus)]
    for pr in procs:
        pr.start()
    results = gather_results(procs, out)
    for pr in procs:
        pr.join(60)
    report(args, merge_ranks(results), results)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
