"""Where a process stands when it stalls: its threads' stacks dumped into its own log (faulthandler) when a loop
has not come round for most of the stall bound its watcher (the launcher) enforces or reports."""
from __future__ import annotations

import faulthandler
import logging
import sys

STALL_DUMP_SHARE = 0.8   # the dump is due at this share of the bound: the log holds the stacks when the launcher acts


def arm_stall_dump(stall_s: float) -> None:
    """(Re-)arm a dump of every thread's stack into this process's log file (stderr without one), due unless
    re-armed or cancelled within STALL_DUMP_SHARE of `stall_s` (0: nothing is armed), and again every as long
    while neither happens: the newest stacks in the log are never older than that, wherever the loop stuck. Dumped
    once, they showed where it was at the first due time, not where it hung (a learner's evaluate phase that
    spent longer than that generating before its reward function hung: the log never showed the hung call)."""
    if stall_s <= 0:
        return
    files = [h.stream for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    faulthandler.dump_traceback_later(STALL_DUMP_SHARE * stall_s, repeat=True, file=files[0] if files else sys.stderr)


def cancel_stall_dump() -> None:
    """No dump is due (a loop that waits on purpose, or ends)."""
    faulthandler.cancel_dump_traceback_later()
