"""A job whose actors send groups the ingest rejects (rewards outside the declared range, a reward function that
raises) keeps going and keeps its books: each rejected group is dead-lettered and returns its lease and admission
slot once, so nothing is re-queued at exit and the ledger balances with the rejections in it
(tests/chaos/ledger.py)."""
from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import pytest
from jobs import JobUnderTest
from ledger import check_ledger

STEPS = 8
# The reverse task pays a fraction of the 4 letters right: a group with any perfect sample (reward 1)
# is over this bound, some 10% of groups on the warmed-up tiny model (9 of 85 in a 6-step run).
MAX_REWARD = 0.9
# One actor per job: rejections, dead letters and returned leases are per group, whichever actor made it; a second
# actor was ~5 CPU-s of start-up per job.
ONE_ACTOR = ("--actors", "1")


def row(ds, content, truth):
    return {"data_source": ds, "prompt": [{"role": "user", "content": content}], "ability": "x",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": None}


@pytest.fixture(scope="module")
def rejecting(tmp_path_factory, redis_server):
    """One job that meets both kinds of rejection, run to its end: rows whose scorer raises (countdown's on a ground
    truth without `numbers`) among the reverse task's, and a reward bound some reverse groups exceed. (Its
    directory, output, Redis client, run id.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from runbase.keys import connect

    tmp = tmp_path_factory.mktemp("rejecting")
    words = ["abcd", "dcab", "bbca", "adcb", "cadb", "abdc", "dbca", "cbda"]
    good = [row("reverse", f"{w}>", w[::-1]) for w in words]   # the built-in prompt form
    bad = [row("countdown", f"make 3 from 1 2 ({i})", json.dumps({"target": 3})) for i in range(4)]
    pq.write_table(pa.Table.from_pylist(good + bad), tmp / "train.parquet")
    pq.write_table(pa.Table.from_pylist(good), tmp / "test.parquet")
    r, run_id = connect(redis_server.url), f"test-{uuid.uuid4().hex[:8]}"
    job = JobUnderTest(tmp / "run", r, run_id, *ONE_ACTOR, f"trainer.total_steps={STEPS}",
                       f"buffer.max_reward={MAX_REWARD}", f"data.train_files=[{tmp}/train.parquet]",
                       f"data.val_files=[{tmp}/test.parquet]", "trainer.export_hf=false", "trainer.tensorboard=false",
                       redis_url=redis_server.url)
    try:
        code = job.finish()
    finally:
        job.kill()
    try:
        assert code == 0, job.err[-3000:]
        yield SimpleNamespace(run=tmp / "run", out=job.out + job.err, r=r, run_id=run_id)
    finally:
        r.close()


def test_rejected_groups_return_their_leases_and_the_books_balance(rejecting):
    r, run_id = rejecting.r, rejecting.run_id
    rejected = {k.decode(): int(v) for k, v in r.hgetall(f"{run_id}:rejected").items()}
    print("rejected groups by reason:", rejected)
    assert rejected.get("reward_range", 0) > 0, f"no group was over the bound: the test proves nothing ({rejected})"
    books = check_ledger(r, run_id, rejecting.run, steps=STEPS)
    assert books["deadletter"] == sum(rejected.values())  # each rejected group counted once, its lease released


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


def test_a_reward_function_that_raises_dead_letters_its_group_and_the_books_balance(rejecting):
    """A reward function that raises on some rows (here countdown's on a ground truth without `numbers`; a
    registered scorer alike) killed the actor scoring them: Ray restarted it, it leased the same prompts
    again, and every actor, then the job, died with only `KeyError: 'numbers'`. Now each such group is
    dead-lettered as `reward_error` naming the data_source and prompt, its lease released, and the job trains
    on the other rows."""
    r, run_id = rejecting.r, rejecting.run_id
    rejected = int(r.hget(f"{run_id}:rejected", "reward_error") or 0)
    assert rejected > 0, "no row of the failing scorer was scored: the test proves nothing"
    errors = [f[b"error"].decode() for _id, f in r.xrange(f"{run_id}:deadletter") if f[b"reason"] == b"reward_error"]
    assert len(errors) == rejected
    assert all("data_source 'countdown'" in e and "prompt 'train:" in e and "KeyError: 'numbers'" in e
               for e in errors), errors[:3]
    assert "restarting" not in rejecting.out, "an actor died on the scorer"
    check_ledger(r, run_id, rejecting.run, steps=STEPS)
