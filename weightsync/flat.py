"""Flat per-dtype layout of a state dict, buckets over it, and the weight checksum.

Pure. Tensors are ordered by (dtype, name): that order fixes their offsets in each dtype's
flat buffer, the order buckets stream in, and the order the checksum hashes them, so a
checksum can be computed incrementally while buckets stream and still equal `checksum()` of
the whole state dict. Equal checksums mean bit-identical weights (names, dtypes, shapes, bytes).
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch


def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_from_meta(meta: Iterable[tuple[str, torch.dtype, tuple]]) -> list[list]:
    """[[name, dtype, shape, offset_in_dtype_buffer], ...] from (name, dtype, shape) triples."""
    offsets: dict[str, int] = {}
    out = []
    for name, dt, shape in sorted(((n, _dt(d), list(s)) for n, d, s in meta), key=lambda x: (x[1], x[0])):
        out.append([name, dt, shape, offsets.get(dt, 0)])
        offsets[dt] = offsets.get(dt, 0) + int(torch.Size(shape).numel())
    return out


def layout(state_dict: dict[str, torch.Tensor]) -> list[list]:
    return layout_from_meta((n, t.dtype, tuple(t.shape)) for n, t in state_dict.items())


def buffer_sizes(lay: list[list]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for _name, dt, shape, offset in lay:
        sizes[dt] = max(sizes.get(dt, 0), offset + int(torch.Size(shape).numel()))
    return sizes


def plan_buckets(lay: list[list], bucket_bytes: int) -> list[dict]:
    """Consecutive runs of one dtype's tensors, each at most `bucket_bytes` unless a single
    tensor is larger (it then gets a bucket of its own). Each bucket is a contiguous range
    [start, end) of its dtype's flat buffer."""
    buckets: list[dict] = []
    for name, dt, shape, offset in lay:
        n = int(torch.Size(shape).numel())
        size = n * torch.empty(0, dtype=getattr(torch, dt)).element_size()
        b = buckets[-1] if buckets else None
        if b is None or b["dtype"] != dt or (b["bytes"] + size > bucket_bytes and b["names"]):
            b = {"dtype": dt, "start": offset, "end": offset, "bytes": 0, "names": []}
            buckets.append(b)
        b["names"].append(name)
        b["end"] = offset + n
        b["bytes"] += size
    return buckets


def pack(state_dict: dict[str, torch.Tensor], lay: list[list]) -> dict[str, torch.Tensor]:
    bufs = {dt: torch.empty(n, dtype=getattr(torch, dt)) for dt, n in buffer_sizes(lay).items()}
    for name, dt, shape, offset in lay:
        t = state_dict[name].detach()
        bufs[dt][offset:offset + t.numel()].copy_(t.reshape(-1))
    return bufs


def unpack(bufs: dict[str, torch.Tensor], lay: list[list]) -> dict[str, torch.Tensor]:
    """Views into `bufs` (no copy): the caller owns the buffers for the version's lifetime."""
    return {name: bufs[dt][offset:offset + torch.Size(shape).numel()].view(shape)
            for name, dt, shape, offset in lay}


class Hasher:
    """Incremental weight checksum; feed tensors in (dtype, name) order."""

    def __init__(self):
        self.h = hashlib.blake2b(digest_size=8)

    def update(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        self.h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            self.h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def checksum(state_dict: dict[str, torch.Tensor]) -> str:
    h = Hasher()
    for name in sorted(state_dict, key=lambda n: (_dt(state_dict[n].dtype), n)):
        h.update(name, state_dict[name])
    return h.hexdigest()
