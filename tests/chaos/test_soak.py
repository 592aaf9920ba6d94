"""The soak's short form (tests/chaos/soak.py): the embedded job under a seeded random schedule of faults (actor,
ingest and Redis kills, pauses, scaling) until it has trained its steps; the books balance, no stall passes the
bound, no process grows, publication does not slow down, and the held-out reward beats step 0."""
from __future__ import annotations

import json

from soak import soak

STEPS = 80       # about a minute of the embedded job on 2 cores, faults included
EVERY_S = 5.0    # a fault every 5 s on average: every kind at least once in the minute
STALL_S = 60.0   # a Redis restart, a killed ingest and a scale-up may overlap; none may stop training this long


def test_a_minute_of_random_faults_loses_nothing(tmp_path):
    result = soak(tmp_path, steps=STEPS, seed=7, every_s=EVERY_S, stall_s=STALL_S, overrides=[])
    print(json.dumps({k: v for k, v in result.items() if k != "processes"}, indent=1))
    assert result["ok"], {k: result[k] for k in ("checks", "longest_stall_s", "publish_s_first_last_quarter",
                                                 "val_reward_start_end", "faults")}
    assert sum(result["faults"].values()) >= 3, result["faults"]
