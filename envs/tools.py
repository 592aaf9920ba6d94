"""Tools run off the caller's thread, each call with a time limit; code runs in a subprocess sandbox.

`ToolRunner.call(fn, argument)` runs `fn(argument) -> str` on one of a few daemon threads and waits at most
the call's timeout: a tool that hangs costs its caller the timeout, never more, and its thread is abandoned
(a Python thread cannot be killed; daemon threads never hold up the process's exit). A tool that raises, or
whose output is not text, gives an error result. The caller always gets a `ToolResult`.

`PythonSandbox.run(code)` runs code in `python -I` (no site packages of the user, no PYTHON* variables) in a
fresh session and an empty temporary directory, with CPU-seconds, address-space, file-size and process-count
limits set in the child before it execs (resource.setrlimit), a wall-clock limit after which the whole process
group is killed, and its output written to a size-limited file instead of a pipe (a flood of output cannot
fill the caller's memory). Nothing in it needs the network, and nothing of ours listens. The limits bound
what a run costs; they are not a jail: the code runs as the caller's user and sees its files.
"""
from __future__ import annotations

import math
import os
import queue
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable

from runbase.configload import ConfigError

OK, TIMEOUT, ERROR = "ok", "timeout", "error"

# Threads serving tool calls. Tools are short and episodes of one actor take turns with the engine, so a
# few suffice; more would only be threads asleep.
DEFAULT_TOOL_THREADS = 4
# Threads abandoned to hung calls before the runner refuses new calls: each still holds its stack and
# whatever it was given; past this many a tool is broken, not slow, and more threads would not help.
MAX_ABANDONED_THREADS = 32

# The sandbox's limits (PythonSandbox's defaults):
# CPU seconds a run may use: a tool call in a rollout answers in well under a second.
SANDBOX_CPU_S = 5
# Wall-clock seconds before the run's process group is killed: CPU time plus room for a sleep or I/O wait.
SANDBOX_WALL_S = 10.0
# Address space of the child: the interpreter needs ~30 MiB; numpy-sized work fits, a runaway list does not.
SANDBOX_MEMORY_MB = 512
# Bytes its stdout+stderr file (and any file it writes) may reach; what the model reads is cut further.
SANDBOX_FILE_BYTES = 1 << 20
# RLIMIT_NPROC: Linux counts every process and thread of the user, machine-wide, so this is a ceiling on the
# user's total, not the run's own count; high enough for a busy rollout host's threads, low enough that a fork
# bomb stops before the machine's pid space does (the wall limit then kills the group).
SANDBOX_NPROC = 4096
# Environment of a run: UTF-8 text, and one thread per numeric library (their thread pools would multiply the
# CPU seconds a run burns per wall second and the threads it counts against SANDBOX_NPROC).
SANDBOX_ENV = {"LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Seconds to wait for a killed process group to be reaped.
KILL_WAIT_S = 5.0


@dataclass(frozen=True)
class ToolResult:
    """One tool call's outcome, as the caller sees it."""

    status: str
    """OK, TIMEOUT or ERROR."""
    output: str
    """The tool's text (on an error: what it printed, or the error's message)."""
    error: str = ""
    """Why it failed: "timeout after 2 s", "exit code 3", "memory limit (512 MiB)"; empty when ok."""
    seconds: float = 0.0
    """Wall-clock seconds the caller waited."""

    @property
    def ok(self) -> bool:
        return self.status == OK


class ToolFailure(Exception):
    """Raised by a tool for a failure it knows the kind of (TIMEOUT or ERROR), with its output so far."""

    def __init__(self, status: str, error: str, output: str = ""):
        super().__init__(error)
        self.status, self.error, self.output = status, error, output


class ToolRunner:
    """A few daemon threads running tool calls with a per-call timeout. Share one per process."""

    def __init__(self, threads: int = DEFAULT_TOOL_THREADS):
        if threads < 1:
            raise ConfigError("threads", f"a tool runner needs at least one thread, got {threads}")
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0          # threads waiting for a job
        self._threads = 0       # threads alive (idle, busy, or abandoned to a hung call)
        self._min_threads = threads
        self.abandoned = 0      # calls that timed out and may still hold their thread
        self.closed = False

    def call(self, fn: Callable[[str], str], argument: str, timeout_s: float) -> ToolResult:
        """fn(argument) on a pool thread; its result, or an error/timeout result after at most timeout_s."""
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        start = time.monotonic()
        if self.closed:
            return ToolResult(ERROR, "", "the tool runner is closed")
        if not self._reserve_thread():
            return ToolResult(ERROR, "", f"all {self._threads} tool threads are busy, {self.abandoned} of them on "
                                         f"calls that hung; a runner takes as many calls at once as it has threads")
        future: Future = Future()
        self._jobs.put((fn, argument, future))
        try:
            out = future.result(timeout=timeout_s)
        except FutureTimeout:
            if future.cancel():   # it never started: no thread is lost to it
                return ToolResult(TIMEOUT, "", f"timeout after {timeout_s:g} s", time.monotonic() - start)
            with self._lock:
                self.abandoned += 1
            return ToolResult(TIMEOUT, "", f"timeout after {timeout_s:g} s", time.monotonic() - start)
        except ToolFailure as e:
            return ToolResult(e.status, e.output, e.error, time.monotonic() - start)
        except Exception as e:  # the tool's own bug is the episode's error result, not the caller's crash
            return ToolResult(ERROR, "", f"{type(e).__name__}: {e}", time.monotonic() - start)
        if not isinstance(out, str):
            return ToolResult(ERROR, "", f"the tool returned {type(out).__name__}, not text",
                              time.monotonic() - start)
        return ToolResult(OK, out, "", time.monotonic() - start)

    def close(self) -> None:
        """Stop the idle threads; a hung one stays asleep (it is a daemon)."""
        self.closed = True
        with self._lock:
            n = self._threads
        for _ in range(n):
            self._jobs.put(None)

    def _reserve_thread(self) -> bool:
        """Make sure a thread will take the next job: an idle one, or a new one while few are abandoned."""
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
                return True
            if self._threads >= self._min_threads + min(self.abandoned, MAX_ABANDONED_THREADS):
                return False
            self._threads += 1
        threading.Thread(target=self._serve, name="envs-tool", daemon=True).start()
        return True

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            fn, argument, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(argument))
                except BaseException as e:  # noqa: BLE001 - handed to the caller, who decides
                    future.set_exception(e)
            with self._lock:
                self._idle += 1
        with self._lock:
            self._threads -= 1
            self._idle -= 1


