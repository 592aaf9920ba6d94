"""Where one learner step goes on a small model: variants of the learner's own `train_step`, timed
and profiled, beside the matmul peak of the same device.

    python -m bench.learner_step [--shape smollm2-135m] [--variants fsdp-mb16,fsdp-mb128,...]
                                 [--steps 5] [--batches 1] [--profile DIR] [--replay DIR] [--json F]
                                 [--batch smollm2|rl|dense]   (--shape 1.5b --batch rl: the 1.5B RL batches)
                                 [--groups 16]   (prompt groups of a `smollm2` batch)

The batch is the SmolLM2 run's (configs/gsm8k_smollm2.yaml on chain_sum): 16 prompt groups x 8
samples, prompts of ~80-120 tokens, responses long-tailed around 50 tokens (at most 320); or the
recorded batches of a real run (`--replay RUN/batches`, `trainer.record_batches`). A variant is a
name from VARIANTS (learner config overrides); each builds its model afresh, takes warm-up steps,
then `--steps` timed steps (median reported), and with `--profile` one more under torch.profiler:
GPU kernel time against wall time and the top operators go to DIR/<variant>.txt. `--batches K` cycles
through K different batches (synthetic seeds, or the first K recorded steps), as a run's steps differ
in length: a compiled variant's recompilations then show in its times and in `graphs compiled`.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
import traceback

import numpy as np

from bench.learner import flops_per_token, make_rows, matmul_peak, rl_groups
from buffer.replay import ReplaySource
from buffer.schema import Limits
from data.shapes import model_config
from learner.config import LearnerConfig
from runbase.net import free_port

GROUPS, N = 16, 8                 # the SmolLM2 config: 16 prompts x 8 samples per step
PROMPT = (80, 120)                # chain_sum prompts with the chat template
RESPONSE_MEDIAN, RESPONSE_MAX = 50, 320
WARMUP = 2                        # steps before timing: allocator, cuBLAS heuristics, compilation

# packed rows of one 32k-token micro-batch, varlen attention; with one rank without FSDP: the SmolLM2 config's learner
_PACKED = dict(use_dynamic_bsz=True, max_tokens_per_micro_batch=32768, micro_batch_size_per_gpu=128,
               pack_sequences=True, attn_implementation="varlen")
_ONE_PACKED = dict(**_PACKED, plain_one_rank=True)

# name -> LearnerConfig overrides
VARIANTS = {
    "fsdp-mb16": dict(micro_batch_size_per_gpu=16),
    "fsdp-mb128": dict(micro_batch_size_per_gpu=128),
    "fsdp-dyn16k": dict(use_dynamic_bsz=True, max_tokens_per_micro_batch=16384, micro_batch_size_per_gpu=128),
    "fsdp-mb128-compile": dict(micro_batch_size_per_gpu=128, compile="inductor"),
    "fsdp-mb128-nochunk": dict(micro_batch_size_per_gpu=128, logprob_chunk_tokens=0),
    "fsdp-mb128-chunk8k": dict(micro_batch_size_per_gpu=128, logprob_chunk_tokens=8192),
    "fsdp-packed-flex": dict(use_dynamic_bsz=True, max_tokens_per_micro_batch=32768, micro_batch_size_per_gpu=128,
                             pack_sequences=True, pack_multiple=4096, attn_implementation="flex_attention"),
    "fsdp-packed-varlen": _PACKED,
    "fsdp-mb128-liger": dict(micro_batch_size_per_gpu=128, kernels="liger"),
    "one-mb128": dict(micro_batch_size_per_gpu=128, plain_one_rank=True),
    "one-mb128-liger": dict(micro_batch_size_per_gpu=128, plain_one_rank=True, kernels="liger"),
    "one-packed-varlen-liger": dict(**_ONE_PACKED, kernels="liger"),
    # FSDP2 (one rank or many) with the same packing, attention and kernels: the multi-GPU learner's path
    "fsdp-packed-varlen-liger": dict(**_PACKED, kernels="liger"),
    # the same on a bf16 copy of the weights instead of autocast (learner.plain_compute=shadow)
    "one-packed-varlen-liger-shadow": dict(**_ONE_PACKED, kernels="liger", plain_compute="shadow"),
    # liger's own chunking of the head (chunk_mem_const 1: ~86 chunks for SmolLM2), as before it was widened
    "one-packed-varlen-liger-chunk64": dict(**_ONE_PACKED, kernels="liger", logprob_chunk_tokens=64),
    "one-packed-varlen-compile": dict(**_ONE_PACKED, compile="inductor"),
    "one-packed-varlen-liger-compile": dict(**_ONE_PACKED, kernels="liger", compile="inductor"),
    # Inductor fuses the layers' norms, rotary and activations; liger's fused linear head beside them
    "one-packed-varlen-ligerhead-compile": dict(**_ONE_PACKED, kernels="liger_head", compile="inductor"),
}


def synthetic_rows(vocab: int, seed: int = 0, kind: str = "smollm2", groups: int = GROUPS):
    """One step's rows: the SmolLM2 run's (`smollm2`: `groups` prompts x N samples), or bench.learner's one-rank
    batches (`rl`: 2 prompts x 8 long-tailed responses of median 600 tokens, at most 3072; `dense`: 8 rows of 2048
    tokens)."""
    if kind == "smollm2":
        return rl_groups(np.random.default_rng(seed), vocab, groups, N, PROMPT, RESPONSE_MEDIAN, 0.6, (4, RESPONSE_MAX))
    return make_rows(kind, vocab, rank=0, seed=seed)


def replayed_rows(path: str, vocab: int, count: int = 1):
    """The first `count` recorded steps of a real run, each as the learner turns it into rows."""
    from learner.batching import groups_to_rows  # lazy: imports torch

    source = ReplaySource(path, Limits(vocab_size=vocab))
    return [groups_to_rows(source.next_batch(i).groups, i) for i in range(count)]


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far (0 without compilation)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def batch_flops(cfg, rows) -> float:
    """A step's training FLOPs on `rows`, each row attending over its own causal context."""
    tokens = sum(r.num_tokens for r in rows)
    return flops_per_token(cfg, sum(r.num_tokens ** 2 for r in rows) / tokens / 2) * tokens


