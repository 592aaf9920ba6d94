"""The learner's view of the buffer: read with a consumer group, filter by staleness, ack.

Entries stay pending in the consumer group from read until `ack` (after the optimizer step),
so a learner crash loses nothing: a restarted learner can reclaim them. Acked entries are
deleted, so the stream holds only what is unconsumed; its length is bounded by admission.
"""
from __future__ import annotations

import logging
import time

from buffer.core import Batch, TrajectorySource
from buffer.store import DEADLETTER_HEAD_BYTES
from buffer.schema import Limits, SchemaError, decode
from buffer.staleness import admissible, staleness
from buffer.store import CONSUMER_GROUP, DISCARD_LUA, SKIP_LUA
from runbase.keys import Keys

log = logging.getLogger(__name__)

CLAIM_BATCH = 1000   # entries per XAUTOCLAIM call when taking over a dead learner's reads
READ_BLOCK_MS = 200  # XREADGROUP block per call: short, so `should_stop` is honoured promptly


class RedisSampler(TrajectorySource):
    def __init__(self, r, keys: Keys, *, groups_per_step: int, max_staleness: int,
                 limits: Limits = Limits(), consumer: str = "rank0", should_stop=lambda: False,
                 deadletter_maxlen: int = 10000):
        self.r, self.keys, self.G, self.s = r, keys, groups_per_step, max_staleness
        self.deadletter_maxlen = deadletter_maxlen
        self.limits, self.consumer, self.should_stop = limits, consumer, should_stop
        # A restarted learner first takes over what earlier learners read but never acked (their
        # pending entries, kept by the consumer group across the crash), then reads new entries.
        self._pel_cursor: str | None = "0-0"
        try:
            r.xgroup_create(keys.traj, CONSUMER_GROUP, id="0", mkstream=True)
        except Exception as e:  # BUSYGROUP: it exists already (a restarted learner)
            if "BUSYGROUP" not in str(e):
                raise
        self._discard_script = r.register_script(DISCARD_LUA)
        self._skip_script = r.register_script(SKIP_LUA)
        self.reclaimed = self._claim_orphans()
        self._held: set = set()  # entry ids handed out in batches and not yet acked

    def _claim_orphans(self) -> int:
        """XAUTOCLAIM every entry pending under another consumer (a dead learner's reads) into
        ours, then forget those consumers. Returns how many entries were taken over."""
        n, start = 0, "0-0"
        while True:
            resp = self.r.xautoclaim(self.keys.traj, CONSUMER_GROUP, self.consumer, min_idle_time=0,
                                     start_id=start, count=CLAIM_BATCH)
            start, claimed = resp[0], resp[1]
            n += len(claimed)
            if start in (b"0-0", "0-0"):
                break
        for c in self.r.xinfo_consumers(self.keys.traj, CONSUMER_GROUP):
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name != self.consumer and c["pending"] == 0:
                self.r.xgroup_delconsumer(self.keys.traj, CONSUMER_GROUP, name)
        if n:
            log.warning("took over %d trajectory entries a previous learner read but never acked", n)
        return n

    def _lost_reads(self) -> bool:
        """True if Redis holds more of our reads pending than we handed out: a read whose reply
        was lost (a Redis restart; the client retried and read on). Those are re-read from the PEL."""
        info = self.r.xpending(self.keys.traj, CONSUMER_GROUP)
        mine = sum(c["pending"] for c in info.get("consumers") or []
                   if (c["name"].decode() if isinstance(c["name"], bytes) else c["name"]) == self.consumer)
        return mine > len(self._held)

    def next_batch(self, learner_version: int) -> Batch:
        t0 = time.monotonic()
        groups, payloads, ids, dropped = [], [], [], 0
        if self._pel_cursor is None and self._lost_reads():
            log.warning("re-reading trajectory entries whose read reply was lost")
            self._pel_cursor = "0-0"
        while len(groups) < self.G:
            if self.should_stop():
                raise InterruptedError("stop requested while waiting for trajectories")
            if self._pel_cursor is not None:
                resp = self.r.xreadgroup(CONSUMER_GROUP, self.consumer, {self.keys.traj: self._pel_cursor},
                                         count=self.G - len(groups))
                if not resp or not resp[0][1]:
                    self._pel_cursor = None
                    continue
                self._pel_cursor = resp[0][1][-1][0]
            else:
                resp = self.r.xreadgroup(CONSUMER_GROUP, self.consumer, {self.keys.traj: ">"},
                                         count=self.G - len(groups), block=READ_BLOCK_MS)
            for _stream, entries in resp or []:
                for entry_id, fields in entries:
                    if entry_id in self._held or entry_id in ids:  # a PEL re-read: already handed out
                        continue
                    if not fields:  # deleted while pending: nothing to train on
                        self._discard(entry_id, "vanished")
                        continue
                    payload = fields[b"d"]
                    try:
                        g = decode(payload, self.limits, trusted=True)  # validated by the ingest
                    except SchemaError as e:  # cannot happen after ingest validation; never train on it
                        log.error("dropping undecodable buffer entry %s: %s", entry_id, e)
                        self._discard(entry_id, "undecodable")
                        continue
                    if not admissible(learner_version, g.version_start, self.s):
                        dropped += 1
                        log.info("dropped stale group %s (staleness %d > %d)", g.group_id,
                                 staleness(learner_version, g.version_start), self.s)
                        self._discard(entry_id, "stale")
                        continue
                    groups.append(g)
                    payloads.append(payload)
                    ids.append(entry_id)
        self._held.update(ids)
        return Batch(groups, payloads, ids, dropped, time.monotonic() - t0)

    def _discard(self, entry_id, reason: str) -> bool:
        """Ack and delete an entry that is not trained; count it (and free an admission slot for a
        stale one) exactly once, even when Redis ran this but the reply was lost and the client retried."""
        return bool(self._discard_script(keys=[self.keys.traj, self.keys.rejected, self.keys.dropped],
                                         args=[CONSUMER_GROUP, entry_id, reason]))

    def ack(self, batch: Batch) -> None:
        self.ack_ids(batch.entry_ids)

    def skip(self, batch: Batch, reason: str, step: int) -> int:
        """The learner did not apply this batch (`reason`, e.g. a non-finite loss): each group is acked (never
        re-read, not on resume either), counted under `reason`, dead-lettered and frees its admission slot,
        once per entry. Returns how many were dead-lettered by this call."""

        n, k = 0, self.keys
        for entry_id, g, payload in zip(batch.entry_ids, batch.groups, batch.payloads):
            entry = {"reason": reason, "error": f"learner step {step} not applied: {reason}", "t": time.time(),
                     "group_id": g.group_id, "step": step, "bytes": len(payload),
                     "head": payload[:DEADLETTER_HEAD_BYTES]}
            n += int(self._skip_script(keys=[k.traj, k.rejected, k.dropped, k.deadletter],
                                       args=[CONSUMER_GROUP, entry_id, reason, self.deadletter_maxlen,
                                             *(x for kv in entry.items() for x in kv)]))
        self._held.difference_update(batch.entry_ids)
        return n

    def ack_ids(self, entry_ids) -> None:
        self._held.difference_update(entry_ids)
        if entry_ids:
            pipe = self.r.pipeline()
            pipe.xack(self.keys.traj, CONSUMER_GROUP, *entry_ids)
            pipe.xdel(self.keys.traj, *entry_ids)
            pipe.execute()
