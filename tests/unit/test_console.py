"""cluster/console.py: the launcher's stdout and stderr outlive their reader."""
from __future__ import annotations

import io
import os

import pytest

from cluster.console import Outlived

pytestmark = pytest.mark.unit


def test_a_stream_whose_reader_left_swallows_writes_and_says_so_once(caplog):
    read, write = os.pipe()
    os.close(read)   # `| head -1` has exited
    stream = Outlived(io.TextIOWrapper(io.FileIO(write, "w"), line_buffering=True), "stdout")
    assert stream.write("step 1\n") == 7 and stream.write("step 2\n") == 7
    stream.flush()
    assert isinstance(stream.lost, BrokenPipeError)
    assert caplog.text.count("stdout can no longer be written") == 1, caplog.text
    stream._stream.close()   # what was buffered goes to /dev/null now, not to the closed pipe: no error at exit
