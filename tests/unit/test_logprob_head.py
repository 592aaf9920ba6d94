"""learner/model.py response_logprobs: the chunked head on response tokens only equals the plain
logits path, values and gradients, with untied and tied output embeddings, and with a LoRA adapter on the head."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.batching import collate, length_bound
from learner.model import response_logprobs

pytestmark = pytest.mark.unit


def _model(tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from data.tiny_model import ARCH

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**ARCH, tie_word_embeddings=tied)).float()


def _lora_head_model():
    """learner.lora with the output head among its modules, its adapter trained-looking (B non-zero: B starts at
    zero, which would hide a head path that left the adapter out)."""
    from engines.lora import apply_lora, head_adapter
    from learner.config import LoraConfig

    model = apply_lora(_model(False), LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj", "lm_head"]))
    _a, b, _scale = head_adapter(model.get_output_embeddings())
    with torch.no_grad():
        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(2)))
    return model


def make_rows(n: int, seed: int = 0):
    import numpy as np

    from learner.batching import Row

    rng = np.random.default_rng(seed)
    return [Row(prompt_ids=rng.integers(0, 250, int(rng.integers(3, 9))).astype(np.int32),
                response_ids=(resp := rng.integers(0, 250, int(rng.integers(1, 7))).astype(np.int32)),
                behavior_logprobs=(-rng.random(len(resp)) * 3).astype(np.float32), advantage=float(rng.normal()),
                reward=0.0, staleness=0, group_id=f"g{i}") for i in range(n)]


def _loss_and_grads(model, b, chunk: int, weights: torch.Tensor):
    model.zero_grad(set_to_none=True)
    lp = response_logprobs(model, b, 0.7, chunk)
    ((lp * b["mask"] * weights).sum()).backward()
    return (lp * b["mask"]).detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("tied", [False, True, "lora_head"])
def test_chunked_head_equals_plain_logits(tied):
    model = _lora_head_model() if tied == "lora_head" else _model(tied)
    b = collate(make_rows(6, seed=3), pad_id=0)
    weights = torch.randn(b["mask"].shape, generator=torch.Generator().manual_seed(1))
    ref_lp, ref_g = _loss_and_grads(model, b, 0, weights)
    assert b["mask"].sum() > 10 and (b["mask"] == 0).any()  # prompts and padding are there to be skipped
    for chunk in (1, 7, 2048):  # one token per chunk, chunks that cut rows, everything in one chunk
        lp, g = _loss_and_grads(model, b, chunk, weights)
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-6)
        assert lp[b["mask"] == 0].abs().max() == 0
        for n in ref_g:   # chunks sum a gradient in another order: float32 rounding on the scale of its largest entry
            scale = ref_g[n].abs().max().item()
            torch.testing.assert_close(g[n], ref_g[n], rtol=1e-4, atol=1e-6 * max(1.0, scale), msg=n)
    # the head is back to plain logits outside a request (generation, evaluation, export)
    out = model(input_ids=b["input_ids"][:, :4]).logits
    assert out.shape == (b["input_ids"].shape[0], 4, model.config.vocab_size)


@pytest.mark.parametrize("select", ["index", "mask"])
def test_no_response_token_gives_zeros(select):
    """Both ways to find the response positions (collate's host-side `resp_index`, or the mask on the device)."""
    model = _model(False)
    b = collate(make_rows(2), pad_id=0)
    b["mask"] = torch.zeros_like(b["mask"])
    if select == "index":
        b["resp_index"] = b["mask"].reshape(-1).nonzero().squeeze(1)
    else:
        del b["resp_index"]
    lp = response_logprobs(model, b, 1.0, 4)
    assert lp.abs().sum() == 0
    (lp * b["mask"]).sum().backward()  # empty responses are valid: the step still gets (zero) gradients
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in model.parameters())


