"""A `cluster.start` job under test: started in its own session with the chaos fault points installed
(tests/chaos/faultpoints.py: a fault fires only once a test arms it), watched through Redis."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray_shared
from learner import metric_names as M
from runbase import faults

FAULT_POINTS = str(Path(__file__).with_name("faultpoints.py"))  # every process of a job loads it (runbase.faults)

WAIT_S = 180  # for the job to come up or make progress on a loaded 2-core machine
READ_END_S = 10  # for the rest of an exited launcher's output (its pipes' other ends may outlive it in a child)


class JobUnderTest:
    def __init__(self, run_dir: Path, r, run_id: str, *args: str, redis_url: str | None = None,
                 own_ray: bool = False):
        """`r` None: the job starts its own Redis; `connect()` once it is up. The job joins the test process's
        shared Ray (tests/ray_shared.py) unless `own_ray`."""
        self.run_dir, self.r, self.run_id = Path(run_dir), r, run_id
        cmd = [sys.executable, "-m", "cluster.start", "--run-dir", str(run_dir), f"cluster.run_id={run_id}",
               *ray_shared.job_args(own_ray), *args]
        if redis_url:
            cmd += ["--redis-url", redis_url]
        self.launcher = Drained(cmd, env={**os.environ, faults.ENV: FAULT_POINTS})
        self.proc = self.launcher.proc

    @property
    def out(self) -> str:
        """The launcher's standard output so far."""
        return self.launcher.out

    @property
    def err(self) -> str:
        """Its standard error so far."""
        return self.launcher.err

    def connect(self):
        """A client of the job's own Redis (its URL is in job.json once the job is up)."""
        from runbase.keys import connect

        job = self.run_dir / "job.json"
        self.r = True  # lets wait() poll before a client exists
        self.wait(job.exists, "job.json")
        self.r = connect(json.loads(job.read_text())["redis_url"])
        return self.r

    def step(self) -> int:
        raw = self.r.get(f"{self.run_id}:metrics")
        return json.loads(raw)[M.STEP] if raw else -1

    def wait(self, cond, what: str, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert self.proc.poll() is None, f"job exited while waiting for {what}: {self.launcher.ended()}"
            if time.monotonic() >= deadline:
                self.kill()   # its output says where it was: the launcher's progress lines and every process's log
                raise AssertionError(f"timed out waiting for {what}; the job's last output:\n{self.err[-3000:]}"
                                     f"{self.log_tails()}")
            time.sleep(0.2)

    def log_tails(self, chars: int = 1500) -> str:
        """The end of each process's log in the run directory (cluster/proc.py), for a failure's message."""
        logs = sorted((self.run_dir / "logs").glob("*.log"))
        return "".join(f"\n--- {p.name}:\n{p.read_text(errors='replace')[-chars:]}" for p in logs)

    def wait_step(self, n: int) -> None:
        self.wait(lambda: self.step() >= n, f"step {n}")

    def pid_of(self, actor: str) -> int:
        """Its entry read once (an actor that dies between a hexists and a hget has no entry at the hget)."""
        raw = []
        self.wait(lambda: raw.append(self.r.hget(f"{self.run_id}:members", actor)) or raw[-1] is not None,
                  f"{actor} to report")
        return json.loads(raw[-1])["pid"]

    def finish(self, timeout: float = WAIT_S) -> int:
        self.proc.wait(timeout=timeout)
        self.launcher.ended()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.launcher.ended()


class Drained:
    """A process in its own session whose standard output and error are read as it writes them: a pipe holds
    64 KiB, and a launcher whose progress lines fill it blocks in its next write (a fault-free soak's job of
    20,000 steps stopped supervising, and never exited, that way)."""

    def __init__(self, cmd: list[str], env: dict):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, env=env)
        self._out: list[str] = []
        self._err: list[str] = []
        self._readers = [threading.Thread(target=_drain, args=(stream, into), daemon=True)
                         for stream, into in ((self.proc.stdout, self._out), (self.proc.stderr, self._err))]
        for t in self._readers:
            t.start()

    @property
    def out(self) -> str:
        return "".join(self._out)

    @property
    def err(self) -> str:
        return "".join(self._err)

    def ended(self) -> tuple[str, str]:
        """Once the process has exited: its whole output (the readers reach the end of its pipes)."""
        for t in self._readers:
            t.join(READ_END_S)
        return self.out, self.err


def _drain(stream, into: list[str]) -> None:
    for line in stream:
        into.append(line)
