"""Peak device memory and first-step losses of the learner with FSDP2 offload off and on, in one run.

    python -m bench.offload [--shape 1.5b] [--steps 3] [--modes off,optimizer,param,both]
                            [--device cuda|cpu] [--json F]

For each mode, a fresh process builds a randomly initialised Qwen2-shaped model (data/shapes.py, same
seed in every mode), wraps it with the learner's own `learner.model.shard` (bf16 compute on CUDA,
fp32 master weights) and runs the learner's own `train_step` on the same fixed batch for `--steps`
optimizer steps:

- `off`: parameters, gradients and AdamW state on the device;
- `optimizer` (learner.optimizer_offload): AdamW state in host memory between steps, on the device
  only for `opt.step()`;
- `param` (learner.param_offload): FSDP2 CPUOffloadPolicy: sharded parameters and gradients in
  (pinned) host memory, each layer copied in to compute; the optimizer steps on the CPU;
- `both`: both knobs (same as `param`: the optimizer follows the parameters to the host).

It prints the peak device memory (torch.cuda.max_memory_allocated from after the model is built to the
end of the last step; host max RSS with --device cpu) and each step's loss next to the `off` losses:
offload moves tensors, not numbers, so the losses must agree within bf16 tolerance (the CPU AdamW
rounds differently from the CUDA one, nothing more). The loss is plain policy gradient with advantage
+1 on random tokens (i.e. their negative log-likelihood): it moves visibly every step, so a wrong
update would show. `--device cpu --shape tiny` runs the same code on a laptop
(tests/integration/test_bench_offload.py).
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from bench.common import run_each, timed_steps
from data.shapes import QWEN2_SHAPES
from learner.config import LearnerConfig

ROWS, ROW_LEN = 8, 1024   # one rank's batch: 8 sequences of 1024 tokens (256 prompt + 768 response)
PROMPT_LEN = 256
MICRO_BATCH = 2           # bounds the [rows, tokens, vocab] logits of a 152k vocabulary to ~2.5 GB
LR = 1e-5                 # large enough that the loss moves within 3 steps on random tokens
BF16_RTOL = 2e-2          # losses of two bf16 runs whose updates differ only by rounding
MODES = {"off": (False, False), "optimizer": (False, True), "param": (True, False), "both": (True, True)}


def make_rows(vocab: int, rows: int = ROWS, row_len: int = ROW_LEN, prompt_len: int = PROMPT_LEN, seed: int = 0):
    from learner.batching import Row  # lazy: imports torch

    rng = np.random.default_rng(seed)
    n = row_len - prompt_len
    return [Row(prompt_ids=rng.integers(0, vocab, prompt_len), response_ids=rng.integers(0, vocab, n),
                behavior_logprobs=np.zeros(n, np.float32), advantage=1.0, reward=1.0, staleness=0, group_id=f"b{i}")
            for i in range(rows)]


def run_mode(mode: str, args, port: int, out) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.model import shard  # lazy: imports torch

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = dist.new_group(backend="gloo") if cuda else None  # step statistics are CPU tensors (as in the learner)
    dev = torch.device("cuda:0" if cuda else "cpu")
    param_offload, optimizer_offload = MODES[mode]
    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN2_SHAPES[args.shape], attn_implementation="sdpa")
    with torch.device(dev):
        model = Qwen2ForCausalLM(cfg)
    shard(model, dev, param_dtype="bfloat16" if cuda else "float32", offload=param_offload)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    lc = LearnerConfig(lr=LR, micro_batch_size_per_gpu=args.micro_batch, correction="none",
                       param_offload=param_offload, optimizer_offload=optimizer_offload)
    rows = make_rows(cfg.vocab_size, args.rows, args.row_len, min(PROMPT_LEN, args.row_len // 4))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    times, losses, peak = timed_steps(model, opt, rows, lc, dev=dev, group=group, steps=args.steps)
    out.put({"mode": mode, "peak_gib": peak, "resident_gib": base, "losses": losses, "step_s": times,
             "params_on": str(next(model.parameters()).device)})
    dist.destroy_process_group()


def compare(results: list[dict]) -> list[dict]:
    """Each mode's largest relative loss difference to `off` (the reference)."""
    ref = next((r for r in results if r["mode"] == "off"), results[0])["losses"]
    for r in results:
        r["max_rel_loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref))
        r["losses_match"] = r["max_rel_loss_diff"] <= BF16_RTOL
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.offload", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1.5b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--modes", default="off,optimizer,param,both")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--rows", type=int, default=ROWS)
    p.add_argument("--row-len", type=int, default=ROW_LEN)
    p.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    p.add_argument("--json")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {list(MODES)}")
    results = run_each(run_mode, modes, args)
    compare(results)
    mem = "peak GPU memory" if args.device == "cuda" else "host max RSS"
    print(f"\noffload bench: Qwen2 {args.shape} shape, 1 x {args.device}, {args.rows} x {args.row_len} tokens, "
          f"micro-batch {args.micro_batch}, {args.steps} steps, lr {LR}")
    print(f"| mode | {mem} | model state resident | step time (last) | losses | max rel. diff to off |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['peak_gib']:.2f} GiB | {r['resident_gib']:.2f} GiB | {r['step_s'][-1]:.2f} s | "
              f"{', '.join(f'{x:.4f}' for x in r['losses'])} | {r['max_rel_loss_diff']:.1e} |")
    ok = all(r["losses_match"] for r in results)
    print(f"losses agree within bf16 tolerance ({BF16_RTOL}): {'yes' if ok else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
