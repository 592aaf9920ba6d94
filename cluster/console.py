"""The launcher's terminal: stdout and stderr that their reader may leave without ending the job."""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("cluster")


class Outlived:
    """A text stream whose writes stop, instead of raising, once nobody can read them: a closed pipe
    (`| head -1`, a killed `tee`: EPIPE), a terminal that hung up (EIO), a full disk (ENOSPC). The run's
    record is its directory (metrics.jsonl, logs/, status.json); the terminal only shows it, so losing it must
    not end the run (the progress line's BrokenPipeError ended the job with a traceback, 5 s in)."""

    def __init__(self, stream, name: str):
        self._stream, self._name = stream, name
        self.lost: OSError | None = None

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                return self._stream.write(text)
            except OSError as e:
                self._lose(e)
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self._stream.flush()
            except OSError as e:
                self._lose(e)

    def _lose(self, e: OSError) -> None:
        self.lost = e
        try:  # what is still buffered is flushed once more at exit (a second traceback): into /dev/null
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass
        log.warning("%s can no longer be written (%s): the job goes on without it; its progress is in the run "
                    "directory (metrics.jsonl, logs/)", self._name, e)

    def __getattr__(self, name):   # isatty, fileno, encoding, ... of the stream itself
        return getattr(self._stream, name)


def outlive_readers() -> None:
    """sys.stdout and sys.stderr from now on written as Outlived streams."""
    if not isinstance(sys.stdout, Outlived):
        sys.stdout = Outlived(sys.stdout, "stdout")
    if not isinstance(sys.stderr, Outlived):
        sys.stderr = Outlived(sys.stderr, "stderr")
