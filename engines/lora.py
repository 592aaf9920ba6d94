"""LoRA adapters (PEFT) as the learner trains them and the engines serve them: one way to put an adapter on a
causal LM, one naming of its tensors, one strict load.

`lora` below is the job's `learner.lora` (learner/config.py LoraConfig: rank, alpha, dropout, target_modules),
read by attribute: this package sits below the learner's. A version of a LoRA policy is its adapter alone (the
base stays frozen): the learner publishes these tensors, named as PEFT's adapter files name them
(`base_model.model.<module>.lora_A.weight`, what `save_pretrained` writes and other servers load), and an
engine's checksum is that of the adapter as published (vLLM's copy holds it with LoRA's scale folded into B).
"""
from __future__ import annotations

import weakref

# The adapter's A matrices are drawn at random (B starts at zero, so version 0 is the base model's output). One
# fixed seed makes every learner rank draw the same A (FSDP2 shards each rank's own copy, so they must agree) and
# every engine start from the very adapter the learner starts from: version 0 has one checksum everywhere.
LORA_INIT_SEED = 0
# PEFT's own init of a linear layer's A (nn.Linear's kaiming-uniform, a = sqrt(5)): the bound the draws keep
KAIMING_A = 5 ** 0.5


def enabled(lora) -> bool:
    """Whether a LoRA configuration asks for an adapter (rank 0 is off)."""
    return lora is not None and lora.rank > 0


