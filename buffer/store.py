"""The atomic scripts that keep a run's Redis layout (runbase.keys.Keys) consistent.

Multi-key updates that must not interleave (admission + lease, idempotent store) are Lua scripts:
Redis runs each atomically.
"""
from __future__ import annotations

import json
import time

from buffer.staleness import lease_version
from runbase.keys import Keys

CONSUMER_GROUP = "learner"


# Admission (docs/design.md, Staleness): a group may start only while started < (v + s + 1) * G
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
local base = v
if ARGV[7] == 'actor' then base = math.min(v, tonumber(ARGV[3])) end  -- buffer.admission (staleness.py lease_version)
local n = math.min(tonumber(ARGV[4]), (base + s + 1) * G + dropped - started)
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

# Idempotent store: a resent group (same group_id) is acknowledged but stored once. `seen` is a zset
# group id -> when it was stored, trimmed to the last SEEN_KEEP_S: a resend comes from the sender that is
# still waiting for that group's ack (actors/sender.py: a few ACK_TIMEOUT_S at most), so older ids can never
# come back, and a set of every id ever stored grew by ~56 bytes a group for the whole run (~1 GB of Redis and
# AOF over a week at 16 groups per 0.3 s step). KEYS: traj, seen, leases; ARGV: group id, payload, now (s).
SEEN_KEEP_S = 3600.0
STORE_LUA = """
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (tonumber(ARGV[3]) - """ + repr(SEEN_KEEP_S) + """))
redis.call('XADD', KEYS[1], '*', 'd', ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""


# A rejected message (counted, dead-lettered) whose group holds a lease gives the lease back and frees
# its admission slot, as a stale drop does: HDEL succeeds once, so a resent rejection frees nothing twice.
# The prompt is not re-queued (like a stale group's, it was used). Returns 1 if a lease was released.
# KEYS: rejected, deadletter, leases, dropped, ingest; ARGV: reason, deadletter maxlen, group id ('' = none
# known), then the dead-letter entry's field/value pairs. The ingest hash's `rejected` counts this launch's
# rejections only (the launcher deletes that hash at start; `rejected` by reason spans the whole run).
DEADLETTER_HEAD_BYTES = 512  # keep only the start of a rejected message: enough to debug, bounded
REJECT_LUA = """
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('HINCRBY', KEYS[5], 'rejected', 1)
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


class Leaser:
    """Actor side of admission: lease prompt groups under the staleness rule."""

    def __init__(self, r, keys: Keys, *, max_staleness: int, groups_per_step: int, actor_id: str,
                 admission: str = "actor"):
        lease_version(0, 0, admission)   # a bad value is refused here, not inside the script
        self.keys, self.s, self.G, self.actor_id = keys, max_staleness, groups_per_step, actor_id
        self.admission = admission
        self._lease = r.register_script(LEASE_LUA)

    def lease(self, want: int, actor_version: int):
        """Returns None if this actor's weights are too old, else a list of (group_id, prompt dict)."""
        k = self.keys
        res = self._lease(keys=[k.version, k.started, k.dropped, k.prompts, k.leases, k.group_seq],
                          args=[self.s, self.G, actor_version, want, self.actor_id, time.time(), self.admission])
        if res[0] == -1:
            return None
        return [(res[i].decode(), json.loads(res[i + 1])) for i in range(1, len(res), 2)]


# A dead actor's leases: prompts go back to the front of the queue, and each lease frees an
# admission slot (counted like a dropped group, since the group it stood for never arrives).
# The group id is marked stored (`seen`): a message the actor sent before it died that reaches the
# ingest only now (queued behind a slow or paused ingest) is acked as a duplicate, never stored, so its
# prompt is not both re-queued and trained (it would count twice in the books). A group of multi-turn
# episodes with a journal (Keys.episodes, actors/journal.py) goes back tagged `"resume_gid": <its id>` at the
# front of the record's JSON (a previous tag replaced), so the next actor resumes its episodes from their last
# finished turns. ARGV: actor id ('' for all), now (s), the time `seen` is scored by (see STORE_LUA), the
# journals' key prefix.
RECLAIM_LUA = """
local n = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local lease = cjson.decode(all[i + 1])
  if ARGV[1] == '' or lease.actor == ARGV[1] then
    redis.call('HDEL', KEYS[1], all[i])
    redis.call('ZADD', KEYS[5], ARGV[2], all[i])
    local prompt = string.gsub(lease.prompt, '^{"resume_gid":"[^"]*",', '{')
    if redis.call('EXISTS', ARGV[3] .. all[i]) == 1 then
      prompt = '{"resume_gid":"' .. all[i] .. '",' .. string.sub(prompt, 2)
    end
    redis.call('LPUSH', KEYS[2], prompt)
    n = n + 1
  end
end
if n > 0 then
  redis.call('INCRBY', KEYS[3], n)
  redis.call('HINCRBY', KEYS[4], 'lease_reclaimed', n)
end
return n
"""


# Groups an actor aborted in flight because they can no longer be trained (started more than s versions
# before weights it holds, so at least that far behind the learner): counted exactly as the learner counts
# a stale drop on arrival (`dropped_<reason>`, and a freed admission slot), only sooner. HDEL succeeds
# once per lease, so a group whose lease was reclaimed meanwhile (actor presumed dead) counts nothing.
# The prompt is not re-queued (a stale drop's is not either). KEYS: leases, rejected, dropped; ARGV:
# reason, then the group ids. Returns the number counted.
ABANDON_LUA = """
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('HDEL', KEYS[1], ARGV[i])
end
if n > 0 then
  redis.call('HINCRBY', KEYS[2], 'dropped_' .. ARGV[1], n)
  redis.call('INCRBY', KEYS[3], n)
end
return n
"""
ABANDONED_STALE = "stale_in_flight"   # the reason: `dropped_stale_in_flight` in the run's rejected hash


def abandon_stale(r, keys: Keys, group_ids: list[str]) -> int:
    """Release the leases of groups aborted in flight as certain to be too stale; the number counted."""
    if not group_ids:
        return 0
    return int(r.eval(ABANDON_LUA, 3, keys.leases, keys.rejected, keys.dropped, ABANDONED_STALE, *group_ids))


def reject_group(r, keys: Keys, *, reason: str, error: str, gid: str, deadletter_maxlen: int,
                 payload: bytes = b"") -> int:
    """A message the ingest refuses, or a leased group its actor cannot generate (the engine refused its
    prompt): counted under `reason`, dead-lettered with its group id and the start of its payload, and a
    lease it holds released with its admission slot freed (REJECT_LUA; the launcher fails a job whose every
    group is rejected). 1 if a lease was released."""
    entry = {"reason": reason, "error": error[:1000], "t": time.time(), "gid": gid, "bytes": len(payload),
             "head": payload[:DEADLETTER_HEAD_BYTES]}
    return int(r.eval(REJECT_LUA, 5, keys.rejected, keys.deadletter, keys.leases, keys.dropped, keys.ingest,
                      reason, deadletter_maxlen, gid, *(x for kv in entry.items() for x in kv)))


def reclaim_leases(r, keys: Keys, actor_id: str | None) -> int:
    """Return an actor's leases (all leases when actor_id is None: a resumed job's actors are new)."""
    return int(r.eval(RECLAIM_LUA, 5, keys.leases, keys.prompts, keys.dropped, keys.rejected, keys.seen,
                      actor_id or "", time.time(), keys.episodes("")))
