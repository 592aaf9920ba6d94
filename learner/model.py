"""Model build and FSDP2 wrapping for the learner group."""
from __future__ import annotations

import torch


def load_policy(path: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device)


def load_critic(path: str, device: torch.device):
    """The value model: the policy's backbone plus a scalar head on every position.

    AutoModelForTokenClassification with num_labels=1 (as verl's critic): the decoder layers load
    from the causal-LM checkpoint, the LM head is dropped and the `score` head starts random (from
    the caller's seeded RNG: every rank must draw the same head, as FSDP shards each rank's local copy).
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    import logging

    # "newly initialized: score" is the point here, not a warning worth a line per rank
    logging.getLogger("transformers.modeling_utils").setLevel(logging.ERROR)
    # classifier_dropout=0 (as verl): dropout on the value head would make the learn-time values and the
    # values being trained differ by noise, and draw RNG that differs between rank counts
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)
    return model.to(device)


def shard(model, device: torch.device, *, param_dtype: str = "float32", activation_checkpointing: bool = False,
          offload: bool = False):
    """fully_shard each decoder layer, then the root (embeddings, norm, head).

    Per-layer units bound peak memory to one gathered layer at a time; with one rank this is
    still FSDP (same code path as M ranks), which is what keeps 1-rank and M-rank steps equal.
    With `param_dtype=bfloat16`, layers compute in bf16 while the sharded master weights, the
    optimizer and the gradient reduce-scatter stay float32. With `offload`, the shards (and their
    gradients, hence the optimizer step and state) live in CPU memory (pinned on CUDA hosts) and
    each unit is copied to `device` only to compute.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # float32: no policy at all (the exact pre-mixed-precision path, bit for bit)
    kw = {} if param_dtype == "float32" else {
        "mp_policy": MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)}
    if offload:  # pinned host memory makes the per-layer copies asynchronous; it needs CUDA
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers or []:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Collective over the learner group: full CPU tensors on rank 0, {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_offloaded(model) -> bool:
    """Whether `shard(..., offload=True)` put this model's shards in CPU memory on a device host."""
    p = next(model.parameters())
    mesh = getattr(p, "device_mesh", None)
    return mesh is not None and p.device.type != mesh.device_type


def clip_grad_norm(model, max_norm: float, group=None) -> float:
    """Global grad-norm clipping; returns the norm before clipping.

    The FSDP2 path is torch's `clip_grad_norm_` on DTensors. With CPU-offloaded shards that path
    all-reduces a CPU scalar over the NCCL group and fails (pytorch#148532), so there the squared
    norms of the local shards are summed on CPU and all-reduced over `group` (a gloo group on CUDA
    hosts): every FSDP2 parameter is sharded (no replicas), so the sum over ranks is the total.
    """
    import math

    import torch.distributed as dist

    if not is_offloaded(model):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
             for p in model.parameters() if p.grad is not None]
    sq = torch.stack([g.detach().double().square().sum() for g in grads]).sum().reshape(1) if grads \
        else torch.zeros(1, dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norm = float(sq.sqrt())
    coef = (max_norm or math.inf) / (norm + 1e-6)  # torch's clip_grad_norm_ epsilon
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return norm


def optimizer_state_to(opt, device) -> None:
    """Move AdamW's per-parameter state tensors (exp_avg, exp_avg_sq) to `device` (optimizer offload).

    The scalar `step` stays where AdamW keeps it. DTensor states keep their placement; only the local
    shard moves.
    """
    for state in opt.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and k != "step" and v.device != torch.device(device):
                state[k] = v.to(device)  # blocking: the state is read right after
