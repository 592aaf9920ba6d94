"""engines/vllm_lora.py write_safetensors: an adapter's tensors written as the safetensors file vLLM's LoRA loader
reads, from one host buffer, read back by safetensors itself (the library vLLM reads it with) bit for bit."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from engines.vllm_lora import safetensors_layout, scaled, write_safetensors

pytestmark = pytest.mark.unit


def adapter(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(8, 48, generator=g).bfloat16(),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(48, 8, generator=g).bfloat16(),
        # a transposed view (not contiguous) and another dtype: written as their values, in their own dtype
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.randn(96, 8, generator=g).t(),
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": torch.randn(96, 8, generator=g).half(),
    }


def test_the_file_reads_back_as_the_tensors_bit_for_bit(tmp_path):
    sd = adapter()
    write_safetensors(str(tmp_path / "a.safetensors"), sd)
    back = load_file(str(tmp_path / "a.safetensors"))
    assert set(back) == set(sd)
    for name, t in sd.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name


def test_the_header_is_aligned_and_spans_are_end_to_end_each_aligned_to_its_element():
    sd = {**adapter(), "odd.lora_A.weight": torch.ones(3, dtype=torch.bfloat16)}   # 6 bytes: would misalign a float32
    head, spans = safetensors_layout(sd)
    (n,) = struct.unpack("<Q", head[:8])
    assert n == len(head) - 8 and n % 8 == 0
    header = json.loads(head[8:])
    assert header.pop("__metadata__") == {"format": "pt"}
    offsets = sorted(v["data_offsets"] for v in header.values())
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1][1] == sum(t.numel() * t.element_size() for t in sd.values()) == spans[-1][2]
    assert all(header[k]["data_offsets"][0] % t.element_size() == 0 for k, t in sd.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_from_a_gpu_one_pinned_buffer_serves_every_version_and_grows_when_needed(tmp_path):
    on = lambda sd: {k: t.cuda() for k, t in sd.items()}   # noqa: E731
    small, large = adapter(1), {**adapter(2), "extra.lora_A.weight": torch.ones(64, 64, dtype=torch.bfloat16)}
    host = write_safetensors(str(tmp_path / "v0.safetensors"), on(small))
    assert host.is_pinned()
    assert write_safetensors(str(tmp_path / "v1.safetensors"), on(adapter(3)), host) is host   # reused
    grown = write_safetensors(str(tmp_path / "v2.safetensors"), on(large), host)
    assert grown.numel() > host.numel()
    assert write_safetensors(str(tmp_path / "v3.safetensors"), on(adapter(4)), grown) is grown   # smaller: a slice
    for name, sd in (("v0", small), ("v1", adapter(3)), ("v2", large), ("v3", adapter(4))):   # each its own version
        back = load_file(str(tmp_path / f"{name}.safetensors"))
        assert all(torch.equal(back[k], t) for k, t in sd.items()), name


def test_host_tensors_are_written_from_where_they_are(tmp_path):
    assert write_safetensors(str(tmp_path / "a.safetensors"), adapter()) is None   # no host buffer made


def test_a_dtype_the_loader_cannot_take_is_refused_naming_the_tensor(tmp_path):
    with pytest.raises(ValueError, match=r"adapter tensor w: dtype torch.int64"):
        write_safetensors(str(tmp_path / "x.safetensors"), {"w": torch.zeros(2, dtype=torch.int64)})


def test_the_scale_is_folded_into_b_alone():
    sd = {**adapter(), "base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(8, 10),
          "base_model.model.model.embed_tokens.lora_embedding_B": torch.ones(10, 8)}
    b = {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
         "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight",
         "base_model.model.model.embed_tokens.lora_embedding_B"}
    out = scaled(sd, 2.5)
    for k, t in sd.items():
        assert torch.equal(out[k], t * 2.5 if k in b else t), k
    assert scaled(sd, 1.0) is sd   # alpha = rank: nothing to fold
