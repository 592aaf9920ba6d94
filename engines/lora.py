"""LoRA adapters (PEFT) as the learner trains them and the engines serve them: one way to put an adapter on a
causal LM, one naming of its tensors, one strict load.

`lora` below is the job's `learner.lora` (learner/config.py LoraConfig: rank, alpha, dropout, target_modules),
read by attribute: this package sits below the learner's. A version of a LoRA policy is its adapter alone (the
base stays frozen): the learner publishes these tensors, named as PEFT's adapter files name them
(`base_model.model.<module>.lora_A.weight`, what `save_pretrained` writes and other servers load), and an
engine's checksum is that of the adapter it holds.
"""
from __future__ import annotations

# The adapter's A matrices are drawn at random (B starts at zero, so version 0 is the base model's output). One
# fixed seed makes every learner rank draw the same A (FSDP2 shards each rank's own copy, so they must agree) and
# every engine start from the very adapter the learner starts from: version 0 has one checksum everywhere.
LORA_INIT_SEED = 0


def enabled(lora) -> bool:
    """Whether a LoRA configuration asks for an adapter (rank 0 is off)."""
    return lora is not None and lora.rank > 0


def apply_lora(model, lora):
    """`model` wrapped by PEFT's get_peft_model with the job's LoRA settings: only the adapter requires grad, the
    base is frozen. The adapter is held in the base model's dtype (no fp32 upcast of a bf16 model's adapter), so
    an engine holds what travels in its dtype and the learner what its master_dtype says."""
    import torch  # lazy, as PEFT below: engines/backends.py reads `enabled` without loading torch
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                     target_modules=lora.target_modules, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays where it was
        torch.manual_seed(LORA_INIT_SEED)
        peft = get_peft_model(model, cfg, autocast_adapter_dtype=False)
    if head_adapter(peft.get_output_embeddings()) and lora.dropout:
        # the learner's logprob head recomputes its chunks in backward without drawing RNG (learner/model.py
        # response_logprobs), so it adds the head's adapter term without dropout: a dropout there would differ
        raise ValueError("learner.lora.dropout must be 0 with an adapter on the output head (lm_head in "
                         "learner.lora.target_modules)")
    return peft


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


def published_state(model, state_dict: dict) -> dict:
    """What a version of `model` is, from its state dict: the adapter alone for a PEFT model, else every tensor."""
    return adapter_state_dict(model, state_dict) if is_lora(model) else state_dict


def load_adapter(model, state_dict: dict) -> None:
    """Copy an adapter (PEFT's names) into the PEFT `model`'s own, strictly: every adapter tensor of the model,
    of its shape, and nothing else (a base weight or another adapter's tensor is refused, not ignored)."""
    import torch  # lazy: see apply_lora

    own = adapter_state_dict(model)
    missing, extra = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
    if missing or extra:
        raise ValueError(f"adapter tensors missing: {missing[:3]} ({len(missing)}), not the adapter's: "
                         f"{extra[:3]} ({len(extra)})")
    shapes = [k for k, t in state_dict.items() if tuple(t.shape) != tuple(own[k].shape)]
    if shapes:
        raise ValueError(f"adapter tensors of other shapes than the model's: {shapes[:3]}")
    with torch.no_grad():
        for k, t in state_dict.items():
            own[k].copy_(t)  # `own` views the parameters: this is the load
