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
# One actor per job: rejections, dead letters and returned leases are per group, whichever actor made it; a second
# actor was ~5 CPU-s of start-up per job.
ONE_ACTOR = ("--actors", "1")


def test_rejected_groups_return_their_leases_and_the_books_balance(tmp_path, redis_url, r, run_id):
    job = JobUnderTest(tmp_path / "run", r, run_id, *ONE_ACTOR, f"trainer.total_steps={STEPS}",
                       f"buffer.max_reward={MAX_REWARD}", "trainer.export_hf=false", "trainer.tensorboard=false",
                       redis_url=redis_url)
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
    job = JobUnderTest(tmp_path / "run", r, run_id, *ONE_ACTOR, "trainer.total_steps=4", "buffer.min_reward=-2",
                       "buffer.max_reward=-1", "trainer.export_hf=false", "trainer.tensorboard=false",
                       redis_url=redis_url)
    try:
        code = job.finish()
    finally:
        job.kill()
    assert code != 0
    assert "rejected all of the first" in job.err and "reward_range" in job.err, job.err[-3000:]
    assert not (job.run_dir / "metrics.jsonl").exists() or not (job.run_dir / "metrics.jsonl").read_text()


def test_a_reward_function_that_raises_dead_letters_its_group_and_the_books_balance(tmp_path, redis_url, r, run_id):
    """A reward function that raises on some rows (here countdown's on a ground truth without `numbers`; a
    registered scorer alike) killed the actor scoring them: Ray restarted it, it leased the same prompts
    again, and every actor, then the job, died with only `KeyError: 'numbers'`. Now each such group is
    dead-lettered as `reward_error` naming the data_source and prompt, its lease released, and the job trains
    on the other rows."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    def row(ds, content, truth):
        return {"data_source": ds, "prompt": [{"role": "user", "content": content}], "ability": "x",
                "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": None}

    words = ["abcd", "dcab", "bbca", "adcb", "cadb", "abdc", "dbca", "cbda"]
    good = [row("reverse", w, w[::-1]) for w in words]
    bad = [row("countdown", f"make 3 from 1 2 ({i})", json.dumps({"target": 3})) for i in range(4)]
    pq.write_table(pa.Table.from_pylist(good + bad), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(good), tmp_path / "test.parquet")
    steps = 4
    job = JobUnderTest(tmp_path / "run", r, run_id, *ONE_ACTOR, f"trainer.total_steps={steps}",
                       f"data.train_files=[{tmp_path}/train.parquet]", f"data.val_files=[{tmp_path}/test.parquet]",
                       "trainer.export_hf=false", "trainer.tensorboard=false", redis_url=redis_url)
    try:
        assert job.finish() == 0, job.err[-3000:]
    finally:
        job.kill()
    rejected = int(r.hget(f"{run_id}:rejected", "reward_error") or 0)
    assert rejected > 0, "no row of the failing scorer was scored: the test proves nothing"
    errors = [f[b"error"].decode() for _id, f in r.xrange(f"{run_id}:deadletter") if f[b"reason"] == b"reward_error"]
    assert len(errors) == rejected
    assert all("data_source 'countdown'" in e and "prompt 'train:" in e and "KeyError: 'numbers'" in e
               for e in errors), errors[:3]
    assert "restarting" not in job.out + job.err, "an actor died on the scorer"
    books = check_ledger(r, run_id, job.run_dir, steps=steps)
    assert books["deadletter"] == rejected   # each failed group counted once, its lease released
