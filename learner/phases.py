"""Rank 0's reports of where the learner's loop stands, for the launcher: the phase it is in (its stall
report, cluster.learner_stall_s) and its marks on the way to the first trained step (status.json's
start-up timeline). Other ranks report nothing: they are handed no Redis client."""
from __future__ import annotations

import time

from runbase.keys import mark_startup
from runbase.stalls import arm_stall_dump, cancel_stall_dump


class PhaseReport:
    def __init__(self, r, keys, stall_s: float):
        """`r` None (ranks other than 0): every report is a no-op. `stall_s` 0: no phase is reported."""
        self.r, self.keys, self.stall_s = r, keys, stall_s

    def phase(self, name: str, version: int) -> None:
        """Where the loop stands (the phase, and the weights' version it works on or made), and the stack dump
        due if the phase lasts cluster.learner_stall_s; none is due while it waits for groups. (Other ranks
        wait in the step's first collective while rank 0 waits for groups: their time there is not theirs.)"""
        if self.r is None or not self.stall_s:
            return
        if name == "wait":
            cancel_stall_dump()
        else:
            arm_stall_dump(self.stall_s)
        # the launcher times a phase by its own clock from when it first sees it (rank 0 may run on another node)
        self.r.hset(self.keys.learner_phase, mapping={"phase": name, "version": version, "since": time.time()})

    def mark(self, event: str) -> None:
        """A point on the way to the first trained step (cluster/progress.py reads them)."""
        if self.r is not None:
            mark_startup(self.r, self.keys, "learner-0", event)
