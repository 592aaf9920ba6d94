"""A loopback TCP proxy that can drop every connection it carries at once: a network that cuts links, for the
soak (tests/chaos/soak.py). It listens on 127.0.0.1 and forwards each accepted connection to one target port,
byte for byte (Redis's RESP, ZeroMQ's ZMTP: the proxy reads neither); `drop()` closes both sides of every open
connection, as a reset link does, and the clients must reconnect by themselves."""
from __future__ import annotations

import socket
import threading

CHUNK = 65536           # one recv's worth: bytes are forwarded as they come, never held for a whole message
CONNECT_TIMEOUT_S = 5.0  # a target that does not accept on loopback in this long is down: the client's link is cut


class LoopbackProxy:
    """127.0.0.1:<port> -> 127.0.0.1:<target>. Threads: one accepting, two per connection (one each way)."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.pairs: set[tuple[socket.socket, socket.socket]] = set()
        self.lock = threading.Lock()
        self.accepted = self.dropped = 0   # connections carried; connections cut by drop()
        self.closed = False
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:   # the listener was closed: the proxy is done
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=CONNECT_TIMEOUT_S)
                upstream.settimeout(None)
            except OSError:   # the target is down (a restarting server): the client sees its link cut, and retries
                client.close()
                continue
            pair = (client, upstream)
            with self.lock:
                if self.closed:
                    _close(pair)
                    return
                self.pairs.add(pair)
                self.accepted += 1
            for src, dst in (pair, pair[::-1]):
                threading.Thread(target=self._pump, args=(src, dst, pair), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair) -> None:
        """Forwards src -> dst until either side closes; then closes both (one end gone ends the connection)."""
        try:
            while data := src.recv(CHUNK):
                dst.sendall(data)
        except OSError:
            pass
        with self.lock:
            self.pairs.discard(pair)
        _close(pair)

    def drop(self) -> int:
        """Closes both sides of every open connection; returns how many were cut."""
        with self.lock:
            pairs, self.pairs = self.pairs, set()
            self.dropped += len(pairs)
        for pair in pairs:
            _close(pair)
        return len(pairs)

    def close(self) -> None:
        """Stops accepting and cuts what is open."""
        with self.lock:
            self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes the accepting thread (a close alone does not on Linux)
        except OSError:
            pass
        self.listener.close()
        self.drop()


def _close(pair) -> None:
    for s in pair:
        try:
            s.shutdown(socket.SHUT_RDWR)   # wakes the pump blocked in recv on it, which a close alone may not
        except OSError:
            pass
        s.close()
