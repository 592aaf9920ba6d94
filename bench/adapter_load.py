"""The engine's side of an adapter's publication: what `AdapterVersions.load` spends on each version on a real vLLM
engine serving LoRA, by phase, beside the file round trip of safetensors' own writer on the same tensors.

    python -m bench.adapter_load [--model builtin:smollm2-135m-instruct] [--rank 32] [--versions 6]
        [--device cpu|cuda] [--json OUT]

Per version, medians in ms: the fingerprint of the received tensors (`checksum`; an actor skips it, since its
subscriber has verified them), LoRA's scale folded into B (`scaled`), the adapter file's write
(`write_safetensors`), vLLM's `add_lora` (its loader reading the folder), and the whole `load` as an actor calls
it (verified) and as a direct caller does (not).
Reference: safetensors' `save_file` of host copies, read back with `load_file` and fingerprinted, the same tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from actors.config import ActorConfig
from data.tasks import TaskConfig
from data.tiny_model import resolve_model_path
from engines.vllm_lora import scaled, write_safetensors
from learner.config import LoraConfig
from weightsync.flat import checksum, layout, pack, unpack


def timed(fn, *args, **kwargs) -> tuple[object, float]:
    """fn's result and its milliseconds, GPU work included (a CUDA device synchronised before the clock stops)."""
    import torch

    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def delivered(shapes: dict, device: str, dtype, seed: int) -> dict:
    """A version as a weight subscriber hands it over: views of one flat buffer per dtype (weightsync.flat)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    sd = {k: (torch.randn(s, generator=gen) * 0.05).to(device, dtype) for k, s in shapes.items()}
    lay = layout(sd)
    return unpack(pack(sd, lay), lay)


def build(args):
    """A vLLM engine serving a rank-`args.rank` adapter on every linear layer of `args.model`."""
    from engines.vllm_engine import VLLMEngine   # imports vLLM: after the arguments are read

    path = resolve_model_path(args.model, TaskConfig())
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    cfg = ActorConfig(engine="vllm", device=args.device, dtype=dtype, max_model_len=256)
    return VLLMEngine(path, cfg, lora=LoraConfig(rank=args.rank, alpha=2.0 * args.rank))


def run(args) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    adapters = build(args).adapters
    add_lora, add_ms = adapters.engine.add_lora, []

    def timed_add(request):
        ok, ms = timed(add_lora, request)
        add_ms.append(ms)
        return ok

    adapters.engine.add_lora = timed_add
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = {k: [] for k in ("fingerprint", "fold", "write", "add_lora", "load_verified", "load_unverified",
                            "safetensors_save", "safetensors_read_back_and_fingerprint")}
    scale = adapters.lora.alpha / adapters.lora.rank
    with tempfile.TemporaryDirectory(prefix="adapter-load-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) \
            as scratch:
        host = write_safetensors(os.path.join(scratch, "w.safetensors"), delivered(adapters.shapes, args.device,
                                                                                   dtype, 0))   # warm-up
        for v in range(1, 2 * args.versions + 1):
            sd = delivered(adapters.shapes, args.device, dtype, v)
            csum, ms = timed(checksum, sd)
            rows["fingerprint"].append(ms)
            rows["fold"].append(timed(scaled, sd, scale)[1])
            host, ms = timed(write_safetensors, os.path.join(scratch, "w.safetensors"), sd, host)
            rows["write"].append(ms)
            verified = v % 2 == 0   # alternate: each path measured on every other version
            rows["load_verified" if verified else "load_unverified"].append(
                timed(adapters.load, sd, v, csum, verified=verified)[1])
            rows["add_lora"].append(add_ms[-1])
            ref = os.path.join(scratch, "ref.safetensors")
            rows["safetensors_save"].append(timed(lambda: save_file(   # the copies to the host timed too
                {k: t.detach().contiguous().cpu() for k, t in sd.items()}, ref))[1])
            rows["safetensors_read_back_and_fingerprint"].append(timed(lambda: checksum(load_file(ref)))[1])
    size = sum(t.numel() * t.element_size() for t in sd.values())
    return {"model": args.model, "rank": args.rank, "device": args.device, "adapter_mb": round(size / 1e6, 1),
            "versions_per_path": args.versions,
            "median_ms": {k: round(statistics.median(v), 1) for k, v in rows.items() if v}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--versions", type=int, default=6, help="versions per load path (verified and not)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    result = run(args)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
