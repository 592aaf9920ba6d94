"""The generation backends, chosen in one place: `actors.engine` names one, `build_engine` builds it.

The interface (engines/core.py) imports no backend; each backend imports the interface, and this module
imports a backend only when one is built (the backends load torch, and vLLM's loads vLLM).
"""
from __future__ import annotations

from engines.core import Engine


def build_engine(cfg, model_path: str, *, seed: int = 0, behavior_logprobs: bool = True, lora=None) -> Engine:
    """The configured backend (`actors.engine`); heavy imports happen only for the one chosen.
    `behavior_logprobs=False` (an evaluator: it scores text): an engine that records them at a cost per step
    may leave them out (NaN). `lora`: the job's learner.lora (with a rank, versions are the learner's adapter)."""
    if cfg.engine not in ENGINES:
        raise ValueError(f"unknown engine {cfg.engine!r}; known: {', '.join(ENGINES)}")
    return ENGINES[cfg.engine](cfg, model_path, seed, behavior_logprobs, lora)


def _hf(cfg, model_path: str, seed: int, behavior_logprobs: bool, lora) -> Engine:
    from engines.hf_engine import HFEngine  # lazy: imports torch

    return HFEngine(model_path, device=cfg.device, dtype=cfg.dtype, lora=lora)


def _vllm(cfg, model_path: str, seed: int, behavior_logprobs: bool, lora) -> Engine:
    from engines.vllm_engine import VLLMEngine  # lazy: imports torch

    return VLLMEngine(model_path, cfg, seed=seed, behavior_logprobs=behavior_logprobs, lora=lora)


ENGINES = {"hf": _hf, "vllm": _vllm}   # actors.engine -> constructor: the one place a backend is chosen
