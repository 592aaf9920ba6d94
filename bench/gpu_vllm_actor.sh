#!/usr/bin/env bash
# The vLLM actor on one GPU (after the offline vLLM 0.26 install; results in BENCHMARKS.md, Rollout engine).
#   bash bench/gpu_vllm_actor.sh bench   -> vLLM actor vs raw vLLM vs HF engine, 0.5B shape
#   bash bench/gpu_vllm_actor.sh e2e     -> 20-step cluster.start, learner + vLLM actor on one GPU
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d /tmp/m05 ] || python3 -m data.shapes --shape 0.5b --out /tmp/m05 >/dev/null
case "$1" in
  bench)
    python3 -m bench.vllm_actor --model /tmp/m05 --hf --json "$OUT/vllm_actor.json" 2>&1 | grep -vE "INFO|WARNING" | tail -12
    ;;
  e2e)
    rm -rf "$OUT/run"  # a fresh job: cluster.start refuses a used run dir
    python3 -m cluster.start --run-dir "$OUT/run" --actors 1 --learners 1 model.path=/tmp/m05 \
      actors.engine=vllm actors.device=cuda actors.dtype=bfloat16 actors.gpu_memory_utilization=0.3 \
      actors.max_tokens=256 actors.max_model_len=512 actors.groups_per_batch=8 \
      trainer.total_steps=20 trainer.tensorboard=false trainer.val_samples=1 task.num_val_prompts=32 2>&1 | tail -5
    python3 - "$OUT/run/metrics.jsonl" <<'PY'
import sys
from learner import metric_names as M
L = M.read_metrics(sys.argv[1])
t = L[-1][M.TIME] - L[0][M.TIME]; n = sum(m[M.SAMPLES] for m in L[1:])
tok = sum(m[M.RESPONSE_LEN_MEAN] * m[M.SAMPLES] for m in L[1:])
print(f"steps {len(L)}  samples/s {n / t:.1f}  response tokens/s {tok / t:.0f}  "
      f"{M.ENGINE_MISMATCH_KL} {sum(m[M.ENGINE_MISMATCH_KL] for m in L) / len(L):.2e}  "
      f"{M.ENGINE_MISMATCH_ABS} {sum(m[M.ENGINE_MISMATCH_ABS] for m in L) / len(L):.2e}  {M.STALENESS_MEAN} "
      f"{sum(m[M.STALENESS_MEAN] for m in L) / len(L):.2f}")
PY
    grep -h "published version" "$OUT/run/logs/learner-0.log" | tail -3
    ;;
esac
