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


FINGERPRINT_CHUNK = 1 << 20  # int64 words per step on CPU: bounds a fingerprint's scratch memory (8 MiB)
FINGERPRINT_CHUNK_CUDA = 1 << 24  # on a GPU: 128 MiB scratch, 16x fewer kernel launches per tensor


def _wrap(x: int) -> int:
    """Python int -> the signed int64 with the same low 64 bits (torch int64 arithmetic wraps)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


_MIX2 = _wrap(2 * 0x9E3779B97F4A7C15)  # twice the golden-ratio constant: multipliers 2*i*MIX + 1 stay odd


_MULTIPLIERS: dict = {}


def _multipliers(device) -> torch.Tensor:
    """2*i*MIX + 1 for i < FINGERPRINT_CHUNK: odd, distinct, cached per device."""
    key = str(device)
    if key not in _MULTIPLIERS:
        n = FINGERPRINT_CHUNK_CUDA if torch.device(device).type == "cuda" else FINGERPRINT_CHUNK
        _MULTIPLIERS[key] = torch.arange(n, dtype=torch.int64, device=device) * _MIX2 + 1
    return _MULTIPLIERS[key]


def fingerprint(t: torch.Tensor) -> int:
    """A 64-bit fingerprint of a tensor's bytes, computed where the tensor lives (GPU or CPU).

    sum_i word_i * m_i (mod 2^64) with odd multipliers m_i = 2*i*MIX + 1: any change of a single
    64-bit word changes the sum, since odd numbers are invertible mod 2^64. Runs at memory
    bandwidth on a GPU, so a 7B version is fingerprinted where it lives in milliseconds instead
    of being copied to the CPU and hashed for seconds.
    """
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.storage_offset() % 8:  # a view at an unaligned offset of a flat buffer: int64 view needs alignment
        b = b.clone()
    n8 = b.numel() // 8
    words = b[:n8 * 8].view(torch.int64)
    base = _multipliers(b.device)
    acc = torch.zeros((), dtype=torch.int64, device=b.device)
    for i in range(0, n8, base.numel()):
        w = words[i:i + base.numel()]
        # multipliers of this chunk are base + 2*i*MIX: one multiply with the cached base
        acc += (w * base[:w.numel()]).sum() + w.sum() * _wrap(i * _MIX2)
    tail = b[n8 * 8:].to(torch.int64)
    if tail.numel():
        acc += (tail * base[:tail.numel()]).sum() * 3
    return int(acc.item())


class Hasher:
    """Incremental weight checksum; feed tensors in (dtype, name) order."""

    def __init__(self):
        self.h = hashlib.blake2b(digest_size=8)

    def update(self, name: str, t: torch.Tensor) -> None:
        self.h.update(f"{name}|{_dt(t.dtype)}|{tuple(t.shape)}|{fingerprint(t) if t.numel() else 0}".encode())

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def checksum(state_dict: dict[str, torch.Tensor]) -> str:
    h = Hasher()
    for name in sorted(state_dict, key=lambda n: (_dt(state_dict[n].dtype), n)):
        h.update(name, state_dict[name])
    return h.hexdigest()


def bucket_views(flat: torch.Tensor, bucket: dict, lay: list[list]) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of each tensor of `bucket` inside its flat tensor `flat` (the range
    [bucket start, end) of its dtype's buffer), in bucket order: what a publisher's send() takes."""
    where = {name: (shape, offset) for name, _dt, shape, offset in lay}
    out = []
    for name in bucket["names"]:
        shape, offset = where[name]
        start = offset - bucket["start"]
        out.append((name, flat[start:start + torch.Size(shape).numel()].view(shape)))
    return out
