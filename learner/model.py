"""Model build and FSDP2 wrapping for the learner group."""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from engines.logprobs import token_logprobs
from engines.lora import head_adapter
from learner.attention import register
from learner.batching import model_inputs


def _attention(name: str) -> str:
    """transformers' name for the attention implementation (ours registered first)."""
    if name == "varlen":
        register()
    return name


def load_policy(path: str, device: torch.device, attn_implementation: str = "sdpa", dtype: str = "float32"):
    """The causal LM at `path` with its weights in `dtype` (learner.master_dtype), on `device`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 attn_implementation=_attention(attn_implementation))
    return model.to(device)


def set_eos_logit_bias(model, model_path: str, bias: float) -> None:
    """actors.eos_logit_bias in the learner's logprobs: the engines add `bias` to the EOS token's logit
    before temperature, so `response_logprobs` does too (the tokenizer's EOS, as the engines take it)."""
    if not bias:
        return
    from transformers import AutoTokenizer

    model.get_output_embeddings()._lp_eos = (AutoTokenizer.from_pretrained(model_path).eos_token_id, float(bias))


def _eos_bias_vector(head, like: torch.Tensor, scale: float = 1.0):
    """The head's own bias plus `scale` x the EOS bias (set_eos_logit_bias) on the EOS entry, or the head's
    bias alone when none is set."""
    eos = getattr(head, "_lp_eos", None)
    if eos is None:
        return head.bias
    vec = torch.zeros(head.weight.shape[0], dtype=like.dtype, device=like.device)
    vec[eos[0]] = eos[1] * scale
    return vec if head.bias is None else head.bias + vec


def base_model(model):
    """The causal LM itself: `model`, or the one a PEFT model wraps (learner.lora; its adapter layers sit in it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model) -> list:
    """The causal LM's decoder layers (`model.model.layers`), of a PEFT-wrapped one too (whose own `model`
    attribute is the wrapped causal LM, not its decoder stack). [] for a model without them."""
    return list(getattr(getattr(base_model(model), "model", None), "layers", None) or [])


def random_policy(config, device: torch.device, attn_implementation: str = "sdpa"):
    """A randomly initialised causal LM of a transformers config (benchmarks: no checkpoint needed)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                attn_implementation=_attention(attn_implementation))


def wrap_policy(model, lc, device: torch.device, world: int):
    """The learner's wrapping of a policy: fused kernels (`learner.kernels`), then FSDP2 (`shard`), or with
    one rank and `learner.plain_one_rank` the plain module computing in `param_dtype` by autocast."""
    if lc.kernels != "none":
        apply_liger(model, layers=lc.kernels == "liger")
    if world == 1 and lc.plain_one_rank:
        return plain(model, param_dtype=lc.param_dtype, activation_checkpointing=lc.activation_checkpointing,
                     compile=lc.compile, compute=lc.plain_compute)
    return shard(model, device, param_dtype=lc.param_dtype, activation_checkpointing=lc.activation_checkpointing,
                 offload=lc.param_offload, compile=lc.compile)


def apply_liger(model, *, layers: bool = True) -> None:
    """liger-kernel's fused linear cross-entropy as the logprob head (`response_logprobs`) and, with
    `layers`, its Triton RMSNorm, SwiGLU and rotary embedding in place in the model's modules. GPU only."""
    if head_adapter(model.get_output_embeddings()):
        raise ValueError("learner.kernels=liger: its fused head reads the head's weight alone, which would leave "
                         "out the adapter learner.lora puts on it; use kernels=none or leave lm_head out of "
                         "learner.lora.target_modules")
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
    except ImportError as e:
        raise ImportError("learner.kernels=liger needs liger-kernel (pip install liger-kernel; GPU hosts)") from e
    if layers:
        _apply_liger_kernel_to_instance(model=base_model(model), rope=True, rms_norm=True, swiglu=True,
                                        cross_entropy=False, fused_linear_cross_entropy=False)
    model.get_output_embeddings()._lp_kernel = "liger"


