"""python -m experiments.simulate --actors 8 64 1024 --learners 8 [--max-staleness 0 1 2 4] [--cores inf]
                                [--sync-run D --s0-run D ...] [--set FIELD=VALUE ...] [--out DIR]
python -m experiments.simulate --sync-run D --s0-run D [D] --validate RUN ...   (predicted vs measured)
python -m experiments.simulate --validate-loo RUN ...   (GPU: each run predicted from the runs at other bounds)

A discrete-event simulator of this system (experiments/simulator/: the model, its calibration from measured
runs, the validation against them, its plots and this command's arguments).
"""
from __future__ import annotations

import sys

from experiments.simulator.cli import main

if __name__ == "__main__":
    sys.exit(main())
