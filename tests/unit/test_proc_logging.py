"""cluster/proc.py setup_logging: every process's log set-up, run first in the launcher and in each worker."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

CHECK = """
import sys
from cluster.proc import setup_logging
{before}
setup_logging("role-x", sys.argv[1])
print("transformers imported by setup_logging:", "transformers" in sys.modules and not {imported_before})
from transformers.utils import logging as hf_logging
print("progress bars:", hf_logging.is_progress_bar_enabled())
"""


@pytest.mark.parametrize("imported_before", [False, True])
def test_progress_bars_off_without_importing_transformers(tmp_path, imported_before):
    """Weight-loading progress bars stay out of the logs, whether or not transformers was imported
    first, and setting that up does not import transformers (seconds per process on 2 cores)."""
    code = CHECK.format(before="import transformers.utils.logging" if imported_before else "",
                        imported_before=imported_before)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "transformers imported by setup_logging: False" in res.stdout, res.stdout
    assert "progress bars: False" in res.stdout, res.stdout
    assert (tmp_path / "logs" / "role-x.log").exists()
