"""The weight transports, chosen in one place: `weightsync.backend` with `auto` resolved by one rule,
and the publisher and subscriber classes of each backend in one table.

The launcher resolves `auto` once (it sees where every process sits) and hands every process the
backend's name; whoever builds a learner outside the launcher resolves it with `resolve` too (a learner
takes only a resolved name: learner/config.py LearnerView).
"""
from __future__ import annotations

import importlib

# name -> (module, publisher class, the keyword arguments it takes beyond r, keys and timeout_s,
#          subscriber class, likewise)
BACKENDS: dict[str, tuple[str, str, tuple[str, ...], str, tuple[str, ...]]] = {
    "gloo": ("weightsync.gloo", "GlooPublisher", ("host",), "GlooSubscriber", ()),
    "cuda_ipc": ("weightsync.cuda_ipc", "CudaIpcPublisher", (), "CudaIpcSubscriber", ("device",)),
    "nccl": ("weightsync.nccl", "NcclPublisher", ("device", "host"), "NcclSubscriber", ("device",)),
}


def resolve(backend: str, *, learner_on_cuda: bool, actors_on_cuda: bool, n_gpus: int, learners: int,
            spread: bool = False) -> str:
    """A named backend as it is; `auto` from where processes sit: CPU on either side -> gloo; actors on GPUs
    the learners leave free -> nccl, and likewise when `spread` over placement-group bundles (which never
    share a GPU and may sit on other nodes); no GPU left for actors -> they share learner rank 0's GPU ->
    cuda_ipc (NCCL refuses two ranks on one device)."""
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"unknown weight backend {backend!r}; known: auto, {', '.join(BACKENDS)}")
        return backend
    if not (learner_on_cuda and actors_on_cuda):
        return "gloo"
    return "nccl" if spread or n_gpus > learners else "cuda_ipc"


def _cls(backend: str, which: int):
    module, pub, pub_kw, sub, sub_kw = BACKENDS[backend]
    name, kw = (pub, pub_kw) if which == 0 else (sub, sub_kw)
    return getattr(importlib.import_module(module), name), kw  # torch-heavy modules: loaded on use


def publisher(backend: str, r, keys, *, timeout_s: float, device=None, host: str | None = None):
    """Learner rank 0's publisher of `backend` (a resolved name)."""
    cls, kw = _cls(backend, 0)
    given = {"device": device, "host": host}
    return cls(r, keys, timeout_s=timeout_s, **{k: given[k] for k in kw if given[k] is not None})


def subscriber(backend: str, r, keys, *, member_id: str, timeout_s: float, device=None):
    """An actor's (or the evaluator's) subscriber of `backend`."""
    cls, kw = _cls(backend, 1)
    given = {"device": device}
    return cls(r, keys, actor_id=member_id, timeout_s=timeout_s, **{k: given[k] for k in kw if given[k] is not None})