def plain(model, *, param_dtype: str = "float32", activation_checkpointing: bool = False, compile: str = "off",
          compute: str = "autocast"):
    """One rank without FSDP: the module as it is (fp32 master weights), computing in `param_dtype` by
    autocast (bf16 matmuls, fp32 weights, gradients and optimizer) or on a `ShadowWeights` copy
    (`compute="shadow"`), each decoder layer compiled when asked. State dicts are plain fp32 tensors: DCP,
    weight publication and evaluation read them as FSDP's."""
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in decoder_layers(model):
        if compile != "off":
            layer.compile(backend=compile)
    if param_dtype != "float32" and compute == "shadow":
        model._shadow = ShadowWeights(model, getattr(torch, param_dtype))
    elif param_dtype != "float32":
        device_type = next(model.parameters()).device.type
        model.forward = torch.autocast(device_type, dtype=getattr(torch, param_dtype))(model.forward)
    return model


class ShadowWeights:
    """The plain module's weights in a lower dtype, for forward and backward without autocast (its per-op
    casts are host work on every step). The module keeps its fp32 parameters, which the optimizer steps
    and every state dict reads; at each step `refresh` copies them (as stepped, or as a checkpoint loaded
    them), `computing` swaps the copies in for forward and backward, `to_masters` hands their gradients to
    the fp32 parameters."""

    def __init__(self, model, dtype: torch.dtype):
        named = list(model.named_parameters())  # a tied output head appears once (tie_weights maps it)
        self.names = [n for n, _ in named]
        self.masters = [p for _, p in named]
        self.copies = [p.detach().to(dtype).requires_grad_(p.requires_grad) for p in self.masters]
        # the masters' fp32 gradients, allocated once and overwritten each step (a reused buffer: the
        # optimizer's zero_grad only drops the parameters' references to it)
        self.grads: list[torch.Tensor] | None = None

    @contextlib.contextmanager
    def computing(self, model):
        from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call uses

        with _reparametrize_module(model, dict(zip(self.names, self.copies)), tie_weights=True):
            yield

    def to_masters(self) -> None:
        """The copies' gradients, in fp32, as the parameters' (accumulated over the step's micro-batches).
        One multi-tensor copy for all of them, not a cast per tensor: on a GPU `_foreach_copy_` converts
        dtypes in a few fused kernels, and the per-tensor casts were host time on every step."""
        if self.grads is None:
            self.grads = [torch.empty_like(p) for p in self.masters]
        have = [i for i, c in enumerate(self.copies) if c.grad is not None]
        if not have:  # no backward this step (every micro-batch masked out)
            return
        with torch.no_grad():
            torch._foreach_copy_([self.grads[i] for i in have], [self.copies[i].grad for i in have])
        for i in have:
            self.masters[i].grad, self.copies[i].grad = self.grads[i], None

    def refresh(self) -> None:
        """The copies take the module's weights as they are now (one rounding each, one multi-tensor copy)."""
        with torch.no_grad():
            torch._foreach_copy_(self.copies, self.masters)


def shadow_of(model) -> "ShadowWeights | None":
    return getattr(model, "_shadow", None)


def load_critic(path: str, device: torch.device, attn_implementation: str = "sdpa"):
    """The value model: the policy's backbone plus a scalar head on every position.

    AutoModelForTokenClassification with num_labels=1 (as verl's critic): the decoder layers load
    from the causal-LM checkpoint, the LM head is dropped and the `score` head starts random (from
    the caller's seeded RNG: every rank must draw the same head, as FSDP shards each rank's local copy).
    """
    import logging

    from transformers import AutoConfig, AutoModelForTokenClassification

    # "newly initialized: score" is the point here, not a warning worth a line per rank
    logging.getLogger("transformers.modeling_utils").setLevel(logging.ERROR)
    # classifier_dropout=0 (as verl): dropout on the value head would make the learn-time values and the
    # values being trained differ by noise, and draw RNG that differs between rank counts
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32,
                                                            attn_implementation=_attention(attn_implementation))
    return model.to(device)


