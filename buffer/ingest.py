"""The ZeroMQ ingest server: validates each trajectory message and stores it in Redis.

Actors connect DEALER sockets to this ROUTER. Every message gets exactly one reply:
`{"ok": true, "gid": ...}` once the group is in the Redis stream (the producer ack), or
`{"ok": false, "reason": ..., "error": ...}` after it was counted and dead-lettered. A bad
message never stops the loop and never reaches the learner.
"""
from __future__ import annotations

import logging
import time

import msgpack

from cluster import faults

from buffer.schema import Limits, SchemaError, decode
from buffer.store import STORE_LUA, Keys

log = logging.getLogger(__name__)

POLL_MS = 100              # how often the loop looks at the stop flag while idle
# Messages already waiting are taken together, up to this many, and stored in one Redis round trip
# (one AOF fsync for all of them); nothing waits for a batch to fill, so latency does not grow.
INGEST_BATCH = 64
DEADLETTER_HEAD_BYTES = 512  # keep only the start of a rejected message: enough to debug, bounded


class IngestServer:
    def __init__(self, r, keys: Keys, limits: Limits, *, host: str = "127.0.0.1", port: int = 0,
                 deadletter_maxlen: int = 10000, shard: int = 0):
        import zmq

        from cluster.net import curve_server

        self.r, self.keys, self.limits, self.deadletter_maxlen = r, keys, limits, deadletter_maxlen
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # With the run's CURVE keys in the environment (any run bound off loopback), only clients
        # holding the run's client key complete the handshake: others never get a message through.
        self.auth, curve_public = curve_server(self.sock)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._store = r.register_script(STORE_LUA)
        self.accepted = 0
        self.rejected: dict[str, int] = {}
        self._fault_armed = False  # chaos tests only (cluster.faults); refreshed with the stop check
        # Shard i is announced as `address:i`; shard 0 also as `address` (one ingest, older readers).
        announce = {f"address:{shard}": self.address, **({"address": self.address} if shard == 0 else {})}
        if curve_public:
            announce["curve_public"] = curve_public
        r.hset(keys.ingest, mapping=announce)

    def handle(self, payload: bytes) -> dict:
        """Validate and store one message; returns the reply (pure apart from Redis writes)."""
        return self.handle_batch([payload])[0]

    def handle_batch(self, payloads: list[bytes]) -> list[dict]:
        """Validate each message; store the valid ones in one pipelined round trip; one reply each,
        in order. An ack means the group is in the stream (and on disk with fsync `always`)."""
        replies: list[dict | None] = [None] * len(payloads)
        valid = []
        for i, payload in enumerate(payloads):
            try:
                valid.append((i, decode(payload, self.limits).group_id, payload))
            except SchemaError as e:
                self._reject(e.reason, str(e), payload)
                replies[i] = {"ok": False, "reason": e.reason, "error": str(e)}
        if valid:
            if self._fault_armed and faults.take(self.r, self.keys.run, faults.INGEST_KILL_BEFORE_STORE):
                faults.die()
            pipe = self.r.pipeline(transaction=False)
            for _i, gid, payload in valid:
                self._store(keys=[self.keys.traj, self.keys.seen, self.keys.leases], args=[gid, payload], client=pipe)
            stored = pipe.execute()
            if n := sum(1 for x in stored if x):
                self.accepted += n
                self.r.hincrby(self.keys.ingest, "accepted", n)
            for (i, gid, _p), ok in zip(valid, stored):
                replies[i] = {"ok": True, "gid": gid, "duplicate": not ok}
        return replies

    def _reject(self, reason: str, message: str, payload: bytes) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        log.warning("ingest rejected a message (%s): %s", reason, message)
        pipe = self.r.pipeline()
        pipe.hincrby(self.keys.rejected, reason, 1)
        pipe.xadd(self.keys.deadletter, {"reason": reason, "error": message[:1000], "t": time.time(),
                                         "bytes": len(payload), "head": payload[:DEADLETTER_HEAD_BYTES]},
                  maxlen=self.deadletter_maxlen, approximate=True)
        pipe.execute()

    def serve(self, should_stop=lambda: False) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        last_check = time.monotonic()
        while True:
            busy = poller.poll(POLL_MS)
            if time.monotonic() - last_check > POLL_MS / 1000:  # not per message: it costs a Redis call
                if should_stop():
                    return
                self._fault_armed = faults.armed(self.r, self.keys.run, faults.INGEST_KILL_BEFORE_STORE)
                last_check = time.monotonic()
            if not busy:
                continue
            idents, replies, payloads, slots = [], [], [], []
            while len(idents) < INGEST_BATCH:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                ident, body = frames[0], frames[1:]
                idents.append(ident)
                if len(body) != 1:  # a DEALER sends exactly one frame per message
                    self._reject("malformed", f"expected 1 frame, got {len(body)}", b"".join(body))
                    replies.append({"ok": False, "reason": "malformed", "error": f"expected 1 frame, got {len(body)}"})
                else:
                    replies.append(None)
                    payloads.append(body[0])
                    slots.append(len(replies) - 1)
            for slot, reply in zip(slots, self.handle_batch(payloads) if payloads else []):
                replies[slot] = reply
            for ident, reply in zip(idents, replies):
                self.sock.send_multipart([ident, msgpack.packb(reply)])

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.sock.close(0)
        self.ctx.term()
