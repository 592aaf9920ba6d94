"""The learner's last published version, sent at once to members that join between publications.

A restarted, new or scaled-up actor starts on the base model (version 0). If the learner is further
ahead than admission allows (`buffer.max_staleness`), that actor may not lease a prompt until it holds
newer weights, and the learner publishes only after a training step, which needs groups: with every
actor restarted nobody can make one and the job waits forever. So learner rank 0 keeps the version it
last published on the host (`LastVersion`: one copy of the model, one flat buffer per dtype, filled
bucket by bucket as the publication gathers them) and a thread (`JoinServer`) sends it to every live
member that holds an older one, within about a heartbeat of the member starting to listen. It uses the
publisher's own protocol (a membership epoch of the joiners only, the buckets, the checksum trailer,
which the subscriber verifies), and no collective of the learner group: it works while rank 0 waits
in `next_batch`, trains or evaluates, whatever the number of ranks. `lock` keeps the thread and the
learner's own publications off the publisher at the same time.

Which version a member holds: its subscriber writes it into `<run>:ws:held` once its receive loop
listens (0: the base model), before it takes part in a version (gloo, nccl: reverted if the attempt
fails) and when it delivers one (cuda_ipc: before its final ack). So every member of a completed
publication reads as holding its version, and a member without an entry is not listening yet.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from weightsync.flat import bucket_views, buffer_sizes

log = logging.getLogger(__name__)

JOIN_POLL_S = 0.5  # how often rank 0 looks for joiners: a subscriber's heartbeat period (weightsync.core)


class LastVersion:
    """Rank 0's host copy of the newest version it gathered (published or not), bucket by bucket.

    `begin` / `put` per bucket / `complete`, in the publication's own loop; `version` is None while
    a version is being written, so a reader never sees a half-overwritten one."""

    def __init__(self):
        self.version: int | None = None
        self.lay: list[list] | None = None
        self.buckets: list[dict] | None = None
        self.bufs: dict[str, torch.Tensor] | None = None
        self._ready = None       # CUDA event after the last device-to-host copy (GPU buckets)
        self._writing = None     # (version, layout, buckets) being written

    def begin(self, version: int, lay: list[list], buckets: list[dict]) -> None:
        self.version, self._writing = None, (version, lay, buckets)

    def put(self, bucket: dict, flat: torch.Tensor) -> None:
        """Copy one gathered bucket (CPU or GPU) into its range; from a GPU without stalling the host
        (pinned memory; `complete` records the event a reader waits on)."""
        if self.bufs is None:
            self.bufs = {dt: torch.empty(n, dtype=getattr(torch, dt), pin_memory=flat.is_cuda)
                         for dt, n in buffer_sizes(self._writing[1]).items()}
        self.bufs[bucket["dtype"]][bucket["start"]:bucket["end"]].copy_(flat, non_blocking=flat.is_cuda)
        if flat.is_cuda and self._ready is None:
            self._ready = torch.cuda.Event()

    def complete(self) -> None:
        if self._ready is not None:
            self._ready.record()  # on the stream the copies were issued on
        self.version, self.lay, self.buckets = self._writing

    def bucket(self, b: dict, device) -> torch.Tensor:
        """One bucket of the complete version, on `device` (a view of the host copy on the CPU)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self.bufs[b["dtype"]][b["start"]:b["end"]].to(device)


class JoinServer:
    """Rank 0's thread that sends `last` to every live member holding an older version (a joiner)."""

    def __init__(self, publisher, r, keys, last: LastVersion, *, device="cpu"):
        self.publisher, self.r, self.keys, self.last = publisher, r, keys, last
        self.device = torch.device(device)
        self.lock = threading.Lock()  # held by every publication, the learner's and this thread's
        self.served = 0               # join publications that reached their members
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ws-join", daemon=True)

    def start(self) -> "JoinServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def joiners(self) -> list[str]:
        """Live members listening with a version older than the last one (none before one exists)."""
        if self.last.version is None:
            return []
        held = {a.decode(): int(v) for a, v in self.r.hgetall(self.keys.ws_held).items()}
        return [m for m in self.publisher.live_members() if m in held and held[m] < self.last.version]

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: NCCL groups and IPC handles on the publisher's GPU
        while not self._stop.wait(JOIN_POLL_S):
            if not self.lock.acquire(blocking=False):
                continue  # a publication is running: it reaches every live member itself
            try:
                if joiners := self.joiners():
                    self.serve(joiners)
            except Exception as e:  # a Redis outage or a broken attempt: look again next time
                log.warning("sending version %s to joining members failed: %s", self.last.version, e)
            finally:
                self.lock.release()

    def serve(self, joiners: list[str]) -> bool:
        """One attempt of the last version to `joiners` (caller holds `lock`); True if all of them have it.
        The publisher's stats stay those of the learner's last publication (they go on its metrics line)."""
        lv, pub, t0 = self.last, self.publisher, time.monotonic()
        stats = dict(pub.stats)
        if getattr(pub, "pg", None) is not None:  # joiners are new processes (a restarted actor keeps its id):
            pub._drop_group()                     # never the old group, whose peer may be dead; a new epoch
            pub.pg = None
        try:
            pub.begin(lv.version, lv.lay, lv.buckets, members=joiners)
            for b in lv.buckets:
                flat = lv.bucket(b, self.device)
                pub.send(flat, bucket_views(flat, b, lv.lay))
            ok = pub.finish() is not None
        finally:
            pub.stats = stats  # the learner's metrics line keeps describing its own publication
        if ok:
            self.served += 1
            log.info("sent version %d to joining members %s in %.2fs", lv.version, joiners, time.monotonic() - t0)
        return ok
