"""A byte-level tokenizer built locally: 256 byte tokens plus specials, no merges.

It is a real `PreTrainedTokenizerFast` (saved with `save_pretrained`, loadable by
transformers and vLLM), so the embedded default exercises the same code paths as a
downloaded model folder while needing no hub.
"""
from __future__ import annotations

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def build_byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    vocab[PAD] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    fast.add_special_tokens({"eos_token": EOS, "pad_token": PAD})
    return fast
