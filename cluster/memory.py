"""GPU memory placement, sized before anything starts: every process's share of each GPU (learner rank,
actor engines, the evaluator, the publication's buffers) estimated from the model's size and the config,
and a job whose shares overrun a GPU refused at start-up with the table, instead of an engine that finds
too little memory minutes later or a learner that dies of CUDA OOM at its first long batch.

The estimates are the large, predictable items (weights, gradients, optimizer state, KV cache, weight
buffers, the logprob head's chunk, activations of one micro-batch); allocator slack and kernels'
workspaces are in MARGIN_FRACTION. Pure, except `model_numel` (reads file headers) and `gpu_total_bytes`
(asks nvidia-smi).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from cluster.placement import actor_gpu
from engines.vllm_lora import padded_rank

log = logging.getLogger(__name__)

GIB = 2**30
CUDA_CONTEXT_BYTES = int(0.6 * GIB)   # a process's CUDA context and cuBLAS workspaces (measured 0.5-0.6 GiB)
ENGINE_RUNTIME_BYTES = 6 * GIB  # a vLLM engine beyond weights and KV (CUDA graphs, sampler buffers): a 1.5b actor with
                               # 12 GiB of KV and 512 sequences peaked at 24.3 GiB against 18.3 of the rest (H100)
MARGIN_FRACTION = 0.05                 # the caching allocator's fragmentation, NCCL/kernels' workspaces
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
NVIDIA_SMI_TIMEOUT_S = 10              # a driver that does not answer this fast: the check is skipped, said once


@dataclass
class Share:
    who: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


class MemoryPlanError(ValueError):
    """The job's shares do not fit a GPU: the message is the table and what to change."""


def model_numel(model_dir: str | Path) -> int:
    """Parameters of a Hugging Face folder, from its safetensors headers (no tensor is read)."""
    total = 0
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors file to size the model from")
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= d
                total += count
    return total


def lora_numel(lora, dims: dict) -> int:
    """Parameters of the adapter `lora` (learner.lora) puts on a Llama-family model of `dims`: rank x (inputs +
    outputs) of each target module of every layer, and of the output head when it is named. A module name outside
    the Llama family's linear layers is counted as a square hidden x hidden one (its size is not in the config)."""
    if not lora.rank:
        return 0
    h, inter = dims["hidden"], dims["intermediate"]
    head_dim = dims.get("head_dim") or h // max(dims.get("heads", 1), 1)
    q, kv = dims.get("heads", 1) * head_dim, dims.get("kv_heads", dims.get("heads", 1)) * head_dim
    io = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h, "gate_proj": h + inter,
          "up_proj": h + inter, "down_proj": inter + h}
    names = list(io) if lora.target_modules == "all-linear" else list(lora.target_modules)
    per_layer = sum(io.get(n, 2 * h) for n in names if n != "lm_head")
    head = h + dims["vocab"] if "lm_head" in names else 0
    return lora.rank * (per_layer * dims["layers"] + head)


def _learner_share(cfg, numel: int, dims: dict, backend: str) -> Share:
    lc, a = cfg.learner, cfg.actors
    m = DTYPE_BYTES[lc.master_dtype]
    s = Share("learner-0", {"cuda context": CUDA_CONTEXT_BYTES})
    per_layer = numel / max(dims["layers"], 1)
    adapter = lora_numel(lc.lora, dims)
    trained = adapter or numel   # LoRA: only the adapter has gradients and optimizer state; the base is frozen
    if lc.param_offload:  # the shards live on the host; two layers gathered at a time (prefetch)
        s.parts["gathered layers (offload)"] = int(2 * per_layer * DTYPE_BYTES[lc.param_dtype])
    else:
        s.parts["weights"] = (numel + adapter) * m
        s.parts["gradients"] = trained * m
        s.parts["optimizer state"] = 2 * trained * m
        if lc.plain_compute == "shadow" and lc.plain_one_rank and cfg.cluster.learners == 1 and not adapter:
            s.parts["bf16 shadow + its gradients"] = 4 * numel
    tokens = lc.max_tokens_per_micro_batch if lc.use_dynamic_bsz else \
        lc.micro_batch_size_per_gpu * (cfg.data.max_prompt_length + a.max_tokens)
    h, inter = dims["hidden"], dims["intermediate"]
    one_layer = tokens * (16 * h + 4 * inter) * 2  # a decoder layer's saved activations in bf16
    s.parts["activations"] = int(tokens * h * 2 * dims["layers"] + one_layer) if lc.activation_checkpointing \
        else int(one_layer * dims["layers"])
    chunk = lc.logprob_chunk_tokens or tokens
    s.parts["logprob head"] = chunk * dims["vocab"] * 4 * 3  # fp32 logits, softmax, their gradient
    if cfg.trainer.val_engine == "learner":  # rank 0's HF engine: a copy of the model in the engines' dtype
        s.parts["evaluation engine"] = numel * DTYPE_BYTES[a.dtype]
    if backend == "cuda_ipc":  # the bucket being cast and flattened for the engines (LoRA: the adapter alone)
        wire = (adapter or numel) * DTYPE_BYTES[cfg.weightsync.dtype]
        s.parts["publication buckets"] = int(min(2 * cfg.weightsync.bucket_mb * 2**20, 2 * wire))
    return s