def shard(model, device: torch.device, *, param_dtype: str = "float32", activation_checkpointing: bool = False,
          offload: bool = False, compile: str = "off"):
    """fully_shard each decoder layer, then the root (embeddings, norm, head).

    Per-layer units bound peak memory to one gathered layer at a time; with one rank this is
    still FSDP (same code path as M ranks), which is what keeps 1-rank and M-rank steps equal.
    With `param_dtype=bfloat16`, layers compute in bf16 while the sharded master weights, the
    optimizer and the gradient reduce-scatter stay float32. With `offload`, the shards (and their
    gradients, hence the optimizer step and state) live in CPU memory (pinned on CUDA hosts) and
    each unit is copied to `device` only to compute. With `compile` (a torch.compile backend), each
    decoder layer's forward is compiled in place (module, names and state dict unchanged); FSDP2's
    hooks stay outside the compiled graphs, and the first steps pay the compilation.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # float32: no policy at all (the exact pre-mixed-precision path, bit for bit)
    kw = {} if param_dtype == "float32" else {
        "mp_policy": MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)}
    if offload:  # pinned host memory makes the per-layer copies asynchronous; it needs CUDA
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in decoder_layers(model):
        if compile != "off":
            layer.compile(backend=compile)
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Collective over the learner group: full CPU tensors on rank 0, {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gather_full(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Collective over the learner group: the full tensors of FSDP2-sharded parameters, on `device`.

    One all-gather for the whole list, not one per tensor: a publication bucket holds hundreds of
    tensors, and per-tensor collectives cost a round trip each (on 2 CPU ranks they made publishing
    the tiny model ~7x slower than on one). FSDP2 shards dim 0 as torch.chunk does (rank r holds rows
    [r*c, (r+1)*c), c = ceil(rows / world), the tail ranks fewer or none), so every rank pads its
    shards to c rows in one flat buffer and the gathered buffer is cut back into tensors. Entries
    that are not dim-0 shards of the first one's dtype and 1-D mesh take the per-tensor path (every
    rank decides alike: the state dicts are the same).
    """
    from torch.distributed.tensor import DTensor, Shard

    shards = [i for i, t in enumerate(tensors) if isinstance(t, DTensor) and t.device_mesh.ndim == 1
              and tuple(t.placements) == (Shard(0),) and t.ndim > 0]
    shards = [i for i in shards if tensors[i].device_mesh == tensors[shards[0]].device_mesh
              and tensors[i].dtype == tensors[shards[0]].dtype]
    batched = set(shards)
    out = [None if i in batched else _full(t, device) for i, t in enumerate(tensors)]
    if shards:
        for i, full in zip(shards, _gather_dim0([tensors[i] for i in shards], device)):
            out[i] = full
    return out