@dataclass(kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed run."""

    cpu_s: int = SANDBOX_CPU_S
    """CPU seconds (RLIMIT_CPU); past it the kernel stops the run (reported as "cpu limit")."""
    wall_s: float = SANDBOX_WALL_S
    """Wall-clock seconds before the run's whole process group is killed ("timeout after N s")."""
    memory_mb: int = SANDBOX_MEMORY_MB
    """Address space in MiB (RLIMIT_AS); an allocation past it fails ("memory limit")."""
    file_bytes: int = SANDBOX_FILE_BYTES
    """Largest file it may write (RLIMIT_FSIZE), its own output included ("output limit")."""
    nproc: int = SANDBOX_NPROC
    """RLIMIT_NPROC: the most processes and threads its user may have, machine-wide, while it runs."""

    def __post_init__(self):
        if self.cpu_s < 1:
            raise ConfigError("cpu_s", f"must be at least 1 second, got {self.cpu_s}")
        if not (math.isfinite(self.wall_s) and self.wall_s > 0):
            raise ConfigError("wall_s", f"must be a positive number of seconds, got {self.wall_s}")
        if self.memory_mb < 64:
            raise ConfigError("memory_mb", f"the interpreter alone needs more than {self.memory_mb} MiB; at least 64")
        if self.file_bytes < 1024:
            raise ConfigError("file_bytes", f"must be at least 1024, got {self.file_bytes}")
        if self.nproc < 1:
            raise ConfigError("nproc", f"must be at least 1, got {self.nproc}")


class PythonSandbox:
    """Python code in a limited subprocess: `run(code)` returns what it printed, or raises ToolFailure."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()

    def _limit(self) -> None:
        """Runs in the child between fork and exec: only async-signal-safe work (setrlimit calls)."""
        c = self.config
        resource.setrlimit(resource.RLIMIT_CPU, (c.cpu_s, c.cpu_s + 1))  # SIGXCPU at the soft limit, KILL at hard
        mem = c.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (c.file_bytes, c.file_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (c.nproc, c.nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # os.abort() leaves no core file behind

    def run(self, code: str) -> str:
        with tempfile.TemporaryDirectory(prefix="envs-sandbox-") as tmp:
            out_path = os.path.join(tmp, ".output")
            with open(os.path.join(tmp, "main.py"), "w") as f:
                f.write(code)
            with open(out_path, "wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-B", "main.py"], cwd=tmp, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, env=dict(SANDBOX_ENV), start_new_session=True,
                    preexec_fn=self._limit, close_fds=True)
                timed_out = False
                try:
                    rc = proc.wait(timeout=self.config.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    _kill_group(proc)
                if timed_out:
                    rc = proc.returncode
            with open(out_path, "rb") as f:
                raw = f.read(self.config.file_bytes)
        output = raw.decode("utf-8", "replace")
        if timed_out:
            raise ToolFailure(TIMEOUT, f"timeout after {self.config.wall_s:g} s", output)
        if rc != 0:
            raise ToolFailure(ERROR, self._why(rc, output, full=len(raw) >= self.config.file_bytes), output)
        return output

    def _why(self, rc: int, output: str, *, full: bool) -> str:
        """The failure in words: which limit it hit, the signal that killed it, or its exit code."""
        c = self.config
        if full:   # Python ignores SIGXFSZ: its writes fail instead, and it exits 1 or 120 (flush at exit)
            return f"output limit ({c.file_bytes} bytes), exit code {rc}"
        if rc < 0:
            if -rc == signal.SIGXCPU:
                return f"cpu limit ({c.cpu_s} s)"
            if -rc == signal.SIGXFSZ:
                return f"output limit ({c.file_bytes} bytes)"
            return f"killed by {signal.Signals(-rc).name}"
        tail = output[-2000:]
        if "MemoryError" in tail or "Cannot allocate memory" in tail:
            return f"memory limit ({c.memory_mb} MiB), exit code {rc}"
        return f"exit code {rc}"


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the run's session (the child and whatever it started) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:   # the group is gone already
        pass
    try:
        proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL of a process we started does not fail
        pass
