"""The learner's weight publication: version k+1 after step k, every weightsync.sync_every steps and after
the last; full tensors (with learner.lora the adapter's alone) gathered one bucket at a time (collective over
the learner group), cast to the engines' dtype (weightsync.dtype) and sent by rank 0, which keeps the last
version for members that join later (its join server). With weightsync.overlap on one rank the acks are
awaited on a thread while the next step trains."""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch
import torch.distributed as dist

from engines.lora import published_state
from learner import metric_names as M
from learner.model import gather_full
from learner.phases import PhaseReport
from runbase.net import local_host
from weightsync.backends import publisher
from weightsync.config import WeightSyncConfig
from weightsync.core import flatten, short_switch
from weightsync.flat import layout_from_meta, plan_buckets, wire_dtype
from weightsync.join import JoinServer, LastVersion

log = logging.getLogger(__name__)

PUBLISH_ATTEMPTS = 3        # a version is retried this often (each without newly silent members)
MEMBER_STALE_WAIT_S = 3.5   # > weightsync.gloo.MEMBER_STALE_S: a dead member is then visibly stale


class Publication:
    def __init__(self, ws: WeightSyncConfig, *, model, rank: int, world: int, group, device: torch.device,
                 report: PhaseReport, r=None, keys=None, bind_host: str = "127.0.0.1"):
        """`ws.backend` resolved; `r`, `keys` on rank 0, whose publisher's store listens on `bind_host`."""
        self.ws, self.model, self.rank, self.world, self.group, self.report = ws, model, rank, world, group, report
        self._finishing: threading.Thread | None = None  # an overlapped publication's wait for its acks
        self.device = "cpu"  # where every rank gathers the buckets (the device, for a device-to-device transport)
        if rank == 0:
            # the weight-sync store's announced address (runbase/net.py)
            self.publisher = publisher(ws.backend, r, keys, timeout_s=ws.timeout_s, device=device,
                                       host=local_host(bind_host))
            self.device = device if ws.backend in ("cuda_ipc", "nccl") else "cpu"
            # the last version gathered, sent at once to members that join (restarted, new, scaled up)
            self.last_version = LastVersion()
            self.joins = JoinServer(self.publisher, r, keys, self.last_version, device=self.device)

    def start(self) -> None:
        """Rank 0's join server begins serving members that join."""
        if self.rank == 0:
            self.joins.start()

    def publish_if_due(self, version: int, *, last: bool) -> None:
        """Collective: `version` published every weightsync.sync_every steps and at the `last` step (waited for)."""
        if version % self.ws.sync_every == 0 or last:
            self.report.phase("publish", version)
            self.publish(version, wait=last)

    def publish(self, version: int, *, wait: bool = True) -> None:
        """Collective over the learner group: gather full tensors one bucket at a time (rank 0
        broadcasts bucket i while every rank gathers bucket i+1) and retry without dead members.
        With `weightsync.overlap` on one rank and not `wait`, the acks are awaited on a thread
        while the next step runs (`join`)."""

        self.join()
        # sharded DTensors (or plain tensors on one rank): global shapes; with LoRA the adapter's alone
        sd = published_state(self.model)
        wire = self.ws.dtype  # the engines' dtype: cast after the gather, one bucket at a time
        lay = layout_from_meta((n, wire_dtype(t.dtype, wire), tuple(t.shape)) for n, t in sd.items())
        buckets = plan_buckets(lay, int(self.ws.bucket_mb * 2**20))
        overlap = not wait and self.world == 1 and self.ws.overlap
        locked = self.rank == 0 and self.joins.lock.acquire()  # the join server keeps off until the end
        try:
            for _attempt in range(PUBLISH_ATTEMPTS):
                self._send_version(version, sd, lay, buckets, copy=overlap)
                if overlap:
                    self._finishing = threading.Thread(target=self._finish, args=(version, True), daemon=True)
                    self._finishing.start()
                    locked = False  # released by the thread, once the version's acks are in
                    return
                ok = torch.tensor([1 if self.rank != 0 or self._finish(version) else 0])
                dist.broadcast(ok, 0, group=self.group)
                if ok.item():
                    return
                if self.rank == 0:  # let a dead member's heartbeat go stale so the next epoch leaves it out
                    time.sleep(MEMBER_STALE_WAIT_S)
            log.error("version %d reached no actor after %d attempts; the join server sends it to live members "
                      "that lack it", version, PUBLISH_ATTEMPTS)
        finally:
            if locked:
                self.joins.lock.release()

    def _send_version(self, version: int, sd, lay, buckets, *, copy: bool) -> None:
        """One attempt's buckets: every rank gathers each (collective), rank 0 sends it and keeps it
        in `last_version` (what the join server sends to members that join later)."""

        if self.rank == 0:
            self.publisher.begin(version, lay, buckets)
            self.last_version.begin(version, lay, buckets)
        for b in buckets:
            full = gather_full([sd[n] for n in b["names"]], self.device)
            named = [(n, t.to(wire_dtype(t.dtype, self.ws.dtype))) for n, t in zip(b["names"], full)]
            if self.rank == 0:
                flat = flatten(named, copy=copy)
                self.publisher.send(flat, named)
                self.last_version.put(b, flat)
        if self.rank == 0:
            self.last_version.complete()

    def _finish(self, version: int, release: bool = False) -> bool:
        """Rank 0: the end of a publication (every member's acks, the checksum round); True if it arrived.
        `release`: an overlapped publication's thread hands the publisher back to the join server."""
        try:
            with short_switch() if release else contextlib.nullcontext():
                ok = self.publisher.finish() is not None
            if not ok:
                return False
            log.info("published version %d: %s", version, self.publisher.stats)
            return True
        finally:
            if release:
                self.joins.lock.release()

    def join(self) -> None:
        """Wait for an overlapped publication's end (before the next one, and before the run ends)."""
        if self._finishing is not None:
            self._finishing.join()
            self._finishing = None

    def close(self) -> None:
        """After the last step: the last publication's end; rank 0's join server stopped."""
        self.join()
        if self.rank == 0:
            self.joins.close()

    def line_fields(self) -> dict:
        """Rank 0: the publisher's numbers for a step's metrics line."""
        return {**{M.PUBLISHER_STATS[k]: v for k, v in self.publisher.stats.items()}, M.WS_JOINS: self.joins.served}
