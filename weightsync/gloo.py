"""Weight publication over a dedicated gloo process group (CPU).

The group (publisher rank 0, actor i at rank i+1) is built from a TCPStore whose address
the publisher announces in Redis; it is separate from the learner group, so actors never
join the learner's collectives. Per version: a header [version, checksum] is broadcast,
then one flat buffer per dtype (layout in Redis). Subscribers receive on a background
thread into fresh buffers and hand over only complete, checksum-verified versions.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from buffer.store import Keys
from weightsync.core import WeightPublisher, WeightSubscriber, WeightVersion
from weightsync.flat import buffer_sizes, checksum, layout, pack, unpack

log = logging.getLogger(__name__)

# Subscribers wait in a broadcast between versions; a slow learner step is not a failure,
# so their gloo timeout is long. The publisher's is the config's timeout_s.
SUBSCRIBER_IDLE_TIMEOUT = timedelta(hours=6)
ADDRESS_POLL_S = 0.05   # how often a subscriber looks for the publisher's announced address
PREFIX = "ws/epoch0"    # membership epochs (elastic groups) arrive with the weight-sync issue


def _csum_to_int(c: str) -> int:
    return int(c, 16) - 2**63  # fits a signed int64


def _int_to_csum(i: int) -> str:
    return f"{i + 2**63:016x}"


class GlooPublisher(WeightPublisher):
    def __init__(self, r, keys: Keys, *, world_size: int, timeout_s: float, host: str = "127.0.0.1"):
        self.r, self.keys, self.world = r, keys, world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                                   timeout=self.timeout)
        r.hset(keys.ws, mapping={"addr": f"{host}:{self.store.port}", "world": world_size})
        self.pg = None
        self.layout = None

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> str:
        lay = layout(state_dict)
        if self.layout is None:
            self.layout = lay
            self.r.hset(self.keys.ws, "layout", json.dumps(lay))
        elif lay != self.layout:
            raise ValueError("model layout changed between versions; weight sync needs a fixed layout")
        csum = checksum(state_dict)
        bufs = pack(state_dict, lay)
        if self.pg is None:
            t0 = time.monotonic()
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore(PREFIX, self.store), 0, self.world, self.timeout)
            log.info("weight-sync group of %d ready in %.2fs", self.world, time.monotonic() - t0)
        self.pg.broadcast(torch.tensor([version, _csum_to_int(csum)], dtype=torch.int64), 0).wait()
        for dt in sorted(bufs):
            self.pg.broadcast(bufs[dt], 0).wait()
        self.r.hset(self.keys.checksums, version, csum)
        return csum


class GlooSubscriber(WeightSubscriber):
    def __init__(self, r, keys: Keys, *, rank: int):
        self.r, self.keys, self.rank = r, keys, rank
        self._lock = threading.Lock()
        self._pending: WeightVersion | None = None
        self._event = threading.Event()
        self.error: BaseException | None = None
        self.received = 0  # versions fully received so far (read by the actor to see mid-batch arrivals)
        self._thread = threading.Thread(target=self._run, name=f"weights-rank{rank}", daemon=True)
        self._thread.start()

    def _connect(self):
        while not (info := self.r.hgetall(self.keys.ws)).get(b"addr"):
            time.sleep(ADDRESS_POLL_S)
        host, port = info[b"addr"].decode().rsplit(":", 1)
        world = int(info[b"world"])
        if not 0 < self.rank < world:
            raise ValueError(f"weight-sync rank {self.rank} outside the group of {world}")
        store = dist.TCPStore(host, int(port), world, is_master=False, timeout=SUBSCRIBER_IDLE_TIMEOUT)
        return dist.ProcessGroupGloo(dist.PrefixStore(PREFIX, store), self.rank, world, SUBSCRIBER_IDLE_TIMEOUT)

    def _run(self):
        try:
            pg = self._connect()
            lay = None
            while True:
                header = torch.empty(2, dtype=torch.int64)
                pg.broadcast(header, 0).wait()
                version, csum = int(header[0]), _int_to_csum(int(header[1]))
                if lay is None:  # written by the publisher before its first header
                    lay = json.loads(self.r.hget(self.keys.ws, "layout"))
                bufs = {dt: torch.empty(n, dtype=getattr(torch, dt)) for dt, n in buffer_sizes(lay).items()}
                for dt in sorted(bufs):
                    pg.broadcast(bufs[dt], 0).wait()
                sd = unpack(bufs, lay)
                got = checksum(sd)
                if got != csum:
                    raise RuntimeError(f"weights of version {version} arrived corrupted: checksum {got} != {csum}")
                with self._lock:
                    self._pending = WeightVersion(version=version, checksum=csum, state_dict=sd)
                    self.received += 1
                self._event.set()
        except BaseException as e:  # surfaced to the actor's loop by take()
            self.error = e
            self._event.set()

    def take(self) -> WeightVersion | None:
        if self.error is not None:
            raise RuntimeError(f"weight subscriber (rank {self.rank}) failed: {self.error}") from self.error
        with self._lock:
            p, self._pending = self._pending, None
            self._event.clear()
        return p

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)
