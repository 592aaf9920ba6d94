"""The run's Redis namespace (`Keys`: every key a run uses, prefixed by its id so several runs share one
server) and the client every process connects with (`connect`: retries through a Redis restart).
"""
from __future__ import annotations

import os
import time

from runbase.net import ENV_REDIS_PASSWORD


class Keys:
    """Names of a run's keys (see docs/design.md, Redis layout)."""

    def __init__(self, run: str):
        self.run = run
        p = run + ":"
        self.traj = p + "traj"                # stream of accepted groups (field d = msgpack payload)
        self.prompts = p + "prompts"          # list of JSON prompt records waiting for an actor
        self.prompt_cursor = p + "prompt_cursor"
        self.leases = p + "leases"            # hash group_id -> JSON {actor, t, prompt}
        self.group_seq = p + "group_seq"      # counter behind globally unique group ids
        self.started = p + "started"          # groups admitted so far (the admission counter)
        self.dropped = p + "dropped"          # groups dropped by the staleness filter (frees admission)
        self.version = p + "version"          # learner version whose weights actors can hold
        self.checkpointed = p + "checkpointed"  # newest checkpoint step whose groups were acked (gone from Redis)
        self.ws_begun = p + "ws:begun"        # zset, member v: newest version the weight publisher has
                                              # begun to send; no sample can come from a later one
        self.seen = p + "seen"                # zset stored group id -> store time, the last hour's (idempotent resends)
        self.learner = p + "learner"          # hash: learner rank 0's pid and host
        self.learner_phase = p + "learner:phase"  # hash: phase, version, since of learner rank 0's loop
        self.members = p + "members"          # hash actor_id -> JSON status (version, checksum, heartbeat)
        self.deadletter = p + "deadletter"    # stream of rejected messages with reasons
        self.rejected = p + "rejected"        # hash reason -> count
        self.ingest = p + "ingest"            # hash: address, accepted, bytes
        self.checksums = p + "checksums"      # hash version -> learner weight checksum
        self.ws = p + "ws"                    # hash: weight-sync rendezvous address, layout
        self.ws_members = p + "ws:members"    # hash actor_id -> last heartbeat of its weight subscriber
        self.ws_announce = p + "ws:announce"  # stream: one entry per publication attempt (version, epoch, ranks)
        self.ws_held = p + "ws:held"          # hash member -> the version it holds or is receiving (weightsync/join.py)
        self.val = p + "val"                  # hash version -> held-out reward
        self.val_requests = p + "val:requests"  # set of versions the learner wants evaluated (trainer.val_engine=vllm)
        self.val_results = p + "val:results"  # hash version -> JSON {reward, accuracy, eval_s} or {skipped}
        self.metrics = p + "metrics"          # latest learner metrics (JSON) for status/progress
        self.stop = p + "stop"                # set when the learner is done: actors finish their batch and exit
        self.ended = p + "ended"              # unix time the launcher closed the job (operator commands refuse it)
        self.stop_ingest = p + "stop_ingest"  # set after actors drained, so their last groups still get acks
        self.error = p + "error"              # first fatal error reported by any process
        self.scale_target = p + "scale_target"  # desired number of actors (set by cluster.scale)
        self.export = p + "export"            # set by cluster.export: save the policy after the current step
        self.exported = p + "exported"        # list of exported policy folders, newest last
        self.faults = p + "faults"            # one-shot faults armed by chaos tests (runbase.faults)
        self.startup = p + "startup"          # hash "role:event" -> unix time it first happened (mark_startup)

    def episodes(self, group_id: str) -> str:
        """Hash episode index -> the msgpack state of that episode after its last finished turn, while its group is
        in flight (actors/journal.py): another actor resumes the group from there when this one dies."""
        return f"{self.run}:ep:{group_id}"

    def drain(self, actor_id: str) -> str:
        """Set to ask one actor to finish its batch, leave the weight group and exit."""
        return f"{self.run}:drain:{actor_id}"

    def ws_ipc(self, member: str) -> str:
        """List of one member's CUDA IPC messages: bucket handles, then the version's checksum trailer."""
        return f"{self.run}:ws:ipc:{member}"

    def ws_ipc_ack(self, version: int) -> str:
        """Hash bucket index (-1: the trailer) -> members that acknowledged it, of one version."""
        return f"{self.run}:ws:ipcack:{version}"

    def ws_ipc_ack_signal(self, version: int) -> str:
        """List one entry per ack of one version: what the publisher blocks on between counts."""
        return f"{self.run}:ws:ipcack:{version}:signal"


# Every process rides out a Redis restart (the launcher restarts its local server from the AOF):
# commands are retried with backoff on connection errors for about REDIS_OUTAGE_S in all.
REDIS_OUTAGE_S = 30.0
_RETRY_CAP_S = 1.0  # backoff ceiling: a restarted server is noticed within a second
CONNECT_TIMEOUT_S = 10  # one connection attempt to a host that drops packets gives up after this (retries follow)


def mark_startup(r, keys: Keys, role: str, event: str) -> None:
    """Record when `role` first reached `event` on its way to the first trained step (status.json's `startup`:
    where launch -> first step goes). The first time stays: a restarted process does not move it."""
    r.hsetnx(keys.startup, f"{role}:{event}", repr(time.time()))


def connect(url: str, outage_s: float = REDIS_OUTAGE_S, socket_timeout_s: float | None = None):
    """A client of the run's Redis that retries through an outage of about `outage_s`. `socket_timeout_s`: how
    long one reply may take (None: forever, as the run's processes need for their blocking reads; a check or
    an operator command gives up on a peer that accepts connections and never answers)."""
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retries = int(outage_s / _RETRY_CAP_S) + 5
    # A run's Redis off loopback requires the per-run password, which reaches processes only by
    # environment (runbase/net.py): never in the URL, so it is never in a log line or job.json.
    password = os.environ.get(ENV_REDIS_PASSWORD) or None
    # a reply that timed out is not retried: each try would wait socket_timeout_s again
    transient = (redis.ConnectionError, ConnectionResetError) + (redis.TimeoutError, TimeoutError) * (
        socket_timeout_s is None)
    return redis.Redis.from_url(url, password=password, socket_timeout=socket_timeout_s,
                                socket_connect_timeout=CONNECT_TIMEOUT_S,
                                retry=Retry(ExponentialBackoff(cap=_RETRY_CAP_S, base=0.05), retries, transient),
                                retry_on_error=list(transient))
