"""The launcher's watchdog over its local Redis server (cluster/supervision.py RedisWatch), with a real server:
a server it restarted outlives the watchdog's end (close() still needs it), and a server that cannot be kept up
ends the job with the reason, not with a traceback after every client's retries."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import redis

from cluster import launch
from cluster.errors import JobError
from cluster.launch import Job
from cluster.redis_local import LocalRedis
from cluster.supervision import RedisWatch

WAIT_S = 10


def watched(tmp_path, max_restarts: int = 3):
    watch = RedisWatch(LocalRedis(tmp_path / "redis"), max_restarts)
    watch.start()
    return watch


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_restarted_redis_outlives_the_watchdogs_end(tmp_path):
    """PR_SET_PDEATHSIG fires when the *thread* that started the server ends: a watchdog thread that returned
    as close() began would get the server it had restarted SIGTERMed before close() wrote status.json
    (an interrupted job after one Redis restart: no status.json, 30 s of retries, 50 s to stop)."""
    watch = watched(tmp_path)
    try:
        first = watch.redis.proc
        first.kill()
        wait_for(lambda: watch.redis.proc is not first and watch.redis.alive(), "the restart")
        watch.closing.set()    # close() begins: the watchdog stops restarting
        time.sleep(1.0)      # > REDIS_WATCH_S: the watchdog has seen it
        assert watch.redis.alive(), "the restarted server died with the watchdog's thread"
        assert watch.failed is None
    finally:
        watch.redis.stop()


def test_a_redis_that_cannot_be_kept_up_fails_the_job_with_the_reason(tmp_path, monkeypatch):
    # The reason is read by the monitor thread while the watchdog writes it: it must appear whole. A slow look at
    # the server's log widens the window where a reason without its data folder was visible (CI saw it once).
    why_down = LocalRedis.why_down
    monkeypatch.setattr(LocalRedis, "why_down", lambda self: (time.sleep(0.5), why_down(self))[1])
    watch = watched(tmp_path, max_restarts=0)
    try:
        watch.redis.proc.kill()
        wait_for(lambda: watch.failed is not None, "the watchdog to give up")
        assert "local redis-server died 1 times; not restarting it" in watch.failed
        assert f"its data in {tmp_path / 'redis'}" in watch.failed and "MiB free" in watch.failed
        # a monitor blocked in a Redis call when the server went: its retries run out, and the job ends naming why
        class Lost:
            def __init__(self, *parts):
                pass

            def run(self):
                raise redis.ConnectionError("Error 111 connecting to 127.0.0.1. Connection refused.")

        monkeypatch.setattr(launch, "Supervisor", Lost)
        monitored = SimpleNamespace(ctx=SimpleNamespace(redis_url=watch.redis.url), procs=None, redis_watch=watch)
        monitored.redis_failed = lambda: Job.redis_failed(monitored)
        with pytest.raises(JobError, match="not restarting it .*MiB free"):
            Job.monitor(monitored)
    finally:
        watch.closing.set()
        watch.redis.stop()
