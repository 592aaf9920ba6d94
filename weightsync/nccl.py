"""Weight publication over NCCL: learner rank 0's GPU broadcasts to actors on other GPUs.

The same protocol as gloo (weightsync/gloo.py: epochs, announcements, buckets, trailer with the
checksum), with the buffers on the GPUs: buckets go device to device over NVLink/PCIe (or the
network between hosts), and both sides fingerprint the weights where they live. NCCL cannot
time out by itself without tearing the process down, so every wait is a CPU-side poll of the
work with a deadline (weightsync.timeout_s); an expired attempt aborts the epoch's
communicator (only that group: the learner's own group is separate) and the publisher
retries without the silent member, as with gloo.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from weightsync.gloo import CollectivePublisher, CollectiveSubscriber

WAIT_POLL_S = 0.0005  # CPU poll of an in-flight broadcast: short next to a bucket's transfer time


def nccl_group(store, rank: int, world: int, timeout: timedelta, device: torch.device):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg = dist.ProcessGroupNCCL(store, rank, world, opts)
    if hasattr(pg, "eager_connect_single_device"):  # form the communicator now, not in the first bucket
        pg.eager_connect_single_device(device)
    return pg


def wait_with_deadline(work, timeout: timedelta) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"NCCL broadcast did not complete within {timeout.total_seconds():.0f}s")
        time.sleep(WAIT_POLL_S)
    work.wait()  # surfaces an error the communicator reported


def abort(pg) -> None:
    try:
        pg.abort()
    except Exception:  # already torn down, or this torch has no abort: the group is dropped anyway
        pass


class NcclTransport:
    """Groups on `self.device`; every wait a CPU poll with a deadline of `self.timeout`."""

    def _group(self, store, rank, world, timeout):
        return nccl_group(store, rank, world, timeout, self.device)

    def _wait(self, work) -> None:
        wait_with_deadline(work, self.timeout)


class NcclPublisher(NcclTransport, CollectivePublisher):
    backend = "nccl"

    def __init__(self, r, keys, *, timeout_s: float, device, host: str = "127.0.0.1"):
        self.device = torch.device(device)
        super().__init__(r, keys, timeout_s=timeout_s, host=host)

    def _drop_group(self) -> None:
        if self.pg is not None:
            abort(self.pg)


class NcclSubscriber(NcclTransport, CollectiveSubscriber):
    def __init__(self, r, keys, *, actor_id: str, timeout_s: float = 30.0, device: str = "cuda"):
        dev = torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(r, keys, actor_id=actor_id, timeout_s=timeout_s, device=str(dev))

    def _receive_loop(self) -> None:
        torch.cuda.set_device(self.device)
        super()._receive_loop()