def _engine_share(cfg, who: str, numel: int, dims: dict, total: int, utilization: float) -> Share:
    a = cfg.actors
    s = Share(who, {"cuda context": CUDA_CONTEXT_BYTES})
    adapter = lora_numel(cfg.learner.lora, dims)
    weights = numel * DTYPE_BYTES[a.dtype]
    if a.kv_cache_memory_bytes:
        s.parts.update({"weights": weights, "kv cache": a.kv_cache_memory_bytes, "runtime": ENGINE_RUNTIME_BYTES})
    else:  # vLLM takes its fraction of the card for weights, activations and KV together
        s.parts["gpu_memory_utilization share"] = max(int(utilization * total), weights + ENGINE_RUNTIME_BYTES)
    s.parts["received weights"] = (adapter or numel) * DTYPE_BYTES[cfg.weightsync.dtype]  # the subscriber's
    if adapter:   # vLLM's adapter slots (actors.vllm_max_loras), each padded to the rank vLLM serves
        rank = cfg.learner.lora.rank
        padded = padded_rank(rank) or rank   # a rank vLLM cannot serve is refused when the engine is built
        slot = lora_numel(dataclasses.replace(cfg.learner.lora, rank=padded), dims) * DTYPE_BYTES[a.dtype]
        s.parts["LoRA slots"] = a.vllm_max_loras * slot
        # a version's B matrices with LoRA's scale folded in, made beside the received ones (vllm_lora.scaled):
        # about half the adapter, counted whole
        s.parts["scaled adapter copy"] = adapter * DTYPE_BYTES[cfg.weightsync.dtype]
    return s


def plan(cfg, numel: int, dims: dict, n_gpus: int, total: int, backend: str) -> dict[int, list[Share]]:
    """GPU index -> the shares of the processes on it (cluster/placement.py's placement); `backend`: the
    weight backend as the launcher resolved it."""
    gpus: dict[int, list[Share]] = {}
    if cfg.learner.on_cuda(n_gpus > 0):
        for rank in range(cfg.cluster.learners):
            share = _learner_share(cfg, numel, dims, backend)
            share.who = f"learner-{rank}"
            gpus.setdefault(rank % n_gpus, []).append(share)
    if cfg.actors.device.startswith("cuda") and cfg.actors.engine == "vllm":
        for i in range(cfg.cluster.actors):
            g = actor_gpu(i, n_gpus, cfg.cluster.learners)
            gpus.setdefault(g, []).append(_engine_share(cfg, f"actor-{i}", numel, dims, total,
                                                        cfg.actors.gpu_memory_utilization))
        if cfg.trainer.val_engine == "vllm":
            gpus.setdefault(actor_gpu(0, n_gpus, cfg.cluster.learners), []).append(
                _engine_share(cfg, "evaluator", numel, dims, total, cfg.trainer.val_gpu_memory_utilization))
    return gpus


def table(shares: list[Share], total: int) -> str:
    rows = [f"  {s.who:<12} {s.total / GIB:7.2f} GiB  (" +
            ", ".join(f"{k} {v / GIB:.2f}" for k, v in s.parts.items()) + ")" for s in shares]
    used = sum(s.total for s in shares)
    rows.append(f"  {'total':<12} {used / GIB:7.2f} GiB + {MARGIN_FRACTION:.0%} margin of the card's "
                f"{total / GIB:.2f} GiB")
    return "\n".join(rows)


def check(gpus: dict[int, list[Share]], total: int) -> list[str]:
    """The per-GPU tables (for the start-up log); raises MemoryPlanError naming the first GPU that overruns."""
    out = []
    for g, shares in sorted(gpus.items()):
        used = sum(s.total for s in shares)
        t = table(shares, total)
        if used > total * (1 - MARGIN_FRACTION):
            raise MemoryPlanError(
                f"GPU {g} cannot hold this job's processes (estimated shares, cluster/memory.py):\n{t}\n"
                "make room with learner.param_offload=true (shards and optimizer on the host), learner.master_dtype="
                "bfloat16, learner.activation_checkpointing=true, a smaller actors.kv_cache_memory_bytes or "
                "gpu_memory_utilization, fewer actors on this GPU, or trainer.val_engine=vllm")
        out.append(f"GPU {g}:\n{t}")
    return out


def model_dims(model_dir: str | Path) -> dict:
    c = json.loads((Path(model_dir) / "config.json").read_text())
    return {"hidden": c.get("hidden_size", 0), "intermediate": c.get("intermediate_size", 0),
            "layers": c.get("num_hidden_layers", 1), "vocab": c.get("vocab_size", 0),
            "heads": c.get("num_attention_heads", 1),
            "kv_heads": c.get("num_key_value_heads") or c.get("num_attention_heads", 1),
            "head_dim": c.get("head_dim") or c.get("hidden_size", 0) // max(c.get("num_attention_heads", 1), 1)}


def gpu_total_bytes() -> int | None:
    """The smallest GPU's memory on this host, by nvidia-smi; None where it cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True).stdout
        return min(int(x) for x in out.split()) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def check_job(cfg, model_path: str, n_gpus: int, backend: str, total: int | None = None) -> list[str]:
    """The start-up check of a job on one host's GPUs; [] where nothing runs on CUDA or no size is known."""
    on_gpu = cfg.learner.on_cuda(n_gpus > 0) or cfg.actors.device.startswith("cuda")
    if not on_gpu or n_gpus < 1:
        return []
    total = total or gpu_total_bytes()
    if total is None:
        log.warning("GPU memory plan skipped: nvidia-smi gave no memory size")
        return []
    try:
        numel = model_numel(model_path)
    except ValueError as e:  # weights in another format: nothing to size them from without loading them
        log.warning("GPU memory plan skipped: %s", e)
        return []
    return check(plan(cfg, numel, model_dims(model_path), n_gpus, total, backend), total)
