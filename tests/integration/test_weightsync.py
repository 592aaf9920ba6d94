"""Weight publication over a real gloo group: learner-side publisher, actor processes subscribing."""
from __future__ import annotations

import multiprocessing as mp
import os

import torch

from buffer.store import Keys
from data.tiny_model import random_tiny_model
from weightsync.flat import checksum
from weightsync.gloo import GlooPublisher


def subscriber_proc(redis_url: str, run_id: str, rank: int, versions: int) -> None:
    """An actor's weight side: its own model (different init), swapping in each version."""
    from buffer.store import connect
    from weightsync.gloo import GlooSubscriber

    r = connect(redis_url)
    model = random_tiny_model(seed=100 + rank)
    r.hset(f"{run_id}:test:initial", rank, checksum(model.state_dict()))
    sub = GlooSubscriber(r, Keys(run_id), rank=rank)
    held = 0
    while held < versions:
        sub.wait(60)
        if (v := sub.take()) is not None:
            model.load_state_dict(v.state_dict)
            held = v.version
            r.hset(f"{run_id}:test:v{v.version}", rank, checksum(model.state_dict()))
    # The receiver thread is still inside a gloo collective; a normal interpreter exit would run
    # gloo's destructors under it and abort (SIGABRT) on this torch. Results are in Redis already.
    os._exit(0)


def test_every_actor_holds_the_learner_checksum(redis_url, run_id, r):
    ctx = mp.get_context("spawn")
    n_actors, versions = 2, 2
    keys = Keys(run_id)
    pub = GlooPublisher(r, keys, world_size=n_actors + 1, timeout_s=60)
    procs = [ctx.Process(target=subscriber_proc, args=(redis_url, run_id, rank, versions))
             for rank in range(1, n_actors + 1)]
    for p in procs:
        p.start()
    learner = random_tiny_model(seed=0)
    published = {}
    for version in range(1, versions + 1):
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(0.01 * version)
        published[version] = pub.publish(version, learner.state_dict())
        assert published[version] == checksum(learner.state_dict())
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert published[1] != published[2]
    for version, csum in published.items():
        held = {int(k): v.decode() for k, v in r.hgetall(f"{run_id}:test:v{version}").items()}
        assert held == {1: csum, 2: csum}, f"version {version}"
        assert r.hget(keys.checksums, version).decode() == csum
    initial = {v.decode() for v in r.hgetall(f"{run_id}:test:initial").values()}
    assert published[2] not in initial  # the weights really changed on the actors


def test_engine_refuses_weights_with_a_wrong_checksum(tmp_path):
    import pytest

    from actors.hf_engine import HFEngine
    from data.tokenizer import build_byte_tokenizer

    model = random_tiny_model(seed=1)
    model.save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    engine = HFEngine(str(tmp_path))
    other = random_tiny_model(seed=2).state_dict()
    with pytest.raises(RuntimeError, match="checksum"):
        engine.load_weights(other, 1, "0" * 16)
    engine.load_weights(other, 2, checksum(other))
    assert engine.version == 2 and engine.checksum == checksum(other)