def peft_config(lora):
    """PEFT's LoraConfig of the job's LoRA settings (what the learner trains and the adapter files record)."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=lora.target_modules, task_type="CAUSAL_LM")


def apply_lora(model, lora):
    """`model` wrapped by PEFT's get_peft_model with the job's LoRA settings: only the adapter requires grad, the
    base is frozen. The adapter is held in the base model's dtype (no fp32 upcast of a bf16 model's adapter), so
    an engine holds what travels in its dtype and the learner what its master_dtype says."""
    import torch  # lazy, as PEFT below: engines/backends.py reads `enabled` without loading torch
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):  # PEFT's own draws (overwritten below) leave the caller's RNG be
        peft = get_peft_model(model, peft_config(lora), autocast_adapter_dtype=False)
    own = adapter_state_dict(peft)   # views of the parameters: copying into them sets the adapter
    with torch.no_grad():
        for name, t in initial_tensors({k: (tuple(v.shape), v.dtype) for k, v in own.items()}).items():
            own[name].copy_(t)
    if head_adapter(peft.get_output_embeddings()) and lora.dropout:
        # the learner's logprob head recomputes its chunks in backward without drawing RNG (learner/model.py
        # response_logprobs), so it adds the head's adapter term without dropout: a dropout there would differ
        raise ValueError("learner.lora.dropout must be 0 with an adapter on the output head (lm_head in "
                         "learner.lora.target_modules)")
    return peft


def initial_tensors(shapes: dict) -> dict:
    """Version 0's adapter tensors from their names alone ({PEFT name: (shape, dtype)}): each A drawn as PEFT draws
    it (kaiming-uniform; an embedding's A zeros and its B normal) from a generator seeded by (LORA_INIT_SEED, name),
    each linear B zeros. A pure function of the names and shapes: an engine builds the learner's version 0 without
    the base model's weights, and no draw depends on the order or number of the tensors before it."""
    import zlib

    import torch

    out = {}
    for name, (shape, dtype) in shapes.items():
        gen = torch.Generator().manual_seed(LORA_INIT_SEED << 32 | zlib.crc32(name.encode()))
        t = torch.zeros(shape, dtype=torch.float32)   # drawn in float32: every dtype holds the same draw, rounded
        if name.endswith("lora_A.weight"):
            torch.nn.init.kaiming_uniform_(t, a=KAIMING_A, generator=gen)
        elif name.endswith("lora_embedding_B"):
            torch.nn.init.normal_(t, generator=gen)
        elif not name.endswith(("lora_B.weight", "lora_embedding_A")):
            raise ValueError(f"no initial value for adapter tensor {name!r} (neither a LoRA A nor B)")
        out[name] = t.to(dtype)
    return out


def initial_adapter(model_path: str, lora, dtype: str) -> dict:
    """The adapter `apply_lora` puts on the model at `model_path` in `dtype` (version 0), built from the model's
    configuration alone: PEFT wraps a skeleton on the meta device (no weights read or allocated), which names and
    shapes the adapter's tensors; `initial_tensors` fills them on the CPU."""
    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        peft = get_peft_model(skeleton, peft_config(lora), autocast_adapter_dtype=False)
    # in `dtype`, as apply_lora holds the adapter in the dtype of the base model it wraps
    held = getattr(torch, dtype)
    return initial_tensors({k: (tuple(v.shape), held) for k, v in adapter_state_dict(peft).items()})


def head_adapter(head) -> tuple:
    """(A, B, scale) of the adapter on a PEFT-wrapped output head, whose logits are then base + scale x B A h;
    () for a head without one (`all-linear` leaves the head out)."""
    if not hasattr(head, "lora_A"):
        return ()
    name = head.active_adapters[0]   # one adapter per model here (`default`)
    return head.lora_A[name].weight, head.lora_B[name].weight, head.scaling[name]


def is_lora(model) -> bool:
    """Whether `model` is a PEFT model (its versions are its adapter)."""
    return hasattr(model, "peft_config")


def adapter_state_dict(model, state_dict: dict | None = None) -> dict:
    """The adapter's tensors of the PEFT `model`, named as in PEFT's adapter files; from `state_dict` (the
    model's own, e.g. sharded DTensors or full tensors already gathered) when given. The tensors are the
    state dict's own (views of the parameters when read from the model), not copies."""
    from peft import get_peft_model_state_dict  # lazy: only a LoRA job loads PEFT (and torch)

    # save_embedding_layers=False: `auto` may look the base model up on the Hub to compare vocabularies
    return get_peft_model_state_dict(model, state_dict=state_dict, save_embedding_layers=False)


# model -> {PEFT's adapter name: the model's own key}: the adapter's names never change over a run, and PEFT's
# filter over every key of the state dict cost 22-25 ms a version for SmolLM2 (693 keys, 420 of them the
# adapter's, on a loaded 2-core machine): most of what publishing a 19.5 MB adapter took
_ADAPTER_KEYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def published_state(model, state_dict: dict | None = None) -> dict:
    """What a version of `model` is: for a PEFT model the adapter alone (from `state_dict`, else the model's own
    parameters, views not copies), named as PEFT's files name it; else every tensor of `state_dict` (else the
    model's state dict). The adapter's names are worked out by PEFT once per model, then looked up."""
    if not is_lora(model):
        return model.state_dict() if state_dict is None else state_dict
    sd = {k: p.detach() for k, p in model.named_parameters()} if state_dict is None else state_dict
    keys = _ADAPTER_KEYS.get(model)
    if keys is not None and all(k in sd for k in keys.values()):
        return {name: sd[key] for name, key in keys.items()}
    adapter = adapter_state_dict(model, sd)
    by_id = {id(t): k for k, t in sd.items()}
    if all(id(t) in by_id for t in adapter.values()):   # PEFT handed the state dict's own tensors: a renaming
        _ADAPTER_KEYS[model] = {name: by_id[id(t)] for name, t in adapter.items()}
    return adapter


def check_adapter(shapes: dict, state_dict: dict) -> None:
    """Refuse an adapter that is not exactly the one of `shapes` ({PEFT name: shape}): every tensor, of its shape,
    and nothing else (a base weight or another adapter's tensor is refused, not ignored)."""
    missing, extra = sorted(shapes.keys() - state_dict.keys()), sorted(state_dict.keys() - shapes.keys())
    if missing or extra:
        raise ValueError(f"adapter tensors missing: {missing[:3]} ({len(missing)}), not the adapter's: "
                         f"{extra[:3]} ({len(extra)})")
    wrong = [k for k, t in state_dict.items() if tuple(t.shape) != tuple(shapes[k])]
    if wrong:
        raise ValueError(f"adapter tensors of other shapes than the model's: {wrong[:3]}")


def load_adapter(model, state_dict: dict) -> None:
    """Copy an adapter (PEFT's names) into the PEFT `model`'s own, strictly (check_adapter)."""
    import torch  # lazy: see apply_lora

    own = adapter_state_dict(model)
    check_adapter({k: t.shape for k, t in own.items()}, state_dict)
    with torch.no_grad():
        for k, t in state_dict.items():
            own[k].copy_(t)  # `own` views the parameters: this is the load
