"""ZeroMQ trajectory sender: a DEALER socket that waits for the ingest's per-group ack."""
from __future__ import annotations

import logging
import time
from typing import Sequence

import msgpack

from buffer.core import TrajectorySink
from buffer.schema import Group, Limits, encode

log = logging.getLogger(__name__)

ACK_TIMEOUT_S = 30.0   # an ingest that stores nothing for this long is down, not slow: fail loudly
RESENDS = 3            # resends of unacknowledged groups before giving up (group_id keeps them idempotent)


class ZmqTrajectorySink(TrajectorySink):
    def __init__(self, address: str, limits: Limits = Limits()):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.limits = limits
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
        for attempt in range(RESENDS + 1):
            pending = [gid for gid in payloads if gid not in results]
            if not pending:
                break
            if attempt:
                log.warning("resending %d unacknowledged groups (attempt %d)", len(pending), attempt)
            for gid in pending:
                self.send_raw(payloads[gid])
            deadline = time.monotonic() + ACK_TIMEOUT_S
            while len(results) < len(payloads) and time.monotonic() < deadline:
                reply = self.recv_reply(max(0.0, deadline - time.monotonic()))
                if reply is None:
                    break
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
        missing = [gid for gid in payloads if gid not in results]
        if missing:
            raise TimeoutError(f"ingest did not acknowledge {len(missing)} groups after {RESENDS} resends")
        return [results[g.group_id] for g in groups]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
