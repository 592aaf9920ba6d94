#!/usr/bin/env bash
# Weight publication on one GPU (after the offline install of shared/gpu/vllm; results in BENCHMARKS.md).
#   bash bench/gpu_weightsync.sh bench  -> cuda_ipc publication of 0.5B / 1.5B / 7B bf16 vs a raw device copy
#   bash bench/gpu_weightsync.sh e2e    -> 20-step cluster.start, learner + vLLM actor on one GPU, weights by cuda_ipc
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "$1" in
  bench)
    for shape in ${SHAPES:-0.5b 1.5b 7b}; do
      python3 -m bench.weightsync --backend cuda_ipc --shape "$shape" --actors 1 --reps 3 --bucket-mb 1024 \
        --json "$OUT/ws_$shape.json" > "$OUT/ws_$shape.log" 2>&1 || true
      grep -v heartbeat "$OUT/ws_$shape.log" | tail -4
    done
    ;;
  e2e)
    [ -d /tmp/m05 ] || python3 -m data.shapes --shape 0.5b --out /tmp/m05 >/dev/null
    rm -rf "$OUT/run"  # a fresh job: cluster.start refuses a used run dir
    python3 -m cluster.start --run-dir "$OUT/run" --actors 1 --learners 1 model.path=/tmp/m05 \
      actors.engine=vllm actors.device=cuda actors.dtype=bfloat16 actors.gpu_memory_utilization=0.3 \
      actors.max_tokens=256 actors.max_model_len=512 actors.groups_per_batch=8 weightsync.backend=auto \
      trainer.total_steps=20 trainer.tensorboard=false trainer.val_samples=1 task.num_val_prompts=32 2>&1 | tail -3
    grep -h "published version" "$OUT/run/logs/learner-0.log" | tail -3
    python3 - "$OUT/run/metrics.jsonl" <<'PY'
import sys
from learner import metric_names as M
L = M.read_metrics(sys.argv[1])
t = L[-1][M.TIME] - L[0][M.TIME]; n = sum(m[M.SAMPLES] for m in L[1:])
tok = sum(m[M.RESPONSE_LEN_MEAN] * m[M.SAMPLES] for m in L[1:])
pub = sorted(m[M.WS_PUBLISH_S] for m in L)
print(f"steps {len(L)}  samples/s {n / t:.1f}  response tokens/s {tok / t:.0f}  publish_s median "
      f"{pub[len(pub) // 2]:.3f} max {pub[-1]:.3f}")
PY
    ;;
esac
