"""A job whose actors send only groups the ingest rejects (rewards outside the declared range) fails with the
reason. (A job where some groups are rejected keeps going and keeps its books: each rejected group is
dead-lettered and returns its lease and admission slot once, the ledger balancing with the rejections in it:
tests/chaos/test_shards.py, in the same job as the killed shard.)"""
from __future__ import annotations

from jobs import JobUnderTest


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