@pytest.mark.parametrize("chunk", [0, 5])
def test_packed_rows_give_what_padded_rows_give(chunk):
    """learner.pack_sequences: rows back to back, positions restarting, no attention across rows:
    the same logprobs, losses (both normalisations) and gradients as the right-padded batch."""
    from learner.batching import from_shifted
    from learner.losses import normalize

    model = _model(False)
    rows = make_rows(5, seed=4)
    total = float(sum(len(r.response_ids) for r in rows))
    out = {}
    for layout in ("padded", "packed", "packed to a multiple of 16"):
        packed = layout != "padded"
        b = collate(rows, pad_id=0, packed=packed, pack_multiple=16 if layout.endswith("16") else 0)
        assert ("position_ids" in b) == packed and ("attention_mask" in b) != packed
        model.zero_grad(set_to_none=True)
        lp = response_logprobs(model, b, 1.0, chunk)
        adv = b["advantages"] if packed else b["advantages"][:, None]
        terms = -lp * adv * b["mask"]
        losses = [normalize(terms, b["mask"], m, total_tokens=total, total_seqs=len(rows), seq_weight=b["seq_weight"])
                  for m in ("token_mean", "seq_mean_token_mean")]
        sum(losses).backward()
        out[layout] = ([t.detach() for t in from_shifted(lp, rows)], [x.item() for x in losses],
                       {n: p.grad.clone() for n, p in model.named_parameters()})
    real = sum(r.num_tokens for r in rows)
    assert collate(rows, pad_id=0, packed=True)["input_ids"].shape == (1, real)
    # the filler: up to the next multiple, its own positions from 0, off every mask
    b = collate(rows, pad_id=0, packed=True, pack_multiple=16)
    length = -(-real // 16) * 16
    assert b["input_ids"].shape == (1, length) and length > real
    assert b["position_ids"][0, real:].tolist() == list(range(length - real))
    assert b["mask"][0, real - 1:].sum() == 0 and b["seq_weight"][0, real - 1:].sum() == 0
    assert collate(rows, pad_id=0, packed=True, pack_multiple=real)["input_ids"].shape == (1, real)  # no filler needed
    # the rows' boundaries, and a bound on the longest (a power of two: few values for a compiled layer)
    b = collate(rows, pad_id=0, packed=True)
    assert b["cu_seq_lens"].tolist() == np.cumsum([0] + [r.num_tokens for r in rows]).tolist()
    longest = max(r.num_tokens for r in rows)
    assert b["max_length"] >= longest and b["max_length"] < 2 * max(longest, 64)
    assert [length_bound(n) for n in (1, 64, 65, 128, 129, 1000)] == [64, 64, 128, 128, 256, 1024]
    for other in ("packed", "packed to a multiple of 16"):
        for a, b_ in zip(out["padded"][0], out[other][0]):
            torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)
        assert out["padded"][1] == pytest.approx(out[other][1], rel=1e-5)
    # the padded seq-mean through seq_weight equals the per-row formula
    b = collate(rows, pad_id=0)
    terms = torch.rand(b["mask"].shape) * b["mask"]
    assert normalize(terms, b["mask"], "seq_mean_token_mean", total_tokens=total, total_seqs=5,
                     seq_weight=b["seq_weight"]).item() == pytest.approx(
        normalize(terms, b["mask"], "seq_mean_token_mean", total_tokens=total, total_seqs=5).item(), rel=1e-6)
    for n, g in out["padded"][2].items():
        for other in ("packed", "packed to a multiple of 16"):
            torch.testing.assert_close(out[other][2][n], g, rtol=1e-4, atol=1e-5, msg=(other, n))


@pytest.mark.parametrize("tokens,hidden,vocab,chunk", [(8000, 576, 49152, 2048), (20000, 576, 49152, 2048),
                                                       (100, 576, 49152, 2048), (65536, 1536, 151936, 4096),
                                                       (3000, 4096, 32000, 8192)])
