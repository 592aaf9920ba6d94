"""Flat per-dtype layout of a state dict, buckets over it, and the weight checksum.

Pure. Tensors are ordered by (dtype, name): that order fixes their offsets in each dtype's
flat buffer, the order buckets stream in, and the order the checksum hashes them, so a
checksum can be computed incrementally while buckets stream and still equal `checksum()` of
the whole state dict. Equal checksums mean bit-identical weights (names, dtypes, shapes, bytes).
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Iterable

import torch


def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_dtype(dtype: torch.dtype, wire: str) -> torch.dtype:
    """The dtype a tensor travels in: floating-point ones in the publication's `wire` dtype (the engines'),
    others (integer buffers) as they are."""
    return getattr(torch, wire) if dtype.is_floating_point else dtype


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
FINGERPRINT_CHUNK_CUDA = 1 << 24  # on a GPU: 128 MiB per scratch tensor (two at a time), 16x fewer launches


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


def _fingerprint_t(t: torch.Tensor) -> torch.Tensor:
    """`fingerprint` as a 0-d int64 tensor where `t` lives: no host sync."""
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
    return acc


def fingerprint(t: torch.Tensor) -> int:
    """A 64-bit fingerprint of a tensor's bytes, computed where the tensor lives (GPU or CPU).

    sum_i word_i * m_i (mod 2^64) with odd multipliers m_i = 2*i*MIX + 1: any change of a single
    64-bit word changes the sum, since odd numbers are invertible mod 2^64. Runs at memory
    bandwidth on a GPU, so a 7B version is fingerprinted where it lives in milliseconds instead
    of being copied to the CPU and hashed for seconds.
    """
    return int(_fingerprint_t(t).item())


def fingerprints(flat: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """`fingerprint` of each tensor stored in the 1-D contiguous `flat` at (element offset, numel),
    as one int64 tensor where `flat` lives, in a few kernels per FINGERPRINT_CHUNK words and no host
    sync: a publication fingerprints hundreds of tensors, and one launch series and one `.item()` per
    tensor cost a GIL hand-off each on a thread beside a busy engine loop (and a stall on a shared GPU).

    A tensor starting at word s spans words [s, s + c): its fingerprint sum_g W_g * ((g - s)*MIX2 + 1)
    is A - s*MIX2*B with A, B the sums of W_g*(g*MIX2 + 1) and of W_g over its words, read as
    differences of two prefix sums (int64, wrapping as the multiplications do). Tensors whose bytes
    are not whole aligned words go through the per-tensor form."""
    e = flat.element_size()
    aligned = flat.data_ptr() % 8 == 0
    # an empty span is a zero-width range (fingerprint 0) wherever it sits
    fast = [j for j, (off, n) in enumerate(spans) if n == 0 or (aligned and (off * e) % 8 == 0 and (n * e) % 8 == 0)]
    if not spans:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    starts = [spans[j][0] * e // 8 for j in fast]
    fp = _fingerprints_fast(flat, starts, [s + spans[j][1] * e // 8 for s, j in zip(starts, fast)]) if fast else None
    if len(fast) == len(spans):  # the usual case: every tensor whole aligned words, in order
        return fp
    out = {j: fp[k] for k, j in enumerate(fast)}  # the rare other case: the rest per tensor
    return torch.stack([out[j] if j in out else _fingerprint_t(flat[off:off + n]) for j, (off, n) in enumerate(spans)])


def _fingerprints_fast(flat: torch.Tensor, starts: list[int], ends: list[int]) -> torch.Tensor:
    """Per-span fingerprints of word ranges [starts[k], ends[k]) of `flat`'s int64 view."""
    import numpy as np

    dev = flat.device
    top = max(ends)
    words = flat.view(torch.uint8)[:top * 8].view(torch.int64)
    base = _multipliers(dev)
    ch = base.numel()
    # every boundary x needs prefix(x) = sum over g < x; prefix(0) = 0. The index arrays are made on the
    # host and cross to the device in one copy (pinned, asynchronous): a synchronous copy per chunk would
    # wait each time for everything queued before it on the stream.
    bounds = np.unique(np.asarray(starts + ends, dtype=np.int64))
    where = {int(x): i for i, x in enumerate(bounds)}
    chunks = range(0, top, ch)
    sels = [np.nonzero((bounds > g0) & (bounds <= g0 + min(ch, top - g0)))[0] for g0 in chunks]
    host = np.concatenate([np.asarray([where[x] for x in starts]), np.asarray([where[x] for x in ends]),
                           np.asarray([_wrap(x * _MIX2) for x in starts], dtype=np.int64)]
                          + [bounds[sel] - g0 - 1 for sel, g0 in zip(sels, chunks)] + sels).astype(np.int64)
    idx = _to_device(torch.from_numpy(host), dev)
    k = len(starts)
    si, ei, shift = idx[:k], idx[k:2 * k], idx[2 * k:3 * k]
    n_sel = sum(len(sel) for sel in sels)
    at_all, to_all = idx[3 * k:3 * k + n_sel], idx[3 * k + n_sel:]
    pre_p = torch.zeros(len(bounds), dtype=torch.int64, device=dev)
    pre_w = torch.zeros(len(bounds), dtype=torch.int64, device=dev)
    carry_p = torch.zeros((), dtype=torch.int64, device=dev)
    carry_w = torch.zeros((), dtype=torch.int64, device=dev)
    pos = 0
    for sel, g0 in zip(sels, chunks):
        w = words[g0:g0 + ch]
        # two chunk-sized scratch tensors at a time, built in place (an engine beside others on one GPU
        # keeps whatever its allocator once reserved)
        cs_p = w * base[:w.numel()]
        cs_p.add_(w, alpha=_wrap(g0 * _MIX2)).cumsum_(0)
        cs_w = torch.cumsum(w, 0)
        if len(sel):
            at, to = at_all[pos:pos + len(sel)], to_all[pos:pos + len(sel)]
            pre_p[to] = cs_p[at] + carry_p
            pre_w[to] = cs_w[at] + carry_w
            pos += len(sel)
        carry_p = carry_p + cs_p[-1]
        carry_w = carry_w + cs_w[-1]
        del cs_p, cs_w  # freed before the next chunk's are made
    a, b = pre_p[ei] - pre_p[si], pre_w[ei] - pre_w[si]
    return a - shift * b


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small host tensor on `dev`: from pinned memory without blocking on a GPU (the caching host
    allocator keeps the pinned block until the copy is done), as is on the CPU."""
    if dev.type != "cuda":
        return t
    return t.pin_memory().to(dev, non_blocking=True)


class Hasher:
    """Incremental weight checksum; feed tensors in (dtype, name) order. Fingerprints stay on the
    device until `stage` (a bucket's, from `update_packed`) or `hexdigest` reads them back."""

    def __init__(self):
        self.entries: list[tuple[str, str, tuple]] = []
        self.fps: list[torch.Tensor] = []
        self.staged: list[tuple[torch.Tensor, object]] = []   # (host copy, CUDA event after it or None)
        self.buckets = 0   # update_packed calls so far

    @property
    def count(self) -> int:
        """Tensors fed so far."""
        return len(self.entries)

    def update(self, name: str, t: torch.Tensor) -> None:
        self.entries.append((name, _dt(t.dtype), tuple(t.shape)))
        self.fps.append(_fingerprint_t(t).reshape(1))  # kept where the tensor lives: no sync per tensor

    def update_flat(self, flat: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> None:
        """Every (name, view) of `named`, each a contiguous view into the 1-D `flat` (a bucket), at once."""
        spans = _spans_in(flat, [t for _, t in named])
        if spans is None:
            for name, t in named:
                self.update(name, t)
        else:
            self._add(flat, named, spans)

    def update_packed(self, flat: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> None:
        """The tensors of `named` as laid end to end in the 1-D `flat` (a bucket `flatten` made):
        fingerprints of what travels, read from the bucket itself."""
        spans, off = [], 0
        for _, t in named:
            spans.append((off, t.numel()))
            off += t.numel()
        if off != flat.numel():
            raise ValueError(f"bucket of {flat.numel()} elements holds tensors of {off}")
        self._add(flat, named, spans)
        self.buckets += 1
        self.stage()

    def _add(self, flat: torch.Tensor, named: list[tuple[str, torch.Tensor]], spans: list[tuple[int, int]]) -> None:
        self.entries += [(name, _dt(t.dtype), tuple(t.shape)) for name, t in named]
        self.fps.append(fingerprints(flat, spans))

    def stage(self) -> None:
        """Start reading the fingerprints so far back to the host, without waiting, on the calling thread's stream.

        A publisher fingerprints a bucket on the learner's stream and reads the digest on another thread while the
        next step trains: read then, the copy would queue behind that step's kernels (up to a forward of a 7B model,
        hundreds of ms). Staged right after the fingerprint kernels, `hexdigest` waits for them alone."""
        if not self.fps:
            return
        fp = torch.cat(self.fps) if len({f.device for f in self.fps}) == 1 else torch.cat([f.cpu() for f in self.fps])
        self.fps = []
        if fp.device.type != "cuda":
            self.staged.append((fp, None))
            return
        host = torch.empty(fp.shape, dtype=fp.dtype, pin_memory=True)
        host.copy_(fp, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(fp.device))
        self.staged.append((host, done))

    def hexdigest(self) -> str:
        self.stage()
        vals = []
        for host, done in self.staged:
            if done is not None:
                done.synchronize()
            vals += host.tolist()
        h = hashlib.blake2b(digest_size=8)
        for (name, dt, shape), fp in zip(self.entries, vals):
            h.update(f"{name}|{dt}|{shape}|{fp}".encode())
        return h.hexdigest()


def _spans_in(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[tuple[int, int]] | None:
    """(element offset, numel) of each tensor inside the contiguous 1-D `flat`, or None if any is not a
    contiguous view of `flat`'s storage within it, or of another dtype."""
    if flat.dim() != 1 or not flat.is_contiguous():
        return None
    ptr, n = flat.untyped_storage().data_ptr(), flat.numel()
    spans = []
    for t in tensors:
        if t.dtype != flat.dtype or (t.numel() and not t.is_contiguous()):
            return None
        if t.numel() == 0:
            spans.append((0, 0))
            continue
        if t.untyped_storage().data_ptr() != ptr:
            return None
        off = t.storage_offset() - flat.storage_offset()
        if off < 0 or off + t.numel() > n:
            return None
        spans.append((off, t.numel()))
    return spans


def checksum(state_dict: dict[str, torch.Tensor]) -> str:
    """The version checksum: per tensor name, dtype, shape and fingerprint, in (dtype, name) order.
    Tensors of one dtype that are views of one flat buffer (`unpack`) are fingerprinted together."""
    h = Hasher()
    names = sorted(state_dict, key=lambda n: (_dt(state_dict[n].dtype), n))
    for _, group in itertools.groupby(names, key=lambda n: state_dict[n].dtype):
        named = [(n, state_dict[n]) for n in group]
        if (flat := _storage_flat(named)) is not None:
            h.update_flat(flat, named)
        else:
            for n, t in named:
                h.update(n, t)
    return h.hexdigest()


def _storage_flat(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
    """The whole storage the tensors of `named` share, as one 1-D tensor of their dtype, or None."""
    ts = [t for _, t in named if t.numel()]
    if len(ts) < 2:
        return None
    st = ts[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != st.data_ptr() for t in ts):
        return None
    e = ts[0].element_size()
    return torch.empty(0, dtype=ts[0].dtype, device=ts[0].device).set_(st, 0, (st.nbytes() // e,))


def bucket_views(flat: torch.Tensor, bucket: dict, lay: list[list]) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of each tensor of `bucket` inside its flat tensor `flat` (the range
    [bucket start, end) of its dtype's buffer), in bucket order: what a publisher's send() takes."""
    entries = {e[0]: e for e in lay}
    return views_at(flat, bucket["start"], [entries[name] for name in bucket["names"]])


def views_at(flat: torch.Tensor, start: int, entries: list[list]) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of each of the layout's `entries` (a bucket's run of them) inside `flat`, the range of their
    dtype's buffer that begins at element `start` (a bucket as a subscriber receives it)."""
    return [(name, flat[offset - start:offset - start + torch.Size(shape).numel()].view(shape))
            for name, _dt, shape, offset in entries]
