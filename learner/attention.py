"""`attn_implementation: varlen`: packed micro-batches attended row by row, without a mask.

A packed micro-batch (learner/batching.py collate with `packed`) lays its rows back to back in one
sequence; `collate` also gives the rows' boundaries (`cu_seq_lens`, `max_length`). transformers
passes those keywords through the model to the attention function registered here, which calls
torch's own variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`, CUDA): only
each row's causal block is computed, nothing is padded and no [L, L] mask exists. transformers
builds no mask for an implementation it does not know, so registering the name is all it takes.

On CPU (no varlen kernel) the same function runs torch's SDPA row by row: slower, the same numbers
as the padded layout, so the CPU tests check the plumbing the GPU runs.
"""
from __future__ import annotations

import inspect

import torch

NAME = "varlen"
KWARGS = ("cu_seq_lens", "max_length")   # collate's keys, passed to the model for this implementation


def register() -> None:
    """Make `attn_implementation="varlen"` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention_forward)


def varlen_attention_forward(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                             cu_seq_lens=None, max_length=None, **_):
    """transformers' attention-function contract: q/k/v [1, heads, L, D] -> ([1, L, heads, D], None)."""
    if cu_seq_lens is None:
        raise ValueError("attn_implementation=varlen needs packed micro-batches (learner.pack_sequences=true): "
                         "the model was called without the rows' boundaries")
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention takes one packed sequence, got a batch of {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))   # [L, heads, D]
    if query.is_cuda:
        out = _cuda_varlen(q, k, v, cu_seq_lens.to(torch.int32), int(max_length), scaling)
    else:
        out = _rowwise_sdpa(q, k, v, cu_seq_lens, scaling)
    return out.unsqueeze(0), None


def _repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _varlen_kernel():
    """torch's varlen_attn and how this torch spells a causal, grouped-query call: torch 2.10 spells
    causality is_causal, later releases a window of (-1, 0); with enable_gqa the kernel reads the
    shared key/value heads itself. None: this torch has no varlen kernel."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = ("window_size", (-1, 0)) if "window_size" in params else ("is_causal", True)
    return varlen_attn, causal, "enable_gqa" in params


# read once at import: inspecting a signature inside a compiled layer (learner.compile) would break its graph
VARLEN_KERNEL = _varlen_kernel()


def _cuda_varlen(q, k, v, cu, max_len: int, scale):
    if VARLEN_KERNEL is None:
        raise RuntimeError(f"attn_implementation=varlen needs torch.nn.attention.varlen (torch >= 2.10); "
                           f"this is torch {torch.__version__}")
    varlen_attn, causal, gqa = VARLEN_KERNEL
    # flash attention takes bf16/fp16 only; under autocast transformers' own rotary embedding (every path but
    # liger's) multiplies the bf16 q and k by fp32 cos/sin, promoting them: back to v's (the autocast) dtype
    q, k = q.to(v.dtype), k.to(v.dtype)
    kw = {"scale": scale, causal[0]: causal[1]}
    if gqa:
        kw["enable_gqa"] = True
    else:
        k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def _rowwise_sdpa(q, k, v, cu, scale):
    """The CPU form: causal SDPA on each row's slice (exactly the padded layout's attention)."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    bounds = cu.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))   # [heads, n, D]
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
                    .transpose(0, 1))
    return torch.cat(outs)
