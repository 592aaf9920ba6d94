"""A job whose actors send groups the ingest rejects (rewards outside the declared range) keeps going and
keeps its books: each rejected group is dead-lettered and returns its lease and admission slot once, so
nothing is re-queued at exit and the ledger balances with the rejections in it (tests/chaos/ledger.py)."""
from __future__ import annotations

from jobs import JobUnderTest
from ledger import check_ledger

STEPS = 8
# The reverse task pays a fraction of the 4 letters right: a group with any perfect sample (reward 1)
# is over this bound, some 10% of groups on the warmed-up tiny model (9 of 85 in a 6-step run).
MAX_REWARD = 0.9


def test_rejected_groups_return_their_leases_and_the_books_balance(tmp_path, redis_url, r, run_id):
    job = JobUnderTest(tmp_path / "run", r, run_id, f"trainer.total_steps={STEPS}", f"buffer.max_reward={MAX_REWARD}",
                       "trainer.export_hf=false", "trainer.tensorboard=false", redis_url=redis_url)
    try:
        assert job.finish() == 0, job.err[-3000:]
    finally:
        job.kill()
    rejected = int(r.hget(f"{run_id}:rejected", "reward_range") or 0)
    assert rejected > 0, "no group was rejected: the test proves nothing"
    books = check_ledger(r, run_id, job.run_dir, steps=STEPS)
    assert books["deadletter"] == rejected  # each rejected group counted once, its lease released


def test_a_job_whose_every_group_is_rejected_fails_with_the_reason(tmp_path, redis_url, r, run_id):
    """Rewards that can never be in range (the data, model and limits do not fit together): the launcher
    fails the job with the ingest's reason once ALL_REJECTED_FATAL groups were rejected and none accepted,
    instead of the learner waiting forever for a batch."""
    job = JobUnderTest(tmp_path / "run", r, run_id, "trainer.total_steps=4", "buffer.min_reward=-2",
                       "buffer.max_reward=-1", "trainer.export_hf=false", "trainer.tensorboard=false",
                       redis_url=redis_url)
    try:
        code = job.finish()
    finally:
        job.kill()
    assert code != 0
    assert "rejected all of the first" in job.err and "reward_range" in job.err, job.err[-3000:]
    assert not (job.run_dir / "metrics.jsonl").exists() or not (job.run_dir / "metrics.jsonl").read_text()
