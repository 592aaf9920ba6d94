"""The Redis layout of a run and the atomic scripts that keep it consistent.

Every key is prefixed by the run id so several runs can share one server. Multi-key updates
that must not interleave (admission + lease, idempotent store) are Lua scripts: Redis runs
each atomically.
"""
from __future__ import annotations

import json
import os
import time

CONSUMER_GROUP = "learner"


class Keys:
    """Names of a run's keys (see DESIGN.md, Redis layout)."""

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
        self.ws_begun = p + "ws:begun"        # zset, member v: newest version the weight publisher has
                                              # begun to send; no sample can come from a later one
        self.seen = p + "seen"                # set of stored group ids (idempotent resends)
        self.learner = p + "learner"          # hash: learner rank 0's pid and host
        self.members = p + "members"          # hash actor_id -> JSON status (version, checksum, heartbeat)
        self.deadletter = p + "deadletter"    # stream of rejected messages with reasons
        self.rejected = p + "rejected"        # hash reason -> count
        self.ingest = p + "ingest"            # hash: address, accepted, bytes
        self.checksums = p + "checksums"      # hash version -> learner weight checksum
        self.ws = p + "ws"                    # hash: weight-sync rendezvous address, layout
        self.ws_members = p + "ws:members"    # hash actor_id -> last heartbeat of its weight subscriber
        self.ws_announce = p + "ws:announce"  # stream: one entry per publication attempt (version, epoch, ranks)
        self.val = p + "val"                  # hash version -> held-out reward
        self.val_requests = p + "val:requests"  # set of versions the learner wants evaluated (trainer.val_engine=vllm)
        self.val_results = p + "val:results"  # hash version -> JSON {reward, accuracy, eval_s} or {skipped}
        self.metrics = p + "metrics"          # latest learner metrics (JSON) for status/progress
        self.stop = p + "stop"                # set when the learner is done: actors finish their batch and exit
        self.stop_ingest = p + "stop_ingest"  # set after actors drained, so their last groups still get acks
        self.error = p + "error"              # first fatal error reported by any process
        self.scale_target = p + "scale_target"  # desired number of actors (set by cluster.scale)
        self.export = p + "export"            # set by cluster.export: save the policy after the current step
        self.exported = p + "exported"        # list of exported policy folders, newest last
        self.faults = p + "faults"            # one-shot faults armed by chaos tests (cluster.faults)

    def drain(self, actor_id: str) -> str:
        """Set to ask one actor to finish its batch, leave the weight group and exit."""
        return f"{self.run}:drain:{actor_id}"


