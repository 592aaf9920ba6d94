"""Model build and FSDP2 wrapping for the learner group."""
from __future__ import annotations

import torch


def load_policy(path: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device)


def shard(model, device: torch.device, *, param_dtype: str = "float32", activation_checkpointing: bool = False):
    """fully_shard each decoder layer, then the root (embeddings, norm, head).

    Per-layer units bound peak memory to one gathered layer at a time; with one rank this is
    still FSDP (same code path as M ranks), which is what keeps 1-rank and M-rank steps equal.
    With `param_dtype=bfloat16`, layers compute in bf16 while the sharded master weights, the
    optimizer and the gradient reduce-scatter stay float32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # float32: no policy at all (the exact pre-mixed-precision path, bit for bit)
    kw = {} if param_dtype == "float32" else {
        "mp_policy": MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)}
    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers or []:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Collective over the learner group: full CPU tensors on rank 0, {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
