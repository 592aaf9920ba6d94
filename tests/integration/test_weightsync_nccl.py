"""GPU twin of test_weightsync.py: the NCCL backend, publisher on GPU 0, actors on the other GPUs,
one of them joining late; each ends holding every version's exact checksum. Needs >= 2 GPUs
(`pytest -m gpu`); the same protocol runs over gloo on CPU in test_weightsync.py."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from runbase.keys import Keys
from test_weightsync import follow_versions
from weightsync.flat import checksum

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL publication needs two GPUs")]

TIMEOUT_S = 30.0  # NCCL communicator set-up for a new epoch happens inside this


def subscriber_proc(redis_url: str, run_id: str, actor_id: str, gpu: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    from data.tiny_model import random_tiny_model
    from runbase.keys import connect
    from weightsync.nccl import NcclSubscriber

    r = connect(redis_url)
    model = random_tiny_model(seed=gpu).cuda()
    sub = NcclSubscriber(r, Keys(run_id), actor_id=actor_id, timeout_s=TIMEOUT_S)
    follow_versions(r, sub, model, run_id, actor_id, leave_key=f"{run_id}:test:leave")
    os._exit(0)


def test_nccl_publication_reaches_every_gpu_actor(redis_url, run_id, r):
    from data.tiny_model import random_tiny_model
    from weightsync.nccl import NcclPublisher

    torch.cuda.set_device(0)
    pub = NcclPublisher(r, Keys(run_id), timeout_s=TIMEOUT_S, device="cuda:0")
    model = random_tiny_model(seed=0).cuda()
    ctx = mp.get_context("spawn")
    gpus = list(range(1, torch.cuda.device_count()))
    procs = [ctx.Process(target=subscriber_proc, args=(redis_url, run_id, f"a{g}", g)) for g in gpus]
    procs[0].start()
    try:
        for version in (1, 2, 3):
            if version == 2:  # the others join between versions: a new epoch, a new communicator
                for p in procs[1:]:
                    p.start()
            deadline = time.monotonic() + 60
            while len(pub.live_members()) < (1 if version == 1 else len(procs)):
                assert time.monotonic() < deadline, "subscribers never joined"
                time.sleep(0.1)
            with torch.no_grad():
                next(model.parameters()).add_(1)
            csum = pub.publish(version, model.state_dict(), bucket_bytes=20_000)
            assert csum == checksum(model.state_dict())
            deadline = time.monotonic() + 60
            want = {f"a{g}" for g in (gpus[:1] if version == 1 else gpus)}
            while set(k.decode() for k in r.hkeys(f"{run_id}:test:v{version}")) != want:
                assert time.monotonic() < deadline, f"version {version} never applied"
                time.sleep(0.05)
            assert {v.decode() for v in r.hvals(f"{run_id}:test:v{version}")} == {csum}
    finally:
        r.set(f"{run_id}:test:leave", 1)
        for p in procs:
            if p.pid is not None:
                p.join(30)
