"""Two ingest shards (buffer.ingest_shards=2) keep the books: a shard SIGKILLed between receive and
write is restarted under its own role, its actor follows the new address and resends, both shards
store into the one stream, and the ledger balances (tests/chaos/ledger.py).

The same job's actors also send groups the ingest rejects (rewards outside buffer.max_reward): the job keeps
going and keeps its books: each rejected group is dead-lettered and returns its lease and admission slot once,
so nothing is re-queued at exit and the ledger balances with the rejections in it. (That had a job of its own
in test_rejected_groups.py; the job whose every group is rejected still does.)"""
from __future__ import annotations

import re

from runbase import faults
from jobs import JobUnderTest
from ledger import check_ledger

STEPS = 25  # a tiny-model step takes ~0.2 s: enough left after the kill for the restart to matter
# The reverse task pays a fraction of the 4 letters right: a group with any perfect sample (reward 1)
# is over this bound, some 10% of groups on the warmed-up tiny model (9 of 85 in a 6-step run).
MAX_REWARD = 0.9


def test_a_killed_shard_is_restarted_and_rejected_groups_return_their_leases_and_the_books_balance(
        tmp_path, redis_url, r, run_id):
    job = JobUnderTest(tmp_path / "run", r, run_id, f"trainer.total_steps={STEPS}", "buffer.ingest_shards=2",
                       f"buffer.max_reward={MAX_REWARD}", "trainer.export_hf=false", "trainer.tensorboard=false",
                       redis_url=redis_url)
    try:
        job.wait_step(2)
        ingest = r.hgetall(f"{run_id}:ingest")
        assert {b"address:0", b"address:1"} <= ingest.keys() and ingest[b"address:0"] != ingest[b"address:1"]
        faults.arm(r, run_id, faults.INGEST_KILL_BEFORE_STORE)
        job.wait(lambda: not faults.armed(r, run_id, faults.INGEST_KILL_BEFORE_STORE), "the fault to fire")
        assert job.finish() == 0, job.err[-3000:]
    finally:
        job.kill()
    died = re.findall(r"(ingest-[01]) died", job.out)
    assert len(died) == 1 and f"{died[0]} died" in job.out and "restarting (1/3)" in job.out, job.out[-2000:]
    logs = {i: (job.run_dir / "logs" / f"ingest-{i}.log").read_text() for i in (0, 1)}
    assert all("started" in text for text in logs.values())  # both shards served
    rejected = int(r.hget(f"{run_id}:rejected", "reward_range") or 0)
    assert rejected > 0, "no group was rejected: the rejection half proves nothing"
    books = check_ledger(r, run_id, job.run_dir, steps=STEPS)
    # each rejected group dead-lettered once, its lease released; the group the killed shard swallowed was
    # resent, not dead-lettered
    assert books["deadletter"] == rejected
