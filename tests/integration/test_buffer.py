"""The trajectory path for real: ingest process, ZeroMQ sockets, Redis stream, sampler."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from actors.sender import ZmqTrajectorySink
from buffer.sampler import RedisSampler
from buffer.schema import Group, Limits, Sample, encode
from buffer.store import CONSUMER_GROUP, Leaser
from learner import metric_names as M
from runbase.keys import Keys

VOCAB = 100
MAX_BYTES = 64 * 1024
FAULT_POINTS = Path(__file__).parents[1] / "chaos" / "faultpoints.py"  # the chaos tests' fault wrappers


def make_group(gid: str, version: int = 0, n: int = 2, reward: float = 0.5, resp_len: int = 3) -> Group:
    return Group(group_id=gid, prompt_id=f"p-{gid}", actor_id="actor-test",
                 prompt_ids=np.arange(1, 5, dtype=np.int32), created_at=time.time(),
                 samples=[Sample(response_ids=np.full(resp_len, 7 + i, dtype=np.int32),
                                 behavior_logprobs=np.full(resp_len, -0.5, dtype=np.float32), reward=reward,
                                 finish_reason="stop", version_start=version, version_end=version)
                          for i in range(n)])


MAX_PROMPT, MAX_RESPONSE, MAX_POSITIONS = 6, 10, 14  # the job's numbers, as the launcher passes them


@pytest.fixture
def ingest_proc(redis_url, run_id, r):
    proc = subprocess.Popen([sys.executable, "-m", "buffer.ingest_proc", "--redis-url", redis_url,
                             "--run-id", run_id, "--vocab-size", str(VOCAB), "--max-prompt-tokens", str(MAX_PROMPT),
                             "--max-response-tokens", str(MAX_RESPONSE), "--max-positions", str(MAX_POSITIONS),
                             f"buffer.max_message_bytes={MAX_BYTES}"], stdout=subprocess.PIPE, text=True)
    proc.address = proc.stdout.readline().strip()
    assert proc.address.startswith("tcp://127.0.0.1:"), proc.address
    yield proc
    r.set(Keys(run_id).stop_ingest, 1)
    assert proc.wait(10) == 0


@pytest.fixture
def ingest(ingest_proc):
    return ingest_proc.address


def raw_send(address: str, payload: bytes) -> dict:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send(payload)
        assert s.poll(10_000), "ingest did not reply"
        return msgpack.unpackb(s.recv(), raw=False)
    finally:
        s.close()


def test_round_trip_and_ack(ingest, r, run_id):
    keys = Keys(run_id)
    sink = ZmqTrajectorySink(ingest)
    sent = [make_group("g1"), make_group("g2", n=3)]
    assert sink.send(sent) == [None, None]
    sampler = RedisSampler(r, keys, groups_per_step=2, max_staleness=0)
    batch = sampler.next_batch(learner_version=0)
    assert sorted(g.group_id for g in batch.groups) == ["g1", "g2"]
    got = {g.group_id: g for g in batch.groups}
    for g in sent:
        assert got[g.group_id] == g
    # read but not acked: still pending (a crash here loses nothing)
    assert r.xpending(keys.traj, CONSUMER_GROUP)["pending"] == 2
    sampler.ack(batch)
    assert r.xpending(keys.traj, CONSUMER_GROUP)["pending"] == 0
    assert r.xlen(keys.traj) == 0
    sink.close()


def test_resend_is_idempotent(ingest, r, run_id):
    sink = ZmqTrajectorySink(ingest)
    g = make_group("dup")
    assert sink.send([g]) == [None]
    assert sink.send([g]) == [None]
    assert r.xlen(Keys(run_id).traj) == 1
    sink.close()


def test_bad_messages_rejected_with_counted_reasons(ingest, r, run_id):
    keys = Keys(run_id)
    good = msgpack.unpackb(encode(make_group("ok")), raw=False)
    wrong_schema = dict(good, schema=99)
    nan_reward = dict(good, s=[dict(good["s"][0], rw=math.nan)] + good["s"][1:])
    mismatch = dict(good, s=[dict(good["s"][0], lp=np.zeros(2, "<f4").tobytes())] + good["s"][1:])
    cases = {
        "malformed": b"\xc1\x00garbage",
        "schema_version": msgpack.packb(wrong_schema),
        "non_finite": msgpack.packb(nan_reward),
        "length_mismatch": msgpack.packb(mismatch),
        "too_large": encode(make_group("long", resp_len=MAX_RESPONSE + 1)),  # over the job's actors.max_tokens
        "out_of_vocab": encode(make_group("oov")).replace(np.int32(7).tobytes(), np.int32(VOCAB + 5).tobytes()),
        # a float field that float() refuses: the rejection's own group-id read must not kill the ingest
        "bad_type": msgpack.packb(dict(good, ca="x")),
    }
    for reason, payload in cases.items():
        reply = raw_send(ingest, payload)
        assert reply["ok"] is False and reply["reason"] == reason, (reason, reply)
    counts = {k.decode(): int(v) for k, v in r.hgetall(keys.rejected).items()}
    assert counts == {reason: 1 for reason in cases}
    assert r.xlen(keys.deadletter) == len(cases)
    assert r.xlen(keys.traj) == 0  # nothing bad reached the learner's stream
    # and the server is still serving
    assert raw_send(ingest, encode(make_group("after")))["ok"] is True
    assert r.xlen(keys.traj) == 1


def test_staleness_filter_drops_and_counts(ingest, r, run_id):
    keys = Keys(run_id)
    r.zadd(keys.ws_begun, {"v": 3})  # the publisher has begun to send version 3
    sink = ZmqTrajectorySink(ingest)
    assert sink.send([make_group(f"v{v}", version=v) for v in range(4)]) == [None] * 4
    sampler = RedisSampler(r, keys, groups_per_step=2, max_staleness=1)
    batch = sampler.next_batch(learner_version=3)  # staleness 3, 2 dropped; 1, 0 kept
    assert sorted(g.group_id for g in batch.groups) == ["v2", "v3"]
    assert batch.dropped_stale == 2
    assert int(r.get(keys.dropped)) == 2
    assert int(r.hget(keys.rejected, "dropped_stale")) == 2
    sampler.ack(batch)
    assert r.xpending(keys.traj, CONSUMER_GROUP)["pending"] == 0
    sink.close()


@pytest.mark.parametrize("admission", ["learner", "actor"])
def test_admission_rule(r, run_id, admission):
    keys = Keys(run_id)
    r.rpush(keys.prompts, *[f'{{"prompt_id": "{i}"}}' for i in range(20)])
    r.set(keys.version, 0)
    leaser = Leaser(r, keys, max_staleness=1, groups_per_step=2, actor_id="a", admission=admission)
    first = leaser.lease(10, actor_version=0)
    assert len(first) == 4  # (0 + 1 + 1) * 2
    assert len({gid for gid, _ in first}) == 4 and r.hlen(keys.leases) == 4
    assert leaser.lease(10, actor_version=0) == []
    r.set(keys.version, 1)
    # weights 1 behind, still within s = 1. Counted from the learner's version (AReaL's rule) the cap is
    # (1 + 1 + 1) * 2; counted from the actor's weights it stays (0 + 1 + 1) * 2: groups 5 and 6 would be
    # trained at step 2 at the earliest, staleness 2 for weights 0, so they wait for the new weights
    assert len(leaser.lease(10, actor_version=0)) == (2 if admission == "learner" else 0)
    assert len(leaser.lease(10, actor_version=1)) == (0 if admission == "learner" else 2)
    r.set(keys.version, 2)
    assert leaser.lease(10, actor_version=0) is None    # 2 behind: must wait for new weights
    r.incr(keys.dropped)
    assert len(leaser.lease(10, actor_version=2)) == 3  # cap 8 + 1 dropped - 6 started
    with pytest.raises(ValueError, match="admission"):
        Leaser(r, keys, max_staleness=1, groups_per_step=2, actor_id="a", admission="nope")


def test_new_learner_takes_over_a_dead_learners_unacked_reads(ingest, r, run_id):
    """A learner read a batch and died before acking: a learner under another consumer name
    (a new process) XAUTOCLAIMs those entries and trains on them first; nothing is read twice after."""
    keys = Keys(run_id)
    sink = ZmqTrajectorySink(ingest)
    assert sink.send([make_group(f"g{i}") for i in range(4)]) == [None] * 4
    dead = RedisSampler(r, keys, groups_per_step=2, max_staleness=0, consumer="rank0-111")
    lost = dead.next_batch(learner_version=0)
    assert r.xpending(keys.traj, CONSUMER_GROUP)["pending"] == 2
    heir = RedisSampler(r, keys, groups_per_step=2, max_staleness=0, consumer="rank0-222")
    assert heir.reclaimed == 2
    consumers = {c["name"].decode(): c["pending"] for c in r.xinfo_consumers(keys.traj, CONSUMER_GROUP)}
    assert consumers == {"rank0-222": 2}  # the dead consumer is forgotten once it holds nothing
    first = heir.next_batch(learner_version=0)
    assert [g.group_id for g in first.groups] == [g.group_id for g in lost.groups]
    heir.ack(first)
    second = heir.next_batch(learner_version=0)
    assert {g.group_id for g in second.groups} == {"g0", "g1", "g2", "g3"} - {g.group_id for g in lost.groups}
    heir.ack(second)
    assert r.xpending(keys.traj, CONSUMER_GROUP)["pending"] == 0 and r.xlen(keys.traj) == 0
    sink.close()


def test_sender_follows_a_restarted_ingest(redis_url, r, run_id):
    """The ingest dies between receiving a group and storing it (armed fault); a new ingest
    announces another address; the sender resends there and the group is stored exactly once."""
    from runbase import faults

    keys = Keys(run_id)

    def start():  # the ingest's own entry point, run with the chaos fault points installed
        p = subprocess.Popen([sys.executable, str(FAULT_POINTS), "buffer.ingest_proc", "--redis-url", redis_url,
                              "--run-id", run_id, "--vocab-size", str(VOCAB)], stdout=subprocess.PIPE, text=True)
        return p, p.stdout.readline().strip()

    first, addr1 = start()
    faults.arm(r, run_id, faults.INGEST_KILL_BEFORE_STORE)
    sink = ZmqTrajectorySink(lambda: r.hget(keys.ingest, "address").decode())
    import threading

    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", sink.send([make_group("g1"), make_group("g2")])))
    t.start()
    assert first.wait(10) == -9  # SIGKILLed by the fault, before storing anything
    assert r.xlen(keys.traj) == 0
    second, addr2 = start()
    assert addr2 != addr1
    t.join(30)
    assert result.get("r") == [None, None]
    assert r.xlen(keys.traj) == 2 and r.zcard(keys.seen) == 2
    r.set(keys.stop_ingest, 1)
    assert second.wait(10) == 0
    sink.close()


def test_a_fault_armed_before_the_loop_starts_fires_on_its_first_message(r, run_id, monkeypatch):
    """A fault armed while an ingest started fires on the first message it serves, though that message was
    queued before the loop began (an ingest slow to get from announcing its address to its loop on a loaded
    machine): test_sender_follows_a_restarted_ingest would otherwise wait for a death that never comes. The
    fault points are installed in this process for this test only (the monkeypatch undoes them)."""
    from buffer.ingest import IngestServer
    from runbase import faults

    class Died(Exception):
        pass

    def die():
        raise Died

    monkeypatch.setattr(faults, "die", die)
    faults.load(str(FAULT_POINTS)).install(patch=monkeypatch.setattr)
    keys = Keys(run_id)
    server = IngestServer(r, keys, Limits(vocab_size=VOCAB))
    faults.arm(r, run_id, faults.INGEST_KILL_BEFORE_STORE)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.address)
    try:
        s.send(encode(make_group("g1")))
        time.sleep(0.3)   # queued at the ingest before its loop begins
        deadline = time.monotonic() + 5
        with pytest.raises(Died):
            server.serve(should_stop=lambda: time.monotonic() > deadline)
        assert r.xlen(keys.traj) == 0 and not faults.armed(r, run_id, faults.INGEST_KILL_BEFORE_STORE)
    finally:
        s.close()
        server.close()


def test_a_read_whose_reply_was_lost_is_read_again(ingest, r, run_id):
    """Redis executed an XREADGROUP but the reply never arrived (server killed after its fsync,
    client retried and read on): the sampler notices its PEL holds more than it handed out."""
    keys = Keys(run_id)
    sink = ZmqTrajectorySink(ingest)
    assert sink.send([make_group(f"g{i}") for i in range(4)]) == [None] * 4
    sampler = RedisSampler(r, keys, groups_per_step=2, max_staleness=0, consumer="rank0-1")
    r.xreadgroup(CONSUMER_GROUP, "rank0-1", {keys.traj: ">"}, count=2)  # the "lost" read
    first = sampler.next_batch(learner_version=0)
    assert [g.group_id for g in first.groups] == ["g0", "g1"]
    sampler.ack(first)
    second = sampler.next_batch(learner_version=0)
    assert [g.group_id for g in second.groups] == ["g2", "g3"]
    sampler.ack(second)
    assert r.xpending(keys.traj, CONSUMER_GROUP)["pending"] == 0
    sink.close()


def test_a_stale_drop_whose_reply_was_lost_counts_once(ingest, r, run_id):
    """Redis ran the sampler's drop of a stale group but its reply was lost (a dropped connection):
    the client runs the same call again. The group counts once and frees one admission slot."""
    keys = Keys(run_id)
    sink = ZmqTrajectorySink(ingest)
    assert sink.send([make_group("old")]) == [None]
    sampler = RedisSampler(r, keys, groups_per_step=1, max_staleness=0, consumer="rank0-1")
    [(_stream, [(entry_id, _fields)])] = r.xreadgroup(CONSUMER_GROUP, "rank0-1", {keys.traj: ">"}, count=1)
    counted = [sampler._discard(entry_id, "stale") for _ in range(2)]  # the second: the client's re-run
    assert int(r.get(keys.dropped)) == 1
    assert int(r.hget(keys.rejected, "dropped_stale")) == 1
    assert counted == [True, False]
    assert r.xpending(keys.traj, CONSUMER_GROUP)["pending"] == 0 and r.xlen(keys.traj) == 0
    sink.close()


def test_a_skipped_steps_groups_are_dead_lettered_once(ingest, r, run_id):
    """The groups of a step the learner did not apply (a non-finite update) are acked
    (never re-read, not by a resumed learner either), dead-lettered with the reason and their group ids,
    counted, and free their admission slots, once even when the call runs again after a lost reply."""
    keys = Keys(run_id)
    sink = ZmqTrajectorySink(ingest)
    assert sink.send([make_group("s1"), make_group("s2")]) == [None, None]
    sampler = RedisSampler(r, keys, groups_per_step=2, max_staleness=0)
    batch = sampler.next_batch(learner_version=0)
    counted = [sampler.skip(batch, "skipped_non-finite_loss", 0) for _ in range(2)]  # the second: a re-run
    assert counted == [2, 0]
    assert int(r.get(keys.dropped)) == 2 and int(r.hget(keys.rejected, "skipped_non-finite_loss")) == 2
    entries = [f for _id, f in r.xrange(keys.deadletter)]
    assert sorted(f[b"group_id"] for f in entries) == [b"s1", b"s2"]
    assert {(f[b"reason"], f[b"step"]) for f in entries} == {(b"skipped_non-finite_loss", b"0")}
    assert r.xpending(keys.traj, CONSUMER_GROUP)["pending"] == 0 and r.xlen(keys.traj) == 0
    sink.close()


def forged(g: Group) -> bytes:
    """Encoded as a hostile or broken actor would, past the client-side checks."""
    return encode(g, Limits(min_logprob=-1e9))


def test_values_judged_against_the_job(ingest, r, run_id):
    """Groups that pass the types but not the job: each rejected with its reason, counted, dead-lettered."""
    keys = Keys(run_id)
    huge_reward, low_logprob, ahead, long_prompt, past_positions = (make_group(f"g{i}") for i in range(5))
    huge_reward.samples[1].reward = 1e308
    low_logprob.samples[0].behavior_logprobs[2] = -100.0
    ahead.samples[0].version_start = ahead.samples[0].version_end = 1
    long_prompt.prompt_ids = np.arange(1, MAX_PROMPT + 2, dtype=np.int32)   # over data.max_prompt_length
    past_positions.prompt_ids = np.arange(1, MAX_PROMPT + 1, dtype=np.int32)
    past_positions.samples = make_group("x", resp_len=MAX_POSITIONS - MAX_PROMPT + 1).samples
    cases = {"reward_range": huge_reward, "logprob_range": low_logprob, "version_ahead": ahead,
             "too_large": long_prompt}
    for reason, g in cases.items():
        reply = raw_send(ingest, forged(g))
        assert reply["ok"] is False and reply["reason"] == reason, (reason, reply)
    reply = raw_send(ingest, forged(past_positions))
    assert reply["reason"] == "too_large" and "positions" in reply["error"], reply
    counts = {k.decode(): int(v) for k, v in r.hgetall(keys.rejected).items()}
    assert counts == {"reward_range": 1, "logprob_range": 1, "version_ahead": 1, "too_large": 2}
    assert r.xlen(keys.deadletter) == 5 and r.xlen(keys.traj) == 0
    # once the publisher has begun to send version 1, a group on it is accepted (the ingest re-reads)
    r.zadd(keys.ws_begun, {"v": 1})
    assert raw_send(ingest, forged(ahead))["ok"] is True


def test_the_ids_kept_for_idempotent_resends_stay_bounded(r, run_id):
    """A resend of a stored group is acknowledged and stored once; ids older than SEEN_KEEP_S (no sender can
    still be resending them) leave `seen`, which held every group id of the run before (~56 bytes a group,
    without end: 8 ids a step, 0.45 MB of Redis per 1,000 steps of the default job)."""
    from buffer.store import SEEN_KEEP_S, STORE_LUA

    keys = Keys(run_id)
    store = r.register_script(STORE_LUA)

    def put(gid, now):
        return store(keys=[keys.traj, keys.seen, keys.leases], args=[gid, b"x", now])

    assert [put("g1", 1000.0), put("g1", 1010.0), put("g2", 1020.0)] == [1, 0, 1]
    assert r.xlen(keys.traj) == 2 and r.zcard(keys.seen) == 2
    assert put("g3", 1015.0 + SEEN_KEEP_S) == 1  # g1 is past the window, g2 still in it
    assert {m.decode() for m in r.zrange(keys.seen, 0, -1)} == {"g2", "g3"}
    assert put("g2", 1016.0 + SEEN_KEEP_S) == 0 and r.xlen(keys.traj) == 3


def test_a_group_of_another_size_than_actors_n_is_rejected_and_returns_its_lease(redis_url, run_id, r):
    """The launcher passes actors.n (--group-size): a leased group with one sample short is rejected, counted,
    dead-lettered with its lease released; it never reaches the learner, whose ranks' equal shares it would
    break (learner.batching.split_rows)."""
    keys = Keys(run_id)
    proc = subprocess.Popen([sys.executable, "-m", "buffer.ingest_proc", "--redis-url", redis_url, "--run-id", run_id,
                             "--vocab-size", str(VOCAB), "--group-size", "2"], stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()
        r.rpush(keys.prompts, *[json.dumps({"prompt_id": str(i)}) for i in range(2)])
        (short, _), (whole, _) = Leaser(r, keys, max_staleness=0, groups_per_step=2, actor_id="a").lease(2, 0)
        reply = raw_send(address, encode(make_group(short, n=1)))
        assert reply["ok"] is False and reply["reason"] == "bad_value" and "actors.n = 2" in reply["error"], reply
        assert raw_send(address, encode(make_group(whole, n=2)))["ok"] is True
        assert r.hlen(keys.leases) == 0 and int(r.get(keys.dropped)) == 1
        assert r.xlen(keys.deadletter) == 1 and r.xlen(keys.traj) == 1
        assert {k.decode(): int(v) for k, v in r.hgetall(keys.rejected).items()} == {"bad_value": 1}
    finally:
        r.set(keys.stop_ingest, 1)
        assert proc.wait(10) == 0


def train_one_step_and_count(r, run_id: str, run_dir) -> dict:
    """One learner step of one group (read, acked, its metrics line written), then the chaos tier's books."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chaos"))
    from ledger import check_ledger

    sampler = RedisSampler(r, Keys(run_id), groups_per_step=1, max_staleness=0)
    batch = sampler.next_batch(learner_version=0)
    sampler.ack(batch)
    (run_dir / "metrics.jsonl").write_text(json.dumps({M.STEP: 0, M.VAL_REWARD_INITIAL: 0.0,
                                                       M.GROUPS_TRAINED: [g.group_id for g in batch.groups]}) + "\n")
    return check_ledger(r, run_id, run_dir, steps=1)


