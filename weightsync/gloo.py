"""Weight publication over gloo, bucketed and elastic (CPU; the reference backend).

Membership: every subscriber heartbeats into `<run>:ws:members`. Each publication, the
publisher takes the members heard from within MEMBER_STALE_S; if the set changed, it opens a
new epoch: a fresh gloo group under the prefix `ws/e<epoch>` of one TCPStore (address in
Redis). It then announces the attempt in the `<run>:ws:announce` stream (version, epoch,
ranks, buckets) and broadcasts the buckets, then a trailer [version, checksum]. A member
that dies makes an operation time out (weightsync.timeout_s); the attempt fails, the dead
member's heartbeat goes stale, and the learner retries the version in a new epoch without it.
A member that joins is in the next publication's epoch. Nothing here can block the learner
for longer than the timeouts.

Subscribers receive on a background thread into fresh buffers (a double buffer: the
actor keeps generating with the previous version) and hand over only complete versions
whose checksum matches the trailer.
"""
from __future__ import annotations

import json
import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from runbase.keys import Keys
from weightsync.core import MEMBER_STALE_S, WeightPublisher, WeightSubscriber
from weightsync.flat import Hasher, buffer_sizes, checksum, unpack
from weightsync.store import client_store, master_store

log = logging.getLogger(__name__)

ANNOUNCE_BLOCK_MS = 500  # a subscriber's wait for announcements per call (keeps leave/close prompt)
ADDRESS_POLL_S = 0.05    # how often a subscriber looks for the publisher's announced address
LEAVE_QUIET_S = 2 * MEMBER_STALE_S  # a leaving member keeps serving announcements this long at most


def _csum_to_int(c: str) -> int:
    return int(c, 16) - 2**63  # fits a signed int64


def _int_to_csum(i: int) -> str:
    return f"{i + 2**63:016x}"


class GlooTransport:
    """How a broadcast backend makes an epoch's group and waits on a collective; both sides of a
    backend (publisher and subscriber) share one transport."""

    def _group(self, store, rank: int, world: int, timeout: timedelta):
        return dist.ProcessGroupGloo(store, rank, world, timeout)

    def _wait(self, work) -> None:
        work.wait()  # gloo raises once the group's timeout passes


