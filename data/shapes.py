"""Randomly initialised models of real shapes, for benchmarks and GPU runs (no hub needed).

Shapes follow the published Qwen2.5 configs; the byte tokenizer is saved beside the weights
so engines can load the folder (its ids are a subset of the vocabulary).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from data.tokenizer import build_byte_tokenizer

QWEN2_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=288, tie_word_embeddings=False),
    # the tiny body with Qwen2's real vocabulary: the output head dominates (CPU runs of bench.logprob)
    "tiny-v152k": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


# Llama-family shapes (transformers' LlamaConfig): SmolLM2-135M-Instruct, the GPU runs' model
LLAMA_SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=8192),
}


def model_config(shape: str, **overrides):
    """The transformers config of a named shape (QWEN2_SHAPES or LLAMA_SHAPES)."""
    from transformers import LlamaConfig, Qwen2Config

    if shape in LLAMA_SHAPES:
        return LlamaConfig(**{**LLAMA_SHAPES[shape], **overrides})
    if shape in QWEN2_SHAPES:
        return Qwen2Config(**{**QWEN2_SHAPES[shape], **overrides})
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join([*QWEN2_SHAPES, *LLAMA_SHAPES])}")


def save_random_model(shape: str, out: str | Path, *, dtype: str = "bfloat16", seed: int = 0,
                      max_position_embeddings: int = 32768) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_byte_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen2Config(**QWEN2_SHAPES[shape], max_position_embeddings=max_position_embeddings,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.shapes", description="write a random Qwen2-shaped model folder")
    p.add_argument("--shape", choices=sorted(QWEN2_SHAPES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    print(save_random_model(args.shape, args.out, dtype=args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