def _gather_dim0(tensors: list, device) -> list[torch.Tensor]:
    import math

    import torch.distributed as dist

    mesh, first = tensors[0].device_mesh, tensors[0]
    world, dev = mesh.size(), torch.device(mesh.device_type)
    if world == 1:  # the shard is the tensor
        return [t.to_local().detach().to(device) for t in tensors]
    rows = [t.shape[0] for t in tensors]
    row = [t.numel() // n if n else 0 for t, n in zip(tensors, rows)]     # elements per row
    per = [math.ceil(n / world) for n in rows]                             # rows a rank holds at most
    chunks = [p * e for p, e in zip(per, row)]
    send = torch.zeros(sum(chunks), dtype=first.dtype, device=dev)
    off = 0
    for t, c in zip(tensors, chunks):
        local = t.to_local().detach().reshape(-1)
        send[off:off + local.numel()].copy_(local)  # an offloaded CPU shard is copied to the mesh device
        off += c
    recv = torch.empty(world * send.numel(), dtype=send.dtype, device=dev)
    dist.all_gather_into_tensor(recv, send, group=mesh.get_group())
    recv = recv.view(world, -1)
    out, off = [], 0
    for t, n, e, p, c in zip(tensors, rows, row, per, chunks):
        # each rank's real rows (the tail ranks hold fewer or none), then its padding up to c
        pieces = [recv[r, off:off + max(0, min(p, n - r * p)) * e] for r in range(world)]
        out.append(torch.cat(pieces).view(t.shape).to(device))
        off += c
    return out


def _full(t: torch.Tensor, device) -> torch.Tensor:
    """The full tensor of a (possibly sharded) parameter on `device`; a collective for DTensors."""
    if hasattr(t, "full_tensor"):
        if t.device.type != t.device_mesh.device_type:  # CPU-offloaded shard: gather on the mesh's device
            t = t.to(t.device_mesh.device_type)
        t = t.full_tensor()
    return t.detach().to(device)


def optimizer_step(opt, model, *, optimizer_offload: bool, device) -> None:
    """opt.step() and zero_grad. With optimizer offload but not parameter offload, on a device host,
    the AdamW state visits `device` for the step only and goes back to host memory after it (with
    parameter offload the step runs on the host anyway)."""
    move_state = optimizer_offload and not is_offloaded(model) and torch.device(device).type != "cpu"
    if move_state:
        optimizer_state_to(opt, device)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if move_state:
        optimizer_state_to(opt, "cpu")


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


def _liger_logprobs(h: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, temperature: float,
                    chunk_tokens: int = 0):
    """log p(target) by liger's fused linear cross-entropy (per token, reduction none): the logits of
    (h / T) W^T are computed chunk by chunk inside the kernel and never kept.

    liger sizes its chunks so that one holds about as many logits as the input has elements (BT x H): for
    a small model with a large vocabulary that is BT / (V / H) tokens, e.g. 86 chunks of SmolLM2's 49k
    vocabulary over 576 hidden units, each a series of kernel launches from Python (16 ms of host time
    per step measured on the H200). Its `chunk_mem_const` widens the budget: chosen so that a chunk holds
    about `chunk_tokens` tokens (learner.logprob_chunk_tokens), the memory bound the plain head keeps."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    if weight.dtype != h.dtype:  # plain one-rank path: fp32 master weight, bf16 hidden states under autocast
        weight = weight.to(h.dtype)
    args = [h / temperature, weight, targets, bias, None, -100, 0.0, 0.0, "none"]
    if chunk_tokens and _liger_takes_chunk_mem_const():
        args += [None, False, None, False, False, False, None, None,
                 liger_chunk_mem_const(h.shape[0], h.shape[1], weight.shape[0], chunk_tokens)]
    return -LigerFusedLinearCrossEntropyFunction.apply(*args)[0]


def liger_chunk_mem_const(tokens: int, hidden: int, vocab: int, chunk_tokens: int) -> int:
    """liger's chunk_mem_const for chunks of about `chunk_tokens` tokens: it cuts `tokens` into
    ceil(vocab / (c * hidden)) chunks (rounded to a power of two in size): c rounded down, so at least
    as many chunks as asked for, none larger than `chunk_tokens` rounded up to a power of two."""
    want_chunks = max(1, -(-tokens // chunk_tokens))
    return max(1, vocab // (hidden * want_chunks))


@functools.cache
def _liger_takes_chunk_mem_const() -> bool:
    """liger-kernel >= 0.8 takes chunk_mem_const as the forward's last argument (checked once)."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    params = list(inspect.signature(LigerFusedLinearCrossEntropyFunction.forward).parameters)
    return params[-1] == "chunk_mem_const" and len(params) == 19


def _chunk_logprobs(h: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, temperature: float,
                    lora_a=None, lora_b=None, scale: float = 1.0):
    """log p(target) for a chunk of hidden states: its fp32 logits live only inside this call. With an adapter
    on the head (learner.lora: `lora_a`, `lora_b`, `scale`) its low-rank term is added to the chunk's logits, as
    PEFT's forward adds it (never a merged vocabulary-sized weight)."""
    f = torch.nn.functional
    logits = f.linear(h, weight, bias)
    if lora_a is not None:
        logits = logits + f.linear(f.linear(h, lora_a), lora_b) * scale
    return token_logprobs(logits, targets, temperature)


def _response_positions(hidden, mask, targets, index):
    """The hidden states and targets of the response positions of the shifted [B, L-1] grid. `index`: those
    positions, flattened, found on the host (collate's `resp_index`): selecting by index needs no host sync,
    selecting by the boolean mask does (a nonzero, waiting for the whole forward on a GPU)."""
    if index is None:
        return hidden[:, :-1][mask], targets[mask]
    rows, length = hidden.shape[0], hidden.shape[1]
    # grid position r * (L-1) + c is hidden position r * L + c
    h = hidden.reshape(rows * length, -1).index_select(0, index + index // (length - 1))
    return h, targets.reshape(-1).index_select(0, index)


def _logprob_head_forward(head, plain_forward):
    """A forward for a causal LM's output head that, while a request is set on the head, returns
    log p(target) on the shifted [B, L-1] grid instead of logits (see `response_logprobs`)."""
    from torch.utils.checkpoint import checkpoint

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        req = head._lp_request
        if req is None:
            return plain_forward(hidden)
        mask, targets, temperature, chunk, index = req
        h, t = _response_positions(hidden, mask, targets, index)  # no prompt, no padding
        if getattr(head, "_lp_kernel", None) == "liger":  # liger adds its bias after scaling h by 1 / T
            lp = _liger_logprobs(h, head.weight, _eos_bias_vector(head, h, 1 / temperature), t, temperature, chunk)
        else:
            bias, adapter = _eos_bias_vector(head, h), head_adapter(head)
            # at least one (maybe empty) chunk: a micro-batch without response tokens still gives the head and
            # the body a (zero) gradient, as every rank's FSDP reduce-scatter needs; no RNG is drawn in a chunk
            lp = torch.cat([checkpoint(_chunk_logprobs, h[i:i + chunk], head.weight, bias, t[i:i + chunk],
                                       temperature, *adapter, use_reentrant=False, preserve_rng_state=False)
                            for i in range(0, max(h.shape[0], 1), chunk)])
        if index is None:
            return torch.zeros(mask.shape, dtype=lp.dtype, device=lp.device).masked_scatter(mask, lp)
        return torch.zeros(mask.numel(), dtype=lp.dtype, device=lp.device).index_copy(0, index, lp).view(mask.shape)

    return forward


def response_logprobs(model, b: dict, temperature: float, chunk_tokens: int) -> torch.Tensor:
    """log p(target) under the model on the shifted `[B, L-1]` grid of a collated batch
    (`learner.batching.collate`); zero off `b["mask"]` when chunked.

    `chunk_tokens > 0`: the output head runs inside the model's own forward, so FSDP's root hooks
    gather its weight and reduce its gradient as for any forward, but only on the response tokens
    (never on prompt or padding positions), `chunk_tokens` at a time, each chunk's fp32 logits
    recomputed in backward instead of kept: the head's memory is one chunk of full-vocabulary
    logits, not the batch's [B, L, V] in fp32, and its FLOPs follow the response tokens.
    `chunk_tokens = 0`: the model's plain logits over every position (the reference path; also
    any model whose forward does more after its head than `lm_head(hidden)`).
    """

    head = model.get_output_embeddings()
    if chunk_tokens <= 0:
        logits = model(**model_inputs(b)).logits[:, :-1]
        if (eos := getattr(head, "_lp_eos", None)) is not None:
            logits = logits.clone()
            logits[..., eos[0]] += eos[1]
        return token_logprobs(logits, b["targets"], temperature)
    if not hasattr(head, "_lp_request"):  # installed once per model; the module itself stays (FSDP knows it)
        head._lp_request = None
        head.forward = _logprob_head_forward(head, head.forward)
    head._lp_request = (b["mask"].bool(), b["targets"], temperature, chunk_tokens, b.get("resp_index"))
    try:
        return model(**model_inputs(b)).logits
    finally:
        head._lp_request = None