class CollectivePublisher(GlooTransport, WeightPublisher):
    """Learner rank 0's side of a broadcast backend (a process group per membership epoch).
    Use begin() / send() per bucket / finish(), or publish(). Subclasses set the backend name,
    the device of the buffers and how a group is made and waited on."""

    backend = "gloo"
    device = torch.device("cpu")

    def __init__(self, r, keys: Keys, *, timeout_s: float, host: str = "127.0.0.1"):
        self.r, self.keys = r, keys
        self.timeout = timedelta(seconds=timeout_s)
        self.store = master_store(host, 0, self.timeout)  # listens on `host` only
        r.hset(keys.ws, mapping={"addr": f"{host}:{self.store.port}", "backend": self.backend})
        self.epoch, self.members, self.pg = 0, [], None
        self.stats: dict[str, float] = {}

    def begin(self, version: int, lay: list[list], buckets: list[dict], members: list[str] | None = None) -> None:
        self._check_layout(lay)
        members = self.live_members() if members is None else sorted(members)
        if members != self.members or self.pg is None:
            self.epoch += 1
            self.members, self.pg = members, None
        self.version, self.error, self.work, self.hasher = version, None, None, Hasher()
        self.t0 = time.monotonic()
        self._announce(version, self.epoch, self.members, buckets, self.backend)
        if self.members and self.pg is None:
            try:
                self.pg = self._group(dist.PrefixStore(f"ws/e{self.epoch}", self.store), 0,
                                      len(self.members) + 1, self.timeout)
            except Exception as e:  # a member announced alive did not join in time
                self._fail(e)

    def send(self, bucket: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one bucket (kept alive until sent); its checksum share, and the caller's
        gathering of the next bucket, overlap with the transfer (gloo sends on its own thread)."""
        if self.pg is not None and self.error is None:
            try:
                if self.work is not None:
                    self._wait(self.work)
                self.work = self.pg.broadcast(bucket, 0)
                self._inflight = bucket
            except Exception as e:
                self._fail(e)
        self.hasher.update_packed(bucket, named)

    def finish(self) -> str | None:
        """Checksum of the version once every member has it; None if this attempt failed."""
        finish_t0 = time.monotonic()
        csum = self.hasher.hexdigest()
        if self.pg is not None and self.error is None:
            try:
                if self.work is not None:
                    self._wait(self.work)
                trailer = torch.tensor([self.version, _csum_to_int(csum)], dtype=torch.int64, device=self.device)
                self._wait(self.pg.broadcast(trailer, 0))
            except Exception as e:
                self._fail(e)
        self._inflight = self.work = None
        return self._conclude(csum, finish_t0)

    def _fail(self, e: BaseException) -> None:
        log.warning("weight publication of version %d (epoch %d, members %s) failed: %s; retrying without "
                    "silent members", self.version, self.epoch, self.members, e)
        self._drop_group()
        self.error, self.pg = e, None

    def _drop_group(self) -> None:
        pass


class GlooPublisher(CollectivePublisher):
    """Through host memory: works everywhere (the reference backend)."""


class CollectiveSubscriber(GlooTransport, WeightSubscriber):
    """An actor's side of a broadcast backend: buffers on `device`, one group per epoch."""

    def __init__(self, r, keys: Keys, *, actor_id: str, timeout_s: float = 30.0, device: str = "cpu"):
        super().__init__(r, keys, actor_id=actor_id, timeout_s=timeout_s)
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device(device)
        self.epoch, self.pg = None, None
        self._start()

    def _receive_loop(self) -> None:
        while not (info := self.r.hgetall(self.keys.ws)).get(b"addr"):
            if self._stop.wait(ADDRESS_POLL_S):
                return
        host, port = info[b"addr"].decode().rsplit(":", 1)
        store = client_store(host, int(port), self.timeout)
        last = self.r.xrevrange(self.keys.ws_announce, count=1)
        last_id = last[0][0] if last else "0-0"
        self._mark(self.held)  # listening from here on: the join server may count on us now
        left_at = None
        lay = None
        while not self._stop.is_set():
            res = self.r.xread({self.keys.ws_announce: last_id}, block=ANNOUNCE_BLOCK_MS)
            if self._leaving.is_set():
                left_at = left_at or time.monotonic()
            if not res:
                if left_at and time.monotonic() - left_at > LEAVE_QUIET_S:
                    return
                continue
            entry_id, fields = res[0][1][-1]  # older attempts have finished or failed already
            last_id = entry_id
            ranks = json.loads(fields[b"ranks"])
            if self.actor_id not in ranks:
                if left_at:
                    return  # the publisher no longer counts on us: leaving is clean
                continue
            if lay is None:
                lay = json.loads(self.r.hget(self.keys.ws, "layout"))
            self._receiving()
            try:
                self._receive(store, fields, ranks[self.actor_id], len(ranks) + 1, lay)
            finally:
                self._received()

    def _receive(self, store, fields, rank: int, world: int, lay) -> None:
        epoch = int(fields[b"epoch"])
        self._mark(int(fields[b"v"]))  # before joining: the publication's end implies every mark
        try:
            if epoch != self.epoch:
                self.epoch, self.pg = epoch, None
                self.pg = self._group(dist.PrefixStore(f"ws/e{epoch}", store), rank, world, self.timeout)
            bufs = {dt: torch.empty(n, dtype=getattr(torch, dt), device=self.device)
                    for dt, n in buffer_sizes(lay).items()}
            for dt, start, end in json.loads(fields[b"buckets"]):
                self._wait(self.pg.broadcast(bufs[dt][start:end], 0))
            trailer = torch.empty(2, dtype=torch.int64, device=self.device)
            self._wait(self.pg.broadcast(trailer, 0))
        except Exception as e:  # the publisher gave up on this attempt (a member died): wait for the retry
            log.warning("%s: weight receive in epoch %d failed (%s); waiting for the next attempt",
                        self.actor_id, epoch, e)
            self.failed_attempts += 1
            self.epoch, self.pg = None, None
            self._mark(self.held)  # not received: the join server may send it again
            return
        version, csum = int(trailer[0]), _int_to_csum(int(trailer[1]))
        sd = unpack(bufs, lay)
        if (got := checksum(sd)) != csum:
            raise RuntimeError(f"weights of version {version} arrived corrupted: checksum {got} != {csum}")
        self._deliver(version, csum, sd)


class GlooSubscriber(CollectiveSubscriber):
    pass
