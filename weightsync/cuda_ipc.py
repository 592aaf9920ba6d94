"""Weight publication to actors on the publisher's own GPU, through CUDA IPC handles.

NCCL refuses two ranks on one device, and a detour through host memory costs seconds for a
7B model; a CUDA IPC handle lets the actor map the publisher's bucket and copy it
device-to-device. Handles travel as plain metadata through Redis (never pickled): one list per
member, `<run>:ws:ipc:<actor>`, carrying {version, bucket index, range, layout entries, handle} and a
final trailer {version, checksum}, pushed right behind the last bucket. No host wait orders a member's copy
after the publisher's writes: the handle's CUDA IPC event does, on the GPU. A member fingerprints each bucket
behind its copy on its own stream (one wait per bucket for both), so the trailer costs it no GPU work. Each
member gets its own share of a bucket (`member_handles`:
torch counts references per share). The publisher keeps each bucket alive until every member
has acknowledged its copy (a count per bucket in `<run>:ws:ipcack:<version>`, each ack also pushed
to a signal list the publisher blocks on), with at most two buckets in flight, so its peak extra
memory is two buckets. Membership, announcements and retry without silent members work as in the
gloo backend (shared via the announce stream and heartbeats).
"""
from __future__ import annotations

import base64
import json
import logging
import time

import torch

from runbase.keys import Keys
from weightsync.core import HEARTBEAT_S, WeightPublisher, WeightSubscriber, WeightVersion
from weightsync.flat import Hasher, buffer_sizes, checksum, unpack, views_at

log = logging.getLogger(__name__)

ACK_WAIT_MIN_S = 0.01  # shortest blocking wait for an ack (BLPOP's timeout 0 would mean forever)
RECEIVE_POLL_S = 0.5  # a receiver's blocking wait for its next message: how soon it sees stop or leave
IN_FLIGHT = 2         # buckets mapped by actors at once: bounds the publisher's extra memory


