"""The engine interface every generation backend implements."""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None
    ignore_eos: bool = False   # benchmarks: always generate max_tokens


@dataclass
class Completion:
    token_ids: np.ndarray   # int32, includes the EOS token when finish_reason == "stop"
    logprobs: np.ndarray    # float32, behavior logprob of each token at `temperature`
    finish_reason: str      # "stop" | "length"


class Engine(abc.ABC):
    """Generates with one weight version at a time; versions change only between calls."""

    version: int = 0
    checksum: str = ""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """n completions per prompt, all from weights `self.version`."""

    @abc.abstractmethod
    def load_weights(self, state_dict, version: int, checksum: str) -> None:
        """Swap in a complete new version (called between `generate` calls)."""


def build_engine(cfg, model_path: str, *, seed: int = 0) -> Engine:
    """The configured backend; heavy imports happen only for the one chosen."""
    if cfg.engine == "hf":
        from actors.hf_engine import HFEngine

        return HFEngine(model_path, device=cfg.device, dtype=cfg.dtype)
    if cfg.engine == "vllm":
        from actors.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, cfg, seed=seed)
    raise ValueError(f"unknown engine {cfg.engine!r}")
