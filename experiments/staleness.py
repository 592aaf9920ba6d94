"""python -m experiments.staleness [--config F] [--max-staleness 0 1 2 4 8] [--corrections ppo_clip ...]
                                 [--seeds 3] [--sync] [--steps N] [--actors N] [--learners M]
                                 [--out DIR] [--resume] [--budget-s S] [--run-seconds S]
                                 [section.key=value ...]

Off-policy staleness sweep (experiments/sweep/: the config, the runner, the analysis, the report and this
command's arguments).
"""
from __future__ import annotations

import sys

from experiments.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
