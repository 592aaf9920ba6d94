#!/usr/bin/env bash
# The vLLM engine's CUDA-graph mode and the evaluator's variants on one GPU (after bench/gpu_smollm2.sh's install
# and `model`), measured alone, then the SmolLM2 run at s=1000 (admission not capping) with the faster mode.
#   1. one streaming actor alone (bench/actor_stream.py), INFLIGHT (256 512) in flight, with each of MODES
#      (actors.vllm_cudagraph_mode, in that order: FULL_DECODE_ONLY, where a step that prefills runs eagerly, then FULL);
#   2. one held-out evaluation alone (bench/eval_speed.py, VARIANTS, default: seeded no_logprobs; "": none);
#   3. `bash bench/gpu_smollm2.sh run buffer.max_staleness=1000` for TRAIN_S seconds with the mode of 1 that
#      made more samples/s at 512 (RUN=0: skip).
# Everything lands in $OUT: probe.tgz (actor_<mode>.json, eval_<variant>.json; a call brings back 8 files),
# s1000/ (gpu_smollm2.sh run's files).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
P=$OUT/probe
mkdir -p "$P"
D=.gpu8/data/chain_sum
for mode in ${MODES:-FULL_DECODE_ONLY FULL}; do   # MODES: the order too (the first process starts cold)
  python3 -m bench.actor_stream --model /tmp/smollm2 --data "$D/train.parquet" --no-compile --inflight ${INFLIGHT:-256 512} \
    --seconds "${SECONDS_EACH:-15}" --calls 3 --json "$P/actor_$mode.json" \
    --vllm-kwargs "{\"compilation_config\": {\"mode\": 0, \"cudagraph_mode\": \"$mode\"}}" 2>&1 \
    | grep -v "^INFO\|^(MainProcess\|it/s\]\|^\[rank" | tail -6 || echo "mode $mode failed"
done
[ -z "${VARIANTS-seeded no_logprobs}" ] || OUT=$P VARIANTS=${VARIANTS-seeded no_logprobs} bash bench/gpu_smollm2.sh evalspeed
tar -czf "$OUT/probe.tgz" -C "$OUT" probe
best=$(python3 - "$P" <<'EOF'
import json, os, sys
rate = {}
for m in ("FULL_DECODE_ONLY", "FULL"):
    p = os.path.join(sys.argv[1], f"actor_{m}.json")
    if os.path.exists(p):
        rate[m] = json.load(open(p))["rows"]["stream_512"]["samples_per_s"]
print(max(rate, key=rate.get) if rate else "FULL_DECODE_ONLY")
EOF
)
rm -rf "$P"
echo "$best" > /tmp/best_cudagraph_mode   # a later call on the warm machine reads it
[ "${RUN:-1}" = 1 ] || exit 0
echo "s=1000 run with actors.vllm_cudagraph_mode=$best"
OUT=$OUT/s1000 LAUNCH_S=120 EVAL_S=5 TRAIN_S=${TRAIN_S:-40} DATA=chain_sum bash bench/gpu_smollm2.sh run \
  buffer.max_staleness=1000 trainer.total_steps=400 "actors.vllm_cudagraph_mode=$best" "$@"