def run_variant(name: str, cfg, batches, args, dev, peak: float) -> dict:
    import torch

    from learner.model import random_policy  # lazy: imports torch

    over = dict(VARIANTS[name])
    lc = LearnerConfig(lr=1e-6, param_dtype="bfloat16" if dev.type == "cuda" else "float32",
                       device="cuda" if dev.type == "cuda" else "cpu", **over)
    torch.manual_seed(0)
    base = random_policy(cfg, dev, lc.attn_implementation)
    with unpatched_after(sys.modules[type(base).__module__]):
        return _timed_variant(name, base, lc, cfg, batches, args, dev, peak)


@contextlib.contextmanager
def unpatched_after(module):
    """liger's kernels patch the model's modeling module itself (its rotary-embedding function, for every
    model of that architecture in the process): put it back after a variant, or the variants after a liger
    one would silently run liger's rotary too (seen on the H200: liger_head variants timed with it)."""
    saved = dict(vars(module))
    try:
        yield
    finally:
        for key in [k for k in vars(module) if k not in saved]:
            delattr(module, key)
        for key, value in saved.items():
            setattr(module, key, value)


def _timed_variant(name, base, lc, cfg, batches, args, dev, peak) -> dict:
    """Warm-up and timed steps of one variant on `base` (then one profiled step, when asked)."""
    import torch

    from learner.step import train_step  # lazy: imports torch
    from learner.train import build_policy  # lazy: imports torch

    model, opt = build_policy(lc, "", dev, model=base)
    times, graphs0, cycled = [], graphs_compiled(), itertools.cycle(batches)

    def step():
        rows = next(cycled)
        train_step(model, opt, rows, rows, lc, temperature=0.8, world=1, pad_id=0, device=dev, group=None)

    for i in range(WARMUP + args.steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    res = {"variant": name, "step_s": float(np.median(times)), "min_s": float(min(times)),
           "max_s": float(max(times)), "graphs_compiled": graphs_compiled() - graphs0}
    if args.profile:
        res.update(profile_step(step, dev, f"{args.profile}/{name}.txt"))
    flops = np.mean([batch_flops(cfg, rows) for rows in batches])
    res["effective_mfu"] = flops / res["step_s"] / peak
    res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    del model, opt
    return res


def profile_step(step, dev, out: str) -> dict:
    """One step under torch.profiler: kernel time on the GPU against the step's wall time."""
    from pathlib import Path

    import torch

    from learner.profiling import profiler, summarize  # lazy: imports torch

    with profiler(dev.type == "cuda") as prof:
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return summarize(prof, Path(out), wall, dev.type == "cuda")


def print_table(results: list[dict]) -> None:
    """The variants' results as a Markdown table (BENCHMARKS.md's)."""
    print("| variant | step (median, max) | GPU kernel time (profiled) | launches | graphs compiled | effective MFU "
          "| peak mem |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error'][:80]} | | | | | |")
            continue
        print(f"| {r['variant']} | {r['step_s'] * 1e3:.0f} ms, {r['max_s'] * 1e3:.0f} | "
              f"{r.get('gpu_kernel_s', 0) * 1e3:.0f} ms | {r.get('launches', 0)} | {r['graphs_compiled']} | "
              f"{r['effective_mfu']:.1%} | {r['peak_mem_gib']:.1f} GiB |")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.learner_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--variants", default="fsdp-mb16,fsdp-mb128,one-mb128")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batches", type=int, default=1, help="different batches cycled through (steps differ in length)")
    p.add_argument("--profile", help="folder for one profiled step per variant")
    p.add_argument("--replay", help="a run's recorded batches (trainer.record_batches) instead of synthetic ones")
    p.add_argument("--batch", choices=["smollm2", "rl", "dense"], default="smollm2",
                   help="synthetic batches: the SmolLM2 run's, or bench.learner's long-tailed RL or dense ones")
    p.add_argument("--groups", type=int, default=GROUPS,
                   help="prompt groups of a synthetic `smollm2` batch (fewer: a quick check of the variants)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--json")
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.groups < 1:
        p.error("--groups: at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    dev = torch.device(args.device)
    # every compiled variant recompiles the one decoder-layer forward they share; the default limit (8)
    # would send later variants back to eager without a word
    torch._dynamo.config.recompile_limit = 64
    # the step statistics are all-reduced on the host, as over the learner's gloo group
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    peak = matmul_peak(args.device)
    cfg = model_config(args.shape)
    batches = replayed_rows(args.replay, cfg.vocab_size, args.batches) if args.replay else \
        [synthetic_rows(cfg.vocab_size, seed, args.batch, args.groups) for seed in range(args.batches)]
    for rows in batches:
        tokens, resp = sum(r.num_tokens for r in rows), sum(len(r.response_ids) for r in rows)
        print(f"batch: {len(rows)} rows, {tokens} tokens ({resp} response), longest row "
              f"{max(r.num_tokens for r in rows)}", flush=True)
    print(f"matmul peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    results = []
    for name in args.variants.split(","):
        try:
            res = run_variant(name, cfg, batches, args, dev, peak)
        except Exception as e:  # one variant's failure must not cost the others' numbers
            res = {"variant": name, "error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        results.append(res)
        print(json.dumps(res), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    print(f"\nlearner step: {args.shape}, {len(batches)} batch(es) of {len(batches[0])} rows, {args.device}, "
          f"median of {args.steps}")
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