def test_liger_chunk_mem_const_gives_chunks_of_about_the_asked_tokens(tokens, hidden, vocab, chunk):
    """liger's own chunking (fused_linear_cross_entropy_forward, 0.8.5) with our chunk_mem_const: chunks of
    at most the next power of two above `chunk` tokens, and no more chunks than asked for plus rounding."""
    from learner.model import liger_chunk_mem_const

    def next_pow2(x):
        return 1 << (x - 1).bit_length()

    c = liger_chunk_mem_const(tokens, hidden, vocab, chunk)
    inc_factor = -(-vocab // (c * hidden))
    size = min(next_pow2(-(-tokens // inc_factor)), tokens)
    assert size <= next_pow2(chunk)
    assert -(-tokens // size) <= max(1, -(-tokens // chunk)) * 2  # power-of-two rounding at most doubles them
    default = min(next_pow2(-(-tokens // -(-vocab // hidden))), tokens)  # liger's own (chunk_mem_const=1)
    assert size >= default


def test_varlen_kernel_gets_q_and_k_in_the_dtype_of_v(monkeypatch):
    """Under autocast transformers' rotary embedding promotes the bf16 q and k to fp32 (fp32 cos/sin), and
    flash attention refuses fp32 (seen on the H200 with learner.kernels=liger_head): the CUDA path hands the
    kernel all three in v's dtype. The kernel itself is CUDA only; here a stand-in records what it got."""
    from learner import attention

    seen = {}

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        seen.update(q=q.dtype, k=k.dtype, v=v.dtype, kw=kw)
        return q

    monkeypatch.setattr(attention, "VARLEN_KERNEL", (kernel, ("is_causal", True), True))
    q, k = torch.zeros(5, 4, 8), torch.zeros(5, 2, 8)
    v = torch.zeros(5, 2, 8, dtype=torch.bfloat16)
    out = attention._cuda_varlen(q, k, v, torch.tensor([0, 2, 5], dtype=torch.int32), 4, 0.125)
    assert seen["q"] == seen["k"] == seen["v"] == torch.bfloat16 and out.dtype == torch.bfloat16
    assert seen["kw"] == {"scale": 0.125, "is_causal": True, "enable_gqa": True}


@pytest.mark.parametrize("packed", [False, True])
def test_response_positions_by_index_equal_those_by_mask(packed):
    """The output head selects response positions by collate's `resp_index` (no host sync on a GPU): the same
    logprobs and gradients, bit for bit, as selecting them by the boolean mask."""
    rows = make_rows(5, seed=7)
    out = []
    for select in ("index", "mask"):
        torch.manual_seed(0)
        model = _model(True)
        b = collate(rows, pad_id=0, packed=packed)
        if select == "mask":
            del b["resp_index"]
        lp = response_logprobs(model, b, 0.7, 4)
        (lp * b["mask"] * torch.linspace(-1, 1, lp.shape[-1])).sum().backward()
        out.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp_i, g_i), (lp_m, g_m) = out
    assert torch.equal(lp_i, lp_m) and lp_i.abs().sum() > 0
    assert all(torch.equal(a, b) for a, b in zip(g_i, g_m))


@pytest.mark.parametrize("chunk", [0, 3], ids=["plain", "chunked"])
def test_an_eos_logit_bias_is_in_the_logprobs_as_the_engines_sample_it(chunk):
    """actors.eos_logit_bias: log p = log_softmax((logits + b on EOS) / T), checked against NumPy from the
    model's own logits, on both head paths; without it the EOS tokens' logprobs would differ by ~b / T."""
    model = _model(tied=False)
    eos, bias, temp = 5, 3.0, 0.7
    rows = make_rows(6)
    for r in rows:  # an EOS at the end of each answer, as the engines write it
        r.response_ids[-1] = eos
    b = collate(rows, pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1].double().numpy()
    z = logits.copy()
    z[..., eos] += bias
    z /= temp
    want = z - z.max(-1, keepdims=True)
    want = want - np.log(np.exp(want).sum(-1, keepdims=True))
    want = np.take_along_axis(want, b["targets"].numpy()[..., None], -1)[..., 0] * b["mask"].numpy()
    model.get_output_embeddings()._lp_eos = (eos, bias)  # what set_eos_logit_bias installs
    with torch.no_grad():
        got = (response_logprobs(model, b, temp, chunk) * b["mask"]).double().numpy()
    np.testing.assert_allclose(got, want, atol=2e-5)
    at_eos = (b["targets"].numpy() == eos) & (b["mask"].numpy() > 0)
    assert at_eos.sum() >= len(rows)
    del model.get_output_embeddings()._lp_eos
    with torch.no_grad():
        plain = (response_logprobs(model, b, temp, chunk) * b["mask"]).double().numpy()
    assert np.all(got[at_eos] - plain[at_eos] > 0.5 * bias / temp)