def test_a_rejected_group_returns_its_lease_once_and_the_books_balance(ingest, r, run_id, tmp_path):
    """A leased group the ingest rejects gives its lease back and frees its admission slot exactly once
    (a resent rejection frees nothing more); trained + dead-lettered then balances what was issued."""
    keys = Keys(run_id)
    r.rpush(keys.prompts, *[json.dumps({"prompt_id": str(i)}) for i in range(5)])
    leaser = Leaser(r, keys, max_staleness=0, groups_per_step=2, actor_id="a")
    (good, _), (bad, _) = leaser.lease(10, actor_version=0)
    assert leaser.lease(10, actor_version=0) == []  # admission full: (0 + 0 + 1) * 2 started
    assert raw_send(ingest, encode(make_group(good)))["ok"] is True
    rejected = make_group(bad)
    rejected.samples[0].reward = 1e308
    for _ in range(2):  # the second: a resend of the same rejected group
        assert raw_send(ingest, forged(rejected))["reason"] == "reward_range"
    assert r.hlen(keys.leases) == 0, "the rejected group kept its lease"
    assert int(r.get(keys.dropped)) == 1
    assert [f[b"lease"] for _id, f in r.xrange(keys.deadletter)] == [b"1", b"0"]
    books = train_one_step_and_count(r, run_id, tmp_path)
    assert books["issued"] == 2 and books["trained"] == 1 and books["deadletter"] == 1
    assert len(leaser.lease(10, actor_version=0)) == 1  # the freed slot admits a replacement