# Admission (DESIGN.md, Staleness): a group may start only while started < (v + s + 1) * G
# (+ groups dropped as stale, which must be replaced), and only by an actor whose weights
# are at most s versions old. Leasing pops prompts and records the lease in the same step.
# Returns {-1} (actor weights too old), {0} (full or no prompts), or {1, gid1, p1, gid2, p2...}.
LEASE_LUA = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local s = tonumber(ARGV[1])
local G = tonumber(ARGV[2])
if tonumber(ARGV[3]) < v - s then return {-1} end
local started = tonumber(redis.call('GET', KEYS[2]) or '0')
local dropped = tonumber(redis.call('GET', KEYS[3]) or '0')
local n = math.min(tonumber(ARGV[4]), (v + s + 1) * G + dropped - started)
local out = {1}
for i = 1, n do
  local p = redis.call('LPOP', KEYS[4])
  if not p then break end
  local gid = 'g' .. redis.call('INCR', KEYS[6])
  redis.call('HSET', KEYS[5], gid, cjson.encode({actor = ARGV[5], t = tonumber(ARGV[6]), prompt = p}))
  out[#out + 1] = gid
  out[#out + 1] = p
end
if #out == 1 then return {0} end
redis.call('INCRBY', KEYS[2], (#out - 1) / 2)
return out
"""

# Idempotent store: a resent group (same group_id) is acknowledged but stored once.
STORE_LUA = """
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[1], '*', 'd', ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""


# A rejected message (counted, dead-lettered) whose group holds a lease gives the lease back and frees
# its admission slot, as a stale drop does: HDEL succeeds once, so a resent rejection frees nothing twice.
# The prompt is not re-queued (like a stale group's, it was used). Returns 1 if a lease was released.
# KEYS: rejected, deadletter, leases, dropped; ARGV: reason, deadletter maxlen, group id ('' = none
# known), then the dead-letter entry's field/value pairs.
REJECT_LUA = """
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
local released = 0
if ARGV[3] ~= '' and redis.call('HDEL', KEYS[3], ARGV[3]) == 1 then
  redis.call('INCR', KEYS[4])
  released = 1
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'lease', released, unpack(ARGV, 4))
return released
"""

# The sampler discards an entry it will not train (stale, vanished, undecodable), counting it once:
# only the call whose XACK took the entry out of the pending list counts, so a transaction that Redis
# ran but whose reply was lost (the client runs it again) counts nothing the second time.
# KEYS: traj, rejected, dropped; ARGV: consumer group, entry id, reason. Returns 1 if counted.
DISCARD_LUA = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], 'dropped_' .. ARGV[3], 1)
if ARGV[3] == 'stale' then redis.call('INCR', KEYS[3]) end
return 1
"""


# A step the learner could not apply (a non-finite loss or gradient norm; it retries the step number on
# other groups): each of its entries is acked and deleted, counted under `reason`, dead-lettered with its
# group id, and frees its admission slot (as a stale drop: the group was used, a fresh one replaces it).
# As in DISCARD_LUA only the call whose XACK took the entry out of the pending list does so. KEYS: traj,
# rejected, dropped, deadletter; ARGV: consumer group, entry id, reason, dead-letter maxlen, then the
# dead-letter entry's field/value pairs. Returns 1 if counted.
SKIP_LUA = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('INCR', KEYS[3])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 5))
return 1
"""


# Every process rides out a Redis restart (the launcher restarts its local server from the AOF):
# commands are retried with backoff on connection errors for about REDIS_OUTAGE_S in all.
REDIS_OUTAGE_S = 30.0
_RETRY_CAP_S = 1.0  # backoff ceiling: a restarted server is noticed within a second


def connect(url: str, outage_s: float = REDIS_OUTAGE_S):
    """A client of the run's Redis that retries through an outage of about `outage_s`."""
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retries = int(outage_s / _RETRY_CAP_S) + 5
    # A run's Redis off loopback requires the per-run password, which reaches processes only by
    # environment (cluster/net.py): never in the URL, so it is never in a log line or job.json.
    password = os.environ.get("ASYNCRL_REDIS_PASSWORD") or None
    return redis.Redis.from_url(url, password=password, socket_timeout=None, socket_connect_timeout=10,
                                retry=Retry(ExponentialBackoff(cap=_RETRY_CAP_S, base=0.05), retries),
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError, ConnectionResetError])


class Leaser:
    """Actor side of admission: lease prompt groups under the staleness rule."""

    def __init__(self, r, keys: Keys, *, max_staleness: int, groups_per_step: int, actor_id: str):
        self.keys, self.s, self.G, self.actor_id = keys, max_staleness, groups_per_step, actor_id
        self._lease = r.register_script(LEASE_LUA)

    def lease(self, want: int, actor_version: int):
        """Returns None if this actor's weights are too old, else a list of (group_id, prompt dict)."""
        k = self.keys
        res = self._lease(keys=[k.version, k.started, k.dropped, k.prompts, k.leases, k.group_seq],
                          args=[self.s, self.G, actor_version, want, self.actor_id, time.time()])
        if res[0] == -1:
            return None
        return [(res[i].decode(), json.loads(res[i + 1])) for i in range(1, len(res), 2)]


# A dead actor's leases: prompts go back to the front of the queue, and each lease frees an
# admission slot (counted like a dropped group, since the group it stood for never arrives).
RECLAIM_LUA = """
local n = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local lease = cjson.decode(all[i + 1])
  if ARGV[1] == '' or lease.actor == ARGV[1] then
    redis.call('HDEL', KEYS[1], all[i])
    redis.call('LPUSH', KEYS[2], lease.prompt)
    n = n + 1
  end
end
if n > 0 then
  redis.call('INCRBY', KEYS[3], n)
  redis.call('HINCRBY', KEYS[4], 'lease_reclaimed', n)
end
return n
"""


def reclaim_leases(r, keys: Keys, actor_id: str | None) -> int:
    """Return an actor's leases (all leases when actor_id is None: a resumed job's actors are new)."""
    return int(r.eval(RECLAIM_LUA, 4, keys.leases, keys.prompts, keys.dropped, keys.rejected, actor_id or ""))
