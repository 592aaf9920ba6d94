"""weightsync/flat.py: pack/unpack round trip, layout determinism, checksum."""
from __future__ import annotations

import pytest
import torch

from weightsync.flat import buffer_sizes, checksum, layout, pack, unpack

pytestmark = pytest.mark.unit


def state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.randn(4, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "steps": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "idx": torch.arange(5, dtype=torch.int64).reshape(5, 1),
        "h": torch.randn(2, 2, 2, generator=g).to(torch.bfloat16),
    }


def test_round_trip_mixed_dtypes():
    sd = state()
    lay = layout(sd)
    bufs = pack(sd, lay)
    assert set(bufs) == {"float32", "bfloat16", "int64"}
    for dt, n in buffer_sizes(lay).items():
        assert bufs[dt].numel() == n == sum(t.numel() for t in sd.values() if str(t.dtype) == f"torch.{dt}")
    out = unpack(bufs, lay)
    assert set(out) == set(sd)
    for k, t in sd.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape, k
        assert torch.equal(out[k], t), k
    assert checksum(out) == checksum(sd)


def test_layout_deterministic_regardless_of_order():
    sd = state()
    rev = dict(reversed(list(sd.items())))
    assert list(sd) != list(rev)
    assert layout(sd) == layout(rev)
    # ordered by (dtype, name): the order buffers fill, buckets stream and the checksum hashes
    assert [e[0] for e in layout(sd)] == sorted(sd, key=lambda n: (str(sd[n].dtype), n))
    assert checksum(sd) == checksum(rev)
    a, b = pack(sd, layout(sd)), pack(rev, layout(rev))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checksum_sensitivity():
    sd, same = state(), state()
    assert checksum(sd) == checksum(same)
    for name in ("w", "b", "steps"):
        changed = state()
        changed[name].view(-1)[0] += 1
        assert checksum(changed) != checksum(sd), name
    renamed = state()
    renamed["w2"] = renamed.pop("w")
    assert checksum(renamed) != checksum(sd)
    reshaped = state()
    reshaped["w"] = reshaped["w"].reshape(4, 3)
    assert checksum(reshaped) != checksum(sd)


@pytest.mark.parametrize("bucket_bytes", [1, 16, 100, 10**9])
def test_buckets_cover_each_dtype_buffer_contiguously(bucket_bytes):
    from weightsync.flat import buffer_sizes, plan_buckets

    sd = {f"p{i}": torch.zeros(n, dtype=dt) for i, (n, dt) in
          enumerate([(3, torch.float32), (50, torch.float32), (7, torch.bfloat16), (1, torch.float32), (9, torch.bfloat16)])}
    lay = layout(sd)
    buckets = plan_buckets(lay, bucket_bytes)
    seen = [n for b in buckets for n in b["names"]]
    assert sorted(seen) == sorted(sd) and len(seen) == len(sd)
    for dt, total in buffer_sizes(lay).items():
        ranges = [(b["start"], b["end"]) for b in buckets if b["dtype"] == dt]
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for b in buckets:  # within budget, unless one tensor alone is larger
        assert b["bytes"] <= bucket_bytes or len(b["names"]) == 1


def test_fingerprint_catches_any_single_word_change():
    from weightsync.flat import fingerprint

    g = torch.Generator().manual_seed(0)
    t = torch.randn(1001, generator=g)  # 4004 bytes: 500 words and a 4-byte tail
    base = fingerprint(t)
    assert base == fingerprint(t.clone())
    for i in (0, 1, 499, 500, 1000):
        u = t.clone()
        u.view(torch.int32)[i] ^= 1 << 7  # flip one bit
        assert fingerprint(u) != base, i
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert fingerprint(swapped) != base  # position matters, not just the multiset of values


def test_flat_fingerprints_equal_the_per_tensor_ones():
    """The vectorized fingerprints of tensors stored in one flat buffer (prefix sums over chunks)
    equal `fingerprint` of each: aligned and unaligned offsets, odd sizes, empty tensors, spans
    crossing the chunk boundary, in three dtypes."""
    import weightsync.flat as flat_mod
    from weightsync.flat import fingerprint, fingerprints

    g = torch.Generator().manual_seed(1)
    for dt in (torch.float32, torch.bfloat16, torch.int64):
        sizes = [4, 8, 3, 0, 16, 1, 64, 12, 5, 40]
        flat = (torch.randn(sum(sizes) + 3, generator=g) * 1000).to(dt)
        spans, off = [], 0
        for n in sizes:
            spans.append((off, n))
            off += n
        spans.append((sum(sizes) - 7, 10))  # overlapping spans are fine: each is read on its own
        got = fingerprints(flat, spans).tolist()
        want = [fingerprint(flat[o:o + n]) if n else 0 for o, n in spans]
        assert got == want, dt
    old = flat_mod.FINGERPRINT_CHUNK
    try:  # tiny chunks: prefix sums carried across many chunk boundaries
        flat_mod.FINGERPRINT_CHUNK = 4
        flat_mod._MULTIPLIERS.clear()
        flat = torch.randn(101, generator=g)
        spans = [(0, 2), (2, 30), (32, 64), (96, 5)]
        assert fingerprints(flat, spans).tolist() == [fingerprint(flat[o:o + n]) for o, n in spans]
    finally:
        flat_mod.FINGERPRINT_CHUNK = old
        flat_mod._MULTIPLIERS.clear()


def test_checksum_of_unpacked_views_and_bucket_hashing_equal_the_plain_checksum():
    """checksum() of `unpack` views (fingerprinted per flat buffer) and a Hasher fed bucket by bucket
    with update_flat or update_packed equal checksum() of separate tensors, and still see a one-bit change."""
    from weightsync.flat import Hasher, bucket_views, plan_buckets, views_at

    g = torch.Generator().manual_seed(2)
    sd = {f"l{i}.w": torch.randn(n, generator=g).to(dt) for i, (n, dt) in
          enumerate([(12, torch.bfloat16), (7, torch.bfloat16), (16, torch.float32), (3, torch.float32),
                     (32, torch.bfloat16), (0, torch.float32)])}
    plain = checksum({k: v.clone() for k, v in sd.items()})
    lay = layout(sd)
    views = unpack(pack(sd, lay), lay)
    assert checksum(views) == plain
    for bucket_bytes in (8, 40, 10**6):
        h, packed, received = Hasher(), Hasher(), Hasher()
        bufs, first = pack(sd, lay), 0
        for b in plan_buckets(lay, bucket_bytes):
            flat = bufs[b["dtype"]][b["start"]:b["end"]].clone()
            h.update_flat(flat, bucket_views(flat, b, lay))
            packed.update_packed(flat, [(n, sd[n]) for n in b["names"]])  # what a publisher's send() does
            # what a cuda_ipc subscriber does with a bucket: its run of layout entries, from the message
            received.update_packed(flat, views_at(flat, b["start"], lay[first:first + len(b["names"])]))
            first += len(b["names"])
        assert h.hexdigest() == packed.hexdigest() == received.hexdigest() == plain, bucket_bytes
        assert received.count == len(lay) and received.buckets == len(plan_buckets(lay, bucket_bytes))
    bufs = pack(sd, lay)
    bufs["bfloat16"].view(torch.int16)[20] ^= 1
    assert checksum(unpack(bufs, lay)) != plain
