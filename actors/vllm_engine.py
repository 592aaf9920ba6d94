"""vLLM engine: sampling with behavior logprobs, in-place weight updates through the worker extension.

Version switches are atomic by pausing between batches: the rollout loop calls
`load_weights` only between two blocking `generate` calls, so every request of a batch runs
on one version (version_start == version_end). In-flight switching would cut the wait for a
new version but make a sample's tokens come from two policies; with staleness already
bounded by admission, one batch of delay is the cheaper price.

With tensor_model_parallel_size == 1 the engine runs inside the actor's process (no engine
core or worker subprocess), and `collective_rpc` hands tensors over by reference. With
TP > 1 the weights go through shared-memory files and only their paths travel.
"""
from __future__ import annotations

import os
import tempfile
import uuid

import numpy as np
import torch

from actors.core import Completion, Engine, SamplingParams
from weightsync.flat import buffer_sizes, checksum, layout, pack

EXTENSION = "actors.vllm_ext.WeightSyncExtension"


def initial_checksum(model_path: str) -> str:
    """Checksum of the model folder's weights: version 0, as the learner loads it."""
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(os.listdir(model_path)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(model_path, f)))
    return checksum(sd)


class VLLMEngine(Engine):
    def __init__(self, model_path: str, cfg, *, seed: int = 0):
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # avoids a ~90 s kernel build at start
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kvcache_gib))
        self.in_process = cfg.tensor_model_parallel_size == 1 and cfg.vllm_in_process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        import vllm
        from transformers import AutoConfig, AutoTokenizer

        kwargs = dict(model=model_path, dtype=cfg.dtype, tensor_parallel_size=cfg.tensor_model_parallel_size,
                      enforce_eager=cfg.enforce_eager, seed=seed, worker_extension_cls=EXTENSION,
                      gpu_memory_utilization=cfg.gpu_memory_utilization,
                      # behavior logprobs after temperature: what the learner recomputes
                      logprobs_mode="processed_logprobs")
        if not cfg.stop:  # token ids in, token ids out: no detokenizer (stop strings need one)
            kwargs["skip_tokenizer_init"] = True
        if cfg.max_model_len:
            kwargs["max_model_len"] = cfg.max_model_len
        if self.in_process:
            kwargs["distributed_executor_backend"] = "uni"
        self.llm = vllm.LLM(**kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
        self.stop = list(cfg.stop)
        self.version = 0
        self.checksum = initial_checksum(model_path)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        import vllm
        from vllm.inputs import TokensPrompt

        sp = vllm.SamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                 max_tokens=params.max_tokens, logprobs=0, seed=params.seed,
                                 stop=self.stop or None, include_stop_str_in_output=True,
                                 ignore_eos=params.ignore_eos, detokenize=bool(self.stop))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        result = []
        for out in outs:
            comps = []
            for c in out.outputs:
                ids = np.asarray(c.token_ids, dtype=np.int32)
                lps = np.asarray([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)], dtype=np.float32)
                comps.append(Completion(token_ids=ids, logprobs=lps,
                                        finish_reason=c.finish_reason if c.finish_reason in ("stop", "length") else "abort"))
            result.append(comps)
        return result

    def load_weights(self, state_dict, version: int, checksum_: str) -> None:
        if self.in_process:
            got = self.llm.collective_rpc("asyncrl_apply", args=(list(state_dict.items()),))
        else:
            got = self._apply_via_shm(state_dict)
        if any(g != checksum_ for g in got):
            raise RuntimeError(f"vLLM workers applied checksums {got} for version {version}, expected {checksum_}")
        self.version, self.checksum = version, checksum_

    def _apply_via_shm(self, state_dict) -> list[str]:
        lay = layout(state_dict)
        bufs = pack(state_dict, lay)
        d = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        paths = {}
        try:
            for dt, n in buffer_sizes(lay).items():
                path = os.path.join(d, f"asyncrl-w-{uuid.uuid4().hex}-{dt}")
                t = torch.from_file(path, shared=True, size=n, dtype=getattr(torch, dt))
                t.copy_(bufs[dt])
                paths[dt] = [path, n]
            return self.llm.collective_rpc("asyncrl_apply_shm", args=({"buffers": paths, "layout": lay},))
        finally:
            for path, _n in paths.values():
                os.unlink(path)

    def prompt_logprobs(self, token_ids: list[int]) -> np.ndarray:
        """log p(token t | tokens < t) for t >= 1 under the engine's current weights (T = 1)."""
        import vllm
        from vllm.inputs import TokensPrompt

        sp = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], sp, use_tqdm=False)[0]
        return np.asarray([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], token_ids[1:])], dtype=np.float32)