def test_a_group_arriving_after_its_lease_was_reclaimed_is_not_stored(ingest, r, run_id, tmp_path):
    """An actor sends a group and dies before the ingest takes it (queued behind a slow or paused ingest); the
    launcher returns its leases (prompt re-queued, counted `lease_reclaimed`). The late message is acked as a
    duplicate and never stored: stored too, its group counted both returned and trained (seen in a job: the
    ingest SIGSTOPped, an actor SIGKILLed, the ingest resumed; issued 2780, accounted 2784)."""
    from buffer.store import reclaim_leases

    keys = Keys(run_id)
    r.rpush(keys.prompts, *[json.dumps({"prompt_id": str(i)}) for i in range(5)])
    (late, _), (kept, _) = Leaser(r, keys, max_staleness=0, groups_per_step=2, actor_id="dead").lease(2, 0)
    assert raw_send(ingest, encode(make_group(kept)))["ok"] is True
    assert reclaim_leases(r, keys, "dead") == 1      # the launcher: the actor died, `late` still leased
    reply = raw_send(ingest, encode(make_group(late)))
    assert reply["ok"] is True and reply["duplicate"] is True  # acked (the sender stops), not stored
    assert r.xlen(keys.traj) == 1 and r.llen(keys.prompts) == 4  # its prompt is back in the queue once
    books = train_one_step_and_count(r, run_id, tmp_path)
    assert books["issued"] == 2 and books["trained"] == 1 and books["returned"] == 1


