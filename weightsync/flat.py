"""Packing a state dict into one flat buffer per dtype, and the weight checksum.

Pure. The layout is deterministic (names sorted), so publisher and subscriber agree on it
from the metadata alone; the checksum covers names, dtypes, shapes and bytes, so equal
checksums mean bit-identical weights.
"""
from __future__ import annotations

import hashlib

import torch


def layout(state_dict: dict[str, torch.Tensor]) -> list[list]:
    """[[name, dtype, shape, offset_in_dtype_buffer], ...] in sorted-name order."""
    offsets: dict[str, int] = {}
    out = []
    for name in sorted(state_dict):
        t = state_dict[name]
        dt = str(t.dtype).removeprefix("torch.")
        out.append([name, dt, list(t.shape), offsets.get(dt, 0)])
        offsets[dt] = offsets.get(dt, 0) + t.numel()
    return out


def buffer_sizes(lay: list[list]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for _name, dt, shape, offset in lay:
        sizes[dt] = max(sizes.get(dt, 0), offset + int(torch.Size(shape).numel()))
    return sizes


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


def checksum(state_dict: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
