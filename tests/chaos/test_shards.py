"""Two ingest shards (buffer.ingest_shards=2) keep the books: a shard SIGKILLed between receive and
write is restarted under its own role, its actor follows the new address and resends, both shards
store into the one stream, and the ledger balances (tests/chaos/ledger.py)."""
from __future__ import annotations

import re

from runbase import faults
from jobs import JobUnderTest
from ledger import check_ledger

STEPS = 25  # a tiny-model step takes ~0.2 s: enough left after the kill for the restart to matter


def test_a_killed_shard_is_restarted_and_the_books_balance(tmp_path, redis_url, r, run_id):
    job = JobUnderTest(tmp_path / "run", r, run_id, f"trainer.total_steps={STEPS}", "buffer.ingest_shards=2",
                       "trainer.export_hf=false", "trainer.tensorboard=false", redis_url=redis_url)
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
    books = check_ledger(r, run_id, job.run_dir, steps=STEPS)
    assert books["deadletter"] == 0
