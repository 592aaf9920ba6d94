#!/usr/bin/env bash
# Simulator validation on this machine (README "Staleness experiments"): calibration runs, then
# measured runs of other configurations, then predicted vs measured.
#   bash experiments/validate_simulator.sh [OUT_DIR] [STEPS]
# Calibration: the one-process sync baseline, and cluster.start at s=0 with 1 and 2 learner ranks
# (steps alternate, so each process's CPU per step is its work). Validation: s=2 with
# actors/learners 1/1, 2/1, 3/1, 1/2, 2/2, none of which is a calibration run.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:-experiments/results/simval}
STEPS=${2:-120}
PY=${PY:-.venv/bin/python}
mkdir -p "$D"
common=(trainer.total_steps="$STEPS" trainer.tensorboard=false trainer.export_hf=false)
run() {  # name, then cluster.start arguments
  local name=$1; shift
  rm -rf "${D:?}/$name"
  echo "run $name: $*"
  "$PY" -m cluster.start --run-dir "$D/$name" "$@" "${common[@]}" > "$D/$name.log" 2>&1
}
rm -rf "${D:?}/sync"
echo "run sync"
"$PY" -m experiments.sync --run-dir "$D/sync" "${common[@]}" > "$D/sync.log" 2>&1
run s0_l1 --actors 2 --learners 1 buffer.max_staleness=0
run s0_l2 --actors 2 --learners 2 buffer.max_staleness=0
for al in 1/1 2/1 3/1 1/2 2/2; do
  run "s2_${al%/*}_${al#*/}" --actors "${al%/*}" --learners "${al#*/}" buffer.max_staleness=2
done
"$PY" -m experiments.simulate --sync-run "$D/sync" --s0-run "$D/s0_l1" "$D/s0_l2" --out "$D" \
  --validate "$D"/s2_1_1 "$D"/s2_2_1 "$D"/s2_3_1 "$D"/s2_1_2 "$D"/s2_2_2