def handle_meta(t: torch.Tensor) -> dict:
    """A CUDA tensor's IPC handle as JSON-able metadata (what torch.multiprocessing would pickle)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _fn, a = reduce_tensor(t)
    (_tcls, size, stride, offset, scls, dtype, device, handle, size_bytes, offset_bytes, requires_grad,
     ref_handle, ref_offset, event_handle, event_sync) = a
    b64 = lambda x: base64.b64encode(x).decode() if isinstance(x, (bytes, bytearray)) else x  # noqa: E731
    return {"size": list(size), "stride": list(stride), "offset": offset, "storage": scls.__name__,
            "dtype": str(dtype).removeprefix("torch."), "device": device, "handle": b64(handle),
            "size_bytes": size_bytes, "offset_bytes": offset_bytes, "ref_handle": b64(ref_handle),
            "ref_offset": ref_offset, "event_handle": b64(event_handle), "event_sync": event_sync}


def member_handles(t: torch.Tensor, members: int, share=handle_meta) -> list[dict]:
    """One IPC handle per member, each with its own reference counter.

    torch counts a shared CUDA block with one counter per share, set to 1, and each receiver
    decrements the counter of the handle it opened when it lets go. One handle read by two actors
    took that counter to -1 (2**64 - 1 unsigned): the publisher's allocator then held every
    bucket forever, a whole model per publication, until the learner ran out of GPU memory (seen
    on the H200: 60 GiB held after ~100 versions of a 135M model with two actors). One share per
    member nests the counters, and the block is freed once every member has released its own."""
    return [share(t) for _ in range(members)]


def open_handle(m: dict) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    unb64 = lambda x: base64.b64decode(x) if isinstance(x, str) else x  # noqa: E731
    scls = getattr(torch, m["storage"], None) or getattr(torch.storage, m["storage"])
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(m["size"]), tuple(m["stride"]), m["offset"], scls,
                               getattr(torch, m["dtype"]), m["device"], unb64(m["handle"]), m["size_bytes"],
                               m["offset_bytes"], False, unb64(m["ref_handle"]), m["ref_offset"],
                               unb64(m["event_handle"]), m["event_sync"])


class CudaIpcPublisher(WeightPublisher):
    def __init__(self, r, keys: Keys, *, timeout_s: float):
        self.r, self.keys, self.timeout_s = r, keys, timeout_s
        r.hset(keys.ws, mapping={"backend": "cuda_ipc", "addr": "cuda_ipc"})
        self.epoch, self.members = 0, []
        self.stats: dict[str, float] = {}

    def begin(self, version: int, lay: list[list], buckets: list[dict], members: list[str] | None = None) -> None:
        self._check_layout(lay)
        self.where = {name: (i, offset) for i, (name, _dt, _shape, offset) in enumerate(lay)}
        members = self.live_members() if members is None else sorted(members)
        if members != self.members:
            self.epoch, self.members = self.epoch + 1, members
        self.version, self.error, self.index, self.hasher = version, None, 0, Hasher()
        self.inflight: list[tuple[int, torch.Tensor]] = []
        self.ack_key, self.ack_signal = self.keys.ws_ipc_ack(version), self.keys.ws_ipc_ack_signal(version)
        self.t0 = time.monotonic()
        self.r.delete(self.ack_key, self.ack_signal)
        self._announce(version, self.epoch, self.members, buckets, "cuda_ipc")

    def _wait_acks(self, index: int) -> None:
        """Until every member acknowledged bucket `index` (-1: the trailer). The count lives in a hash (read
        again after a lost reply, unlike a popped list entry); between reads the thread blocks on the acks'
        signal list instead of polling, so it competes for the GIL with the learner's step only per ack."""
        deadline = time.monotonic() + self.timeout_s
        next_check = 0.0  # the first wait looks at membership at once
        while int(self.r.hget(self.ack_key, index) or 0) < len(self.members):
            now = time.monotonic()
            if now >= next_check:  # membership moves at heartbeat pace: look that often
                if silent := set(self.members) - set(self.live_members()):  # a member died: fail now
                    raise TimeoutError(f"members {sorted(silent)} went silent")
                next_check = now + HEARTBEAT_S
            if now > deadline:
                raise TimeoutError(f"bucket {index} of version {self.version} not acknowledged by all of "
                                   f"{self.members} within {self.timeout_s}s")
            # a lost signal costs at most this wait: the count is read again after it
            self.r.blpop([self.ack_signal], timeout=max(ACK_WAIT_MIN_S, min(next_check, deadline) - now))

    def send(self, bucket: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> None:
        handles = None
        if self.members and self.error is None:
            try:
                while len(self.inflight) >= IN_FLIGHT:
                    self._wait_acks(self.inflight.pop(0)[0])
                # no wait for the bucket's writes: each share records a CUDA IPC event after them on this stream,
                # and a member's copy waits for that event on the GPU (open_handle), so the handles go out at once
                handles = member_handles(bucket, len(self.members))
            except Exception as e:
                self._fail(e)
        self.hasher.update_packed(bucket, named)   # queued before the push: the digest is ready the sooner
        if handles is not None and self.error is None:
            try:
                pipe = self.r.pipeline()
                first, start = self.where[named[0][0]]   # the bucket: layout entries [first, first + n)
                for a, meta in zip(self.members, handles):
                    pipe.rpush(self.keys.ws_ipc(a), json.dumps({"v": self.version, "i": self.index, "start": start,
                                                                "first": first, "n": len(named), "ipc": meta}))
                pipe.execute()
                self.inflight.append((self.index, bucket))
            except Exception as e:
                self._fail(e)
        self.index += 1

    def finish(self) -> str | None:
        finish_t0 = time.monotonic()
        csum = self.hasher.hexdigest()
        digest_s = time.monotonic() - finish_t0
        if self.members and self.error is None:
            try:
                # the trailer follows the last bucket at once (a member reads its queue in order): the buckets'
                # acks and the trailer's come back together, one round trip per version fewer
                msg = json.dumps({"v": self.version, "trailer": csum})
                pipe = self.r.pipeline()
                for a in self.members:
                    pipe.rpush(self.keys.ws_ipc(a), msg)
                pipe.execute()
                for i, _b in self.inflight:
                    self._wait_acks(i)
                self._wait_acks(-1)  # every member verified and holds the version
            except Exception as e:
                self._fail(e)
        self.inflight = []
        self.r.delete(self.ack_key, self.ack_signal)
        out = self._conclude(csum, finish_t0)
        self.stats["digest_s"] = digest_s
        return out

    def _fail(self, e: BaseException) -> None:
        log.warning("cuda_ipc publication of version %d (members %s) failed: %s", self.version, self.members, e)
        self.error, self.members = e, []  # re-read membership next attempt
        for a in self.live_members():
            self.r.delete(self.keys.ws_ipc(a))


class CudaIpcSubscriber(WeightSubscriber):
    def __init__(self, r, keys: Keys, *, actor_id: str, device: str = "cuda", timeout_s: float = 30.0):
        super().__init__(r, keys, actor_id=actor_id, timeout_s=timeout_s)
        self.device = torch.device(device)
        if self.device.index is None:  # set_device and IPC need an explicit index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.queue = keys.ws_ipc(actor_id)
        r.delete(self.queue)
        self._start()

    def _receive_loop(self) -> None:
        torch.cuda.set_device(self.device)
        # Copies and fingerprints on a stream of our own: on the engine's they would wait behind its queued forward
        # passes, twice a version (the bucket's copy, the checksum). A delivered version is complete (the checksum
        # synchronized our stream); `take` marks its buffers used on the taker's stream.
        with torch.cuda.stream(torch.cuda.Stream(self.device)):
            self._receive_on_stream()

    def _receive_on_stream(self) -> None:
        lay, bufs, version = None, None, None
        hasher = None   # the version's fingerprints, bucket by bucket as they arrive (None: not in order from the first)
        self._mark(self.held)  # our queue is read from here on (emptied at start): the join server may count on us
        while not self._stop.is_set():
            t = time.monotonic()
            item = self.r.blpop([self.queue], timeout=RECEIVE_POLL_S)
            # blocked while a version was arriving: the publisher's (and Redis's) pace, not ours
            t = self._timed("wait", t) if self._since is not None else time.monotonic()
            if item is None:
                self._received()   # idle: whatever was arriving is over
                if self._leaving.is_set():
                    return
                continue
            self._receiving()
            msg = json.loads(item[1])
            if lay is None:
                lay = json.loads(self.r.hget(self.keys.ws, "layout"))
            if "trailer" in msg:
                if bufs is None or version != msg["v"]:
                    continue  # a version we joined halfway: the next one will be whole
                sd = unpack(bufs, lay)
                # every bucket fingerprinted in order as it came (no GPU wait left), else the whole version now
                got = hasher.hexdigest() if hasher is not None and hasher.count == len(lay) else checksum(sd)
                if got != msg["trailer"]:
                    raise RuntimeError(f"version {version} arrived corrupted: {got} != {msg['trailer']}")
                self._deliver(version, got, sd)
                self._ack(msg["v"], -1)
                self._timed("verify", t)
                self._received()
                bufs = None
                continue
            if msg["v"] != version or bufs is None:  # a new version, or one sent again (a retried attempt):
                version, hasher = msg["v"], None     # fresh buffers (double buffer)
                bufs = {dt: torch.empty(n, dtype=getattr(torch, dt), device=self.device)
                        for dt, n in buffer_sizes(lay).items()}
            if msg["i"] == 0:   # an attempt's first bucket: a retried attempt starts over
                hasher = Hasher()
            elif hasher is not None and hasher.buckets != msg["i"]:
                hasher = None
            src = open_handle(msg["ipc"])   # our stream waits (on the GPU) for the publisher's writes of it
            t = self._timed("open", t)
            dst = bufs[str(src.dtype).removeprefix("torch.")][msg["start"]:msg["start"] + src.numel()]
            entries = lay[msg["first"]:msg["first"] + msg["n"]]
            t = self._copy_in(src, dst, None if hasher is None else
                              lambda: hasher.update_packed(dst, views_at(dst, msg["start"], entries)), t)
            del src
            self._ack(msg["v"], msg["i"])
            self._timed("ack", t)

    def _copy_in(self, src: torch.Tensor, dst: torch.Tensor, fingerprint, t0: float) -> float:
        """`src` copied into `dst` and, behind it, fingerprinted (`fingerprint()`, if given) on our stream, with
        one host wait for both: done before the ack frees the sender's bucket. Timed as `sender` (until our stream
        passed the publisher's writes: the IPC event `open_handle` made it wait for) and `copy` (the GPU's time
        from there, between two timed events: no second wait). A wait on an event, not a stream synchronize, which
        would also wait for whatever another thread queued on the stream meanwhile. Returns when it ended."""
        stream = torch.cuda.current_stream(self.device)
        ready, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ready.record(stream)
        dst.copy_(src)
        if fingerprint is not None:
            fingerprint()
        done.record(stream)
        done.synchronize()
        now = time.monotonic()
        copy_s = min(ready.elapsed_time(done) / 1e3, now - t0)   # ms on the GPU's clock
        self._add("sender", now - t0 - copy_s)
        self._add("copy", copy_s)
        return now

    def take(self) -> WeightVersion | None:
        """As the base's; the version's buffers, made on our stream, are marked used on the taker's (the engine's)
        stream, so that once dropped the allocator reuses them only after the engine's reads of them are done."""
        got = super().take()
        if got is not None:
            stream = torch.cuda.current_stream(self.device)
            for t in {t.untyped_storage().data_ptr(): t for t in got.state_dict.values()}.values():
                t.record_stream(stream)
        return got

    def _ack(self, version: int, index: int) -> None:
        """Count our ack of bucket `index` (-1: the trailer) and wake the publisher."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hincrby(self.keys.ws_ipc_ack(version), index, 1)
        pipe.rpush(self.keys.ws_ipc_ack_signal(version), index)
        pipe.execute()
