"""weightsync/cuda_ipc.py: every member gets its own IPC share of a bucket.

The GPU twin (tests/integration/test_gpu_paths.py) publishes to two real actors and checks that the
publisher's GPU memory does not grow; here torch's reference counting is modelled as its C++ code
does it (torch/csrc/CudaIPCTypes.cpp: each share gets a fresh uint64 counter set to 1, a receiver
subtracts 1 from the counter of the handle it opened when it lets go, and a block is freed only
when the counters of all its shares read 0). One handle read by two members, as before, takes its
counter from 1 to 2**64 - 1, and the block is never freed."""
from __future__ import annotations

import pytest
import torch

from weightsync.cuda_ipc import member_handles

pytestmark = pytest.mark.unit

U64 = 2**64


class SharedBlock:
    """torch's bookkeeping for one shared CUDA block, as plain numbers."""

    def __init__(self):
        self.counters: list[int] = []

    def share(self, _t) -> dict:
        self.counters.append(1)
        return {"counter": len(self.counters) - 1}

    def release(self, handle: dict) -> None:  # a receiver drops the tensor it opened
        self.counters[handle["counter"]] = (self.counters[handle["counter"]] - 1) % U64

    def freed(self) -> bool:
        return all(c == 0 for c in self.counters)


@pytest.mark.parametrize("members", [1, 2, 5])
def test_one_share_per_member_frees_the_bucket_once_all_have_copied(members):
    block = SharedBlock()
    handles = member_handles(torch.zeros(4), members, share=block.share)
    assert len(handles) == members and len({h["counter"] for h in handles}) == members
    for h in handles[:-1]:
        block.release(h)
        assert not block.freed()  # a member still maps it: the publisher must keep it
    block.release(handles[-1])
    assert block.freed()
