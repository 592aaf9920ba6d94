"""The ZeroMQ ingest server: validates each trajectory message and stores it in Redis.

Actors connect DEALER sockets to this ROUTER. Every message gets exactly one reply:
`{"ok": true, "gid": ...}` once the group is in the Redis stream (the producer ack), or
`{"ok": false, "reason": ..., "error": ...}` after it was counted and dead-lettered (a rejected
group's lease is released then, freeing its admission slot). A bad message never stops the loop and
never reaches the learner. A frame over `max_message_bytes` is dropped by the socket itself
(MAXMSGSIZE): it costs no memory, gets no reply, and its peer's disconnect is counted (`peers_dropped`).
"""
from __future__ import annotations

import logging
import time

import msgpack

from buffer.schema import Limits, SchemaError, check_version, decode
from buffer.store import STORE_LUA, reject_group
from runbase.keys import Keys
from runbase.net import curve_server

log = logging.getLogger(__name__)

POLL_MS = 100              # how often the loop looks at the stop flag while idle
# Messages already waiting are taken together, up to this many, and stored in one Redis round trip
# (one AOF fsync for all of them); nothing waits for a batch to fill, so latency does not grow.
INGEST_BATCH = 64
# Errors a malformed message can raise past validate() (a value it let through that float() refuses,
# a structure too deep): the message is rejected as malformed. Redis errors are not here: they restart.
DECODE_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)


class IngestServer:
    def __init__(self, r, keys: Keys, limits: Limits, *, host: str = "127.0.0.1", port: int = 0,
                 deadletter_maxlen: int = 10000, shard: int = 0):
        import zmq

        self.r, self.keys, self.limits, self.deadletter_maxlen = r, keys, limits, deadletter_maxlen
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # An oversized frame is refused as its header arrives (never read into memory): ZeroMQ drops
        # the peer without a reply, which the monitor below sees as a disconnect.
        self.sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._delivered: set[int] = set()  # fds of connections that delivered a message since accepted
        self._gone: list[int] = []         # fds of disconnects not judged yet (messages may be queued)
        self.peers_dropped = 0
        # With the run's CURVE keys in the environment (any run bound off loopback), only clients
        # holding the run's client key complete the handshake: others never get a message through.
        self.auth, curve_public = curve_server(self.sock)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._store_script = r.register_script(STORE_LUA)
        # Newest weights the publisher has begun to send, as last read: refreshed only when a group
        # claims a newer version, so an ordinary message costs no extra Redis round trip.
        self.newest_version = 0
        self.accepted = 0
        self.rejected: dict[str, int] = {}
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
                g = decode(payload, self.limits)
                self._check_version(g)
                valid.append((i, g.group_id, payload))
            except SchemaError as e:
                self._reject(e.reason, str(e), payload, self._group_id(payload))
                replies[i] = {"ok": False, "reason": e.reason, "error": str(e)}
            except DECODE_ERRORS as e:  # a hole in validate(): reject the message, never die on it
                msg = f"message: {type(e).__name__}: {e}"
                self._reject("malformed", msg, payload, self._group_id(payload))
                replies[i] = {"ok": False, "reason": "malformed", "error": msg}
        if valid:
            stored = self.store([(gid, payload) for _i, gid, payload in valid])
            for (i, gid, _p), ok in zip(valid, stored):
                replies[i] = {"ok": True, "gid": gid, "duplicate": not ok}
        return replies

    def store(self, groups: list[tuple[str, bytes]]) -> list[bool]:
        """Write validated (group id, payload) pairs in one pipelined round trip; per group, whether it
        was new (False: a duplicate, stored before)."""
        pipe = self.r.pipeline(transaction=False)
        for gid, payload in groups:
            self._store_script(keys=[self.keys.traj, self.keys.seen, self.keys.leases], args=[gid, payload, time.time()],
                               client=pipe)
        stored = [bool(x) for x in pipe.execute()]
        if n := sum(stored):
            self.accepted += n
            self.r.hincrby(self.keys.ingest, "accepted", n)
        return stored

    def _check_version(self, g) -> None:
        if g.version_end > self.newest_version:  # a newer publication began since we last looked?
            pipe = self.r.pipeline(transaction=False)
            pipe.get(self.keys.version)
            pipe.zscore(self.keys.ws_begun, "v")
            v, begun = pipe.execute()
            self.newest_version = max(self.newest_version, int(v or 0), int(begun or 0))
        check_version(g, self.newest_version)

    def _group_id(self, payload: bytes) -> str:
        """The group id of a rejected message, if its structure parses ('' if not): its lease is returned."""
        try:
            gid = decode(payload, self.limits, trusted=True).group_id
        except (SchemaError, *DECODE_ERRORS):  # trusted=True skips the checks: a bad float field raises
            return ""
        return gid if isinstance(gid, str) and 1 <= len(gid) <= 128 else ""

    def _reject(self, reason: str, message: str, payload: bytes, gid: str = "") -> None:
        """Count and dead-letter a message; a group that holds a lease releases it (once) and frees its
        admission slot, like a stale drop: the actor moves on, and nothing re-queues its prompt at exit."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        log.warning("ingest rejected a message (%s): %s", reason, message)
        reject_group(self.r, self.keys, reason=reason, error=message, gid=gid,
                     deadletter_maxlen=self.deadletter_maxlen, payload=payload)

    def serve(self, should_stop=lambda: False) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        last_check = -float("inf")   # the first pass looks: a stop set while this process started
        while True:                  # is seen before the first message waiting is served
            busy = dict(poller.poll(POLL_MS))
            if time.monotonic() - last_check > POLL_MS / 1000:  # not per message: it costs a Redis call
                last_check = time.monotonic()
                if should_stop():
                    return
            if self.monitor in busy:
                self._read_monitor()
            if busy and self._serve_batch() and self._gone:
                self._judge_disconnects()

    def _serve_batch(self) -> bool:
        """Take the messages waiting (up to INGEST_BATCH), handle and answer them; True when the socket
        ran dry, i.e. every message queued before the disconnects seen so far has been taken."""
        import zmq

        idents, replies, payloads, slots = [], [], [], []
        dry = False
        while len(idents) < INGEST_BATCH:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                dry = True
                break
            ident, body = frames[0].bytes, [f.bytes for f in frames[1:]]
            self._delivered.add(frames[-1].get(zmq.SRCFD))  # the connection it came on is not silent
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
        return dry

    def _read_monitor(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._gone.append(event["value"])  # the connection's fd

    def _judge_disconnects(self) -> None:
        """A connection that closed without delivering a message was dropped by the socket (a frame over
        max_message_bytes; also a client that left without sending, or failed the CURVE handshake)."""
        silent = 0
        for fd in self._gone:
            if fd in self._delivered:
                self._delivered.discard(fd)
            else:
                silent += 1
        self._gone = []
        if silent:
            self.peers_dropped += silent
            self.r.hincrby(self.keys.ingest, "peers_dropped", silent)
            log.warning("%d peer(s) dropped before any message arrived (a frame over buffer.max_message_bytes=%d "
                        "bytes, or a client that sent nothing)", silent, self.limits.max_message_bytes)

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()
