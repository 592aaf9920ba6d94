"""ZeroMQ trajectory sender: a DEALER socket that waits for the ingest's per-group ack."""
from __future__ import annotations

import logging
import time
from typing import Sequence

import msgpack

from buffer.core import TrajectorySink
from buffer.schema import Group, Limits, encode
from runbase.net import curve_client

log = logging.getLogger(__name__)

ACK_TIMEOUT_S = 30.0   # an ingest that stores nothing for this long is down, not slow: resend
RESENDS = 3            # resends of unacknowledged groups before giving up (group_id keeps them idempotent)
ADDRESS_CHECK_S = 1.0  # while acks are missing, how often to look for a restarted ingest's new address


class ZmqTrajectorySink(TrajectorySink):
    """Sends groups and waits for the ingest's per-group acks. `address` is a string, or a
    callable returning the current address: then a restarted ingest (new address) is followed
    and every unacknowledged group is resent to it at once. `server_public` (bytes, or a callable
    returning them) is the ingest's CURVE public key when the run authenticates its data plane."""

    def __init__(self, address, limits: Limits = Limits(), server_public=None):
        self._lookup = address if callable(address) else (lambda: address)
        self._server_public = server_public if callable(server_public) else (lambda: server_public)
        self.limits = limits
        self.sock = None
        self._connect(self._lookup())

    def _connect(self, address: str) -> None:
        import zmq

        if self.sock is not None:
            self.sock.close(0)  # drops whatever was queued for the dead peer
        else:
            self.ctx = zmq.Context()
        self.address = address
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve_client(self.sock, self._server_public())  # before connect: the handshake uses it
        self.sock.connect(address)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def send_raw(self, payload: bytes) -> None:
        self.sock.send(payload)

    def recv_reply(self, timeout_s: float) -> dict | None:
        if not self.poller.poll(int(timeout_s * 1000)):
            return None
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def send(self, groups: Sequence[Group]) -> list[str | None]:
        payloads = {}
        for g in groups:
            g.sent_at = time.time()
            payloads[g.group_id] = encode(g, self.limits)
        results: dict[str, str | None] = {}

        def resend(why: str) -> float:
            pending = [gid for gid in payloads if gid not in results]
            if why:
                log.warning("resending %d unacknowledged groups to %s (%s)", len(pending), self.address, why)
            for gid in pending:
                self.send_raw(payloads[gid])
            return time.monotonic() + ACK_TIMEOUT_S

        deadline, resends = resend(""), 0
        next_check = time.monotonic() + ADDRESS_CHECK_S
        while len(results) < len(payloads):
            now = time.monotonic()
            reply = self.recv_reply(max(0.0, min(deadline, next_check) - now))
            if reply is not None:
                self._record(reply, payloads, results)
                continue
            now = time.monotonic()
            if now >= next_check:
                next_check = now + ADDRESS_CHECK_S
                addr = self._lookup()
                if addr and addr != self.address:  # the ingest was restarted elsewhere
                    self._connect(addr)
                    deadline = resend("the ingest moved")
                    continue
            if now >= deadline:
                if resends == RESENDS:
                    missing = len(payloads) - len(results)
                    raise TimeoutError(f"ingest at {self.address} did not acknowledge {missing} groups "
                                       f"after {RESENDS} resends")
                resends += 1
                deadline = resend(f"attempt {resends}")
        return [results[g.group_id] for g in groups]

    @staticmethod
    def _record(reply: dict, payloads: dict, results: dict) -> None:
        gid = reply.get("gid")
        if reply.get("ok") and gid in payloads:
            results[gid] = None
        elif not reply.get("ok"):
            # Rejections carry no gid when the message was undecodable; ours always decode,
            # so attribute it to the oldest pending group.
            rest = [g for g in payloads if g not in results]
            if rest:
                results[rest[0]] = reply.get("reason", "rejected")
                log.error("ingest rejected group %s: %s", rest[0], reply.get("error"))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class BackgroundSender:
    """The rollout loop's side of sending: `put` queues finished groups and returns at once; a thread
    sends them through a `ZmqTrajectorySink` (which it alone owns: ZeroMQ sockets are not thread-safe)
    and waits for their acks, batching whatever queued up meanwhile. A sending failure (acks that never
    came after every resend) is raised in the loop by the next `check`, `put` or `close`."""

    def __init__(self, sink: ZmqTrajectorySink):
        import queue
        import threading

        self.sink = sink
        self.groups_sent = 0          # groups acknowledged by the ingest (stored or rejected)
        self.error: BaseException | None = None
        self._q: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trajectory-sender", daemon=True)
        self._thread.start()

    def put(self, groups: Sequence[Group]) -> None:
        self.check()
        self._q.put(list(groups))

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"trajectory sender failed: {self.error}") from self.error

    def _run(self) -> None:
        import queue

        while True:
            try:
                batch = self._q.get(timeout=0.05)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            while True:  # everything queued meanwhile goes in the same round of acks
                try:
                    batch += self._q.get_nowait()
                except queue.Empty:
                    break
            try:
                self.sink.send(batch)
            except BaseException as e:  # noqa: BLE001 - reported to the loop, which decides
                self.error = e
                return
            self.groups_sent += len(batch)

    def close(self, timeout_s: float, *, quiet: bool = False) -> None:
        """Send what is queued (waiting up to timeout_s for its acks), stop the thread, close the socket;
        then raise a sending failure unless `quiet` (an exit that is already failing)."""
        if self._thread is None:
            return
        self._closing.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("trajectory sender still waiting for acks after %.0f s; closing", timeout_s)
            # the thread is a daemon blocked in a poll of its own socket: leave it, the process exits soon
        else:
            self.sink.close()
        self._thread = None
        if not quiet:
            self.check()
