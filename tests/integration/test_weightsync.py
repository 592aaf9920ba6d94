"""Weight publication over real gloo groups: learner-side publisher, actor processes subscribing,
members dying, joining and leaving between versions."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

import ranks
from data.tiny_model import random_tiny_model
from runbase.keys import Keys
from weightsync.flat import checksum
from weightsync.gloo import MEMBER_STALE_S, GlooPublisher

TIMEOUT_S = 3.0  # broadcast timeout in these tests: a dead member costs this much, not more


def subscriber_proc(redis_url: str, run_id: str, actor_id: str) -> None:
    """An actor's weight side: its own model (different init), swapping in each version,
    recording the checksum of what it then holds; leaves when told to."""
    from runbase.keys import connect
    from weightsync.gloo import GlooSubscriber

    r = connect(redis_url)
    model = random_tiny_model(seed=hash(actor_id) % 1000)
    r.hset(f"{run_id}:test:initial", actor_id, checksum(model.state_dict()))
    sub = GlooSubscriber(r, Keys(run_id), actor_id=actor_id, timeout_s=TIMEOUT_S)
    follow_versions(r, sub, model, run_id, actor_id, leave_key=f"{run_id}:test:leave:{actor_id}")
    sub.leave()
    r.set(f"{run_id}:test:left:{actor_id}", 1)
    # gloo's destructors under a thread still inside a collective abort at exit on this torch
    os._exit(0)


def follow_versions(r, sub, model, run_id: str, actor_id: str, *, leave_key: str) -> None:
    """Swap each version the subscriber completes into `model` and record the checksum it then
    holds (`<run>:test:v<version>`), and the subscriber's count of versions received and their receipt's seconds
    (`<run>:test:receipt`), until `leave_key` exists."""
    while not r.exists(leave_key):
        sub.wait(0.2)
        if (v := sub.take()) is not None:
            model.load_state_dict(v.state_dict)
            r.hset(f"{run_id}:test:receipt", actor_id, json.dumps([sub.received, sub.receive_s_sum]))
            r.hset(f"{run_id}:test:v{v.version}", actor_id, checksum(model.state_dict()))


def wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def publish(pub, version, model, attempts=3):
    """What the learner does: retry a version until the live members have it."""
    for _ in range(attempts):
        t0 = time.monotonic()
        csum = pub.publish(version, model.state_dict(), bucket_bytes=20_000)  # several buckets
        assert time.monotonic() - t0 < 3 * TIMEOUT_S  # never hangs on a dead member
        if csum is not None:
            return csum
        time.sleep(MEMBER_STALE_S + 0.5)
    pytest.fail(f"version {version} never published")


def held(r, run_id, version):
    return {k.decode(): v.decode() for k, v in r.hgetall(f"{run_id}:test:v{version}").items()}


def test_members_die_join_and_leave_between_versions(redis_url, run_id, r):
    ctx = ranks.context()
    keys = Keys(run_id)
    pub = GlooPublisher(r, keys, timeout_s=TIMEOUT_S)
    procs = {a: ctx.Process(target=subscriber_proc, args=(redis_url, run_id, a)) for a in ("a0", "a1", "a2")}
    for p in procs.values():
        p.start()
    wait_for(lambda: pub.live_members() == ["a0", "a1", "a2"], what="3 members")
    learner = random_tiny_model(seed=0)

    def step(version):
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(0.01)
        return publish(pub, version, learner)

    c1 = step(1)
    assert c1 == checksum(learner.state_dict())
    wait_for(lambda: held(r, run_id, 1) == {"a0": c1, "a1": c1, "a2": c1}, what="v1 everywhere")

    os.kill(procs["a1"].pid, signal.SIGKILL)            # dies between versions
    c2 = step(2)
    wait_for(lambda: held(r, run_id, 2) == {"a0": c2, "a2": c2}, what="v2 on survivors")

    procs["a3"] = ctx.Process(target=subscriber_proc, args=(redis_url, run_id, "a3"))
    procs["a3"].start()                                   # joins: in the next publication
    wait_for(lambda: "a3" in pub.live_members(), what="a3 registered")
    c3 = step(3)
    wait_for(lambda: held(r, run_id, 3) == {"a0": c3, "a2": c3, "a3": c3}, what="v3 incl. the new member")

    r.set(f"{run_id}:test:leave:a0", 1)                  # leaves cleanly
    wait_for(lambda: r.exists(f"{run_id}:test:left:a0"), what="a0 left")
    c4 = step(4)
    wait_for(lambda: held(r, run_id, 4) == {"a2": c4, "a3": c4}, what="v4 without the leaver")
    assert len({c1, c2, c3, c4}) == 4
    initial = {v.decode() for v in r.hgetall(f"{run_id}:test:initial").values()}
    assert not initial & {c1, c2, c3, c4}                # the weights really changed on the actors
    for a in ("a2", "a3"):
        r.set(f"{run_id}:test:leave:{a}", 1)
    for a, p in procs.items():
        p.join(30)
        assert p.exitcode == (-signal.SIGKILL if a == "a1" else 0), a
    assert r.hget(keys.checksums, 4).decode() == c4


def test_a_member_that_joins_gets_the_last_version_without_a_publication(redis_url, run_id, r):
    """A member starting after version 3 was published (to nobody: every actor had
    died) gets version 3 from the join server, with the learner's checksum, and no new publication;
    a member already holding the last version is never sent it again."""
    from weightsync.join import JOIN_POLL_S, JoinServer, LastVersion

    keys = Keys(run_id)
    pub = GlooPublisher(r, keys, timeout_s=TIMEOUT_S)
    last = LastVersion()
    server = JoinServer(pub, r, keys, last).start()
    learner = random_tiny_model(seed=0)
    with server.lock:  # as the learner's publications hold it
        c3 = pub.publish(3, learner.state_dict(), bucket_bytes=20_000, keep=last)
    assert c3 == checksum(learner.state_dict())
    proc = ranks.context().Process(target=subscriber_proc, args=(redis_url, run_id, "a0"))
    proc.start()
    try:
        wait_for(lambda: "a0" in held(r, run_id, 3), timeout=60, what="a0 to be sent version 3")
        assert held(r, run_id, 3) == {"a0": c3} and server.served == 1
        assert pub.stats["members"] == 0  # the learner's last publication's, not the join's
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(0.01)
        with server.lock:  # the next publication reaches the joiner too (a new epoch with every member)
            c4 = pub.publish(4, learner.state_dict(), bucket_bytes=20_000, keep=last)
        wait_for(lambda: held(r, run_id, 4) == {"a0": c4}, what="v4 on a0")
        received, seconds = json.loads(r.hget(f"{run_id}:test:receipt", "a0"))
        assert received == 2 and 0 < seconds < 2 * TIMEOUT_S, (received, seconds)  # the join's and v4's receipts
        time.sleep(3 * JOIN_POLL_S)
        assert server.served == 1, "a member holding the last version was sent it again"
    finally:
        server.close()
        proc.kill()  # a clean leave costs LEAVE_QUIET_S and is tested above
        proc.join(30)


def test_engine_refuses_weights_with_a_wrong_checksum(tmp_path):
    from engines.hf_engine import HFEngine
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


def test_the_checksum_record_keeps_version_0_and_the_newest_versions(r, run_id):
    """One checksum a version, kept forever, grew Redis and status.json without end (2M entries a week at
    0.3 s a step): each publication drops those older than the newest CHECKSUMS_KEPT, version 0's kept."""
    from weightsync.core import CHECKSUMS_KEPT, trim_checksums

    key = Keys(run_id).checksums
    for v in range(CHECKSUMS_KEPT + 5):
        r.hset(key, v, f"c{v}")
        trim_checksums(r, key, v)
    kept = sorted(int(f) for f in r.hkeys(key))
    assert kept == [0, *range(5, CHECKSUMS_KEPT + 5)]
    assert r.hget(key, CHECKSUMS_KEPT + 4) == f"c{CHECKSUMS_KEPT + 4}".encode()
