#!/usr/bin/env bash
# The staleness sweep on one GPU (SmolLM2-135M on chain_sum, configs/gsm8k_smollm2.yaml, vLLM actors), fitted
# into device calls of under 10 minutes and resumed across calls (docs/staleness.md has the results).
#
# Needs what `bash bench/gpu_smollm2.sh model` leaves on a warm machine (the python deps in /tmp/site, the model in
# /tmp/smollm2) and the prepared data (.gpu8/data, carried). Each call:
#     carry [".gpu8/data"]   bash bench/gpu_staleness.sh [extra sweep arguments]
# runs the settings not finished yet in experiments/results/$NAME (tracked, so its finished runs travel with the
# repo), each stopped RUN_S seconds after its first trained step, starting none that would end past BUDGET_S,
# and brings back $OUT/sweep.tgz (the finished runs' metrics and records, the parquet, plots and summary). Here:
#     tar -xzf <files_at>/sweep.tgz -C experiments/results/$NAME && git add experiments/results/$NAME
# and the next call goes on where this one stopped, on the same machine or a later one. Exit status 3: settings are left.
# The untarred runs travel to the next call whether committed or not (the results folder is not ignored); untar
# before the next call, or it runs the same settings again.
# Knobs: NAME (default smollm2_staleness_<gpu>_<UTC date>, <gpu> as nvidia-smi names the card: h100, h200, ...;
# experiments/results/.gitignore tracks the runs and parquet of every smollm2_staleness_* folder; wall clock
# compares only within one machine, so each machine's sweep is its own and reruns s=0), DATA (chain_sum),
# RUN_S (150), BUDGET_S (540), SETTINGS (the sweep's own arguments, default "--max-staleness 0 1 2 4 8 --seeds 1").
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h100|h200|a100|b200' | tr 'A-Z' 'a-z')
NAME=${NAME:-smollm2_staleness_${GPU:-gpu}_$(date -u +%Y%m%d)}
DATA=${DATA:-chain_sum}
DIR=experiments/results/$NAME
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "$DIR"
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
[ -d /tmp/smollm2 ] || { echo "no /tmp/smollm2: run bash bench/gpu_smollm2.sh model first (same warm machine)"; exit 2; }
read -r -a settings <<< "${SETTINGS:---max-staleness 0 1 2 4 8 --seeds 1}"
# the SmolLM2 run of bench/gpu_smollm2.sh: its vLLM actors (the config says one) and the vLLM evaluator beside the learner on the GPU
python3 -m experiments.staleness --config configs/gsm8k_smollm2.yaml --out "$DIR" --resume \
  --budget-s "${BUDGET_S:-540}" --run-seconds "${RUN_S:-150}" "${settings[@]}" model.path=/tmp/smollm2 \
  "data.train_files=[$PWD/.gpu8/data/$DATA/train.parquet]" "data.val_files=[$PWD/.gpu8/data/$DATA/test.parquet]" \
  actors.engine=vllm actors.gpu_memory_utilization=0.125 trainer.val_engine=vllm "$@" 2>&1 \
  | grep -v "^INFO\|it/s\]"
status=${PIPESTATUS[0]}
# small files only: a call brings back at most 8 files of 16 MiB; run logs stay behind but their last lines
(cd "$DIR" || exit
 for d in runs/*/; do tail -c 20000 "$d/stdout.log" > "$d/stdout.tail" 2>/dev/null; done
 shopt -s nullglob
 tar -czf "$OUT/sweep.tgz" runs/*/record.json runs/*/status.json runs/*/metrics.jsonl runs/*/stdout.tail runs/*/config.yaml ./*.png \
   ./results.parquet ./summary.md 2>/dev/null)
cp "$DIR/summary.md" "$OUT/" 2>/dev/null || true
echo "sweep exit $status"
exit "$status"