OVERSIZED = 64 * 2**20  # a frame 1000x the fixture's cap: read into memory, it would show in the peak RSS
DROP_WAIT_S = 10        # for the ingest to notice the dropped peer (its loop polls every 0.1 s)


def peak_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmHWM:")).split()[1]) * 1024


def test_an_oversized_frame_is_dropped_at_the_socket(ingest_proc, r, run_id):
    """A frame over buffer.max_message_bytes is refused as its header arrives (ZeroMQ's MAXMSGSIZE): the
    ingest's memory does not grow by it, the sender gets no reply, the drop is counted, service goes on."""
    keys = Keys(run_id)
    before = peak_rss(ingest_proc.pid)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, -1)  # a raw client: once dropped, it does not come back
    s.connect(ingest_proc.address)
    try:
        s.send(b"\x00" * OVERSIZED)
        assert not s.poll(1000), "the ingest answered a frame it should never have read"
    finally:
        s.close()
    deadline = time.monotonic() + DROP_WAIT_S
    while r.hget(keys.ingest, "peers_dropped") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(r.hget(keys.ingest, "peers_dropped") or 0) == 1
    assert peak_rss(ingest_proc.pid) - before < OVERSIZED // 8
    assert raw_send(ingest_proc.address, encode(make_group("after")))["ok"] is True
    assert r.xlen(keys.traj) == 1 and not r.exists(keys.rejected)
    time.sleep(1.0)  # the ingest sees that client's disconnect: one that sent a message is no drop
    from cluster.status import collect, render

    status = collect(r, keys)
    assert status["buffer"]["peers_dropped"] == 1 and "peers dropped 1" in render(status)


def test_the_publisher_records_each_version_it_begins(r, run_id):
    """The ingest's bound on versions is written as a publication begins, and is never lowered (a joining
    actor may be sent an older version than one already begun)."""
    import torch

    from weightsync.gloo import GlooPublisher

    keys = Keys(run_id)
    pub = GlooPublisher(r, keys, timeout_s=5.0)
    try:
        pub.publish(3, {"w": torch.zeros(4)})
        assert r.zscore(keys.ws_begun, "v") == 3
        pub.publish(2, {"w": torch.zeros(4)})
        assert r.zscore(keys.ws_begun, "v") == 3
    finally:
        pub.close()
