#!/bin/bash
# Ray head + workers across a Slurm allocation, then one asyncrl job on it (verl's Slurm + container +
# Ray recipe: a head on the first node, a worker on each other node, the job started on the head).
#
#   sbatch deploy/slurm/ray_on_slurm.sh --config configs/my.yaml --actors 8 --learners 8
#   CONTAINER_RUNTIME=docker IMAGE=asyncrl:latest sbatch --nodes=4 deploy/slurm/ray_on_slurm.sh ...
#
# Arguments go to `python -m cluster.start` (after --address); every setting below is an
# environment variable with a default, so `VAR=value sbatch ...` (or --export) overrides it.
#SBATCH --job-name=asyncrl
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --output=slurm-%j.out
#SBATCH --error=slurm-%j.err
set -euo pipefail

# --- NCCL / InfiniBand (from the verl multi-node article; defaults fit a Mellanox IB cluster) ---
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"                    # TRACE/INFO while bringing a cluster up
export NCCL_IB_GID_INDEX="${NCCL_IB_GID_INDEX:-3}"          # RoCE v2 GID; plain IB ignores it
export NCCL_PROTO="${NCCL_PROTO:-Simple}"
export NCCL_CROSS_NIC="${NCCL_CROSS_NIC:-0}"                # keep each ring on one NIC rail
export NCCL_CHECKS_DISABLE="${NCCL_CHECKS_DISABLE:-1}"      # skip argument checks in production
export TORCH_NCCL_HIGH_PRIORITY="${TORCH_NCCL_HIGH_PRIORITY:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
# Unset = NCCL picks: name the HCAs (e.g. mlx5_0,mlx5_1,...) and interfaces when it picks wrong.
for var in NCCL_IB_HCA NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_DISABLE \
           GPU_MAX_HW_QUEUES RCCL_MSCCL_ENABLE HSA_NO_SCRATCH_RECLAIM; do  # the last three: ROCm only
    if [[ -n "${!var:-}" ]]; then export "${var?}"; fi
done
PASS_ENV=(NCCL_DEBUG NCCL_IB_GID_INDEX NCCL_PROTO NCCL_CROSS_NIC NCCL_CHECKS_DISABLE TORCH_NCCL_HIGH_PRIORITY
          CUDA_DEVICE_MAX_CONNECTIONS TOKENIZERS_PARALLELISM NCCL_IB_HCA NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME
          NCCL_IB_DISABLE GPU_MAX_HW_QUEUES RCCL_MSCCL_ENABLE HSA_NO_SCRATCH_RECLAIM HF_HOME)

# --- Ray and the container ---
RAY_PORT="${RAY_PORT:-6379}"
RAY_DASHBOARD_PORT="${RAY_DASHBOARD_PORT:-8266}"
RAY_DASHBOARD_HOST="${RAY_DASHBOARD_HOST:-127.0.0.1}"       # reach it with ssh -L; 0.0.0.0 opens it to all
NUM_CPUS="${NUM_CPUS:-${SLURM_CPUS_PER_TASK:-32}}"
NUM_GPUS="${NUM_GPUS:-${SLURM_GPUS_PER_NODE:-8}}"
NUM_GPUS="${NUM_GPUS##*:}"                                  # "h200:8" -> 8
RAY_START_TIMEOUT_S="${RAY_START_TIMEOUT_S:-300}"           # head up and every worker joined, or give up
CONTAINER_RUNTIME="${CONTAINER_RUNTIME:-none}"              # none | docker | apptainer
IMAGE="${IMAGE:-asyncrl:latest}"                            # docker tag, or a .sif path for apptainer
CONTAINER_NAME="${CONTAINER_NAME:-asyncrl-${SLURM_JOB_ID:-local}}"
WORKDIR="${WORKDIR:-$(pwd)}"                                # the checkout, same path on every node
SHM_SIZE="${SHM_SIZE:-64g}"
PYTHON="${PYTHON:-python3}"

# A command inside the job's environment on the node srun runs it on.
in_env() {
    case "$CONTAINER_RUNTIME" in
        none) "$@" ;;
        docker) docker exec -w "$WORKDIR" "$CONTAINER_NAME" "$@" ;;
        apptainer) apptainer exec --nv --bind "$WORKDIR" --pwd "$WORKDIR" "$IMAGE" "$@" ;;
        *) echo "CONTAINER_RUNTIME must be none, docker or apptainer, not '$CONTAINER_RUNTIME'" >&2; return 2 ;;
    esac
}
export -f in_env
export CONTAINER_RUNTIME IMAGE CONTAINER_NAME WORKDIR

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node="${nodes[0]}"
head_ip="${HEAD_IP:-$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{print $1}')}"
ip_head="$head_ip:$RAY_PORT"
echo "nodes: ${nodes[*]}; Ray head $ip_head"

cleanup() {
    srun --overlap --nodes="${#nodes[@]}" --ntasks-per-node=1 bash -c 'in_env ray stop --force >/dev/null 2>&1 || true' || true
    if [[ "$CONTAINER_RUNTIME" == docker ]]; then
        srun --overlap --nodes="${#nodes[@]}" --ntasks-per-node=1 docker rm -f "$CONTAINER_NAME" >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

if [[ "$CONTAINER_RUNTIME" == docker ]]; then  # one long-lived container per node, host network for NCCL/IB
    env_args=()
    for var in "${PASS_ENV[@]}"; do
        if [[ -n "${!var:-}" ]]; then env_args+=(-e "$var"); fi
    done
    srun --nodes="${#nodes[@]}" --ntasks-per-node=1 \
        docker run -d --rm --name "$CONTAINER_NAME" --network host --ipc host --gpus all \
        --device /dev/infiniband --ulimit memlock=-1 --shm-size "$SHM_SIZE" \
        "${env_args[@]}" -v "$WORKDIR:$WORKDIR" -w "$WORKDIR" "$IMAGE" sleep infinity
fi

srun --nodes=1 --ntasks=1 -w "$head_node" bash -c 'in_env "$@"' _ \
    ray start --head --node-ip-address="$head_ip" --port="$RAY_PORT" \
    --dashboard-host="$RAY_DASHBOARD_HOST" --dashboard-port="$RAY_DASHBOARD_PORT" \
    --num-cpus="$NUM_CPUS" --num-gpus="$NUM_GPUS" --block &

# Wait for the head instead of a fixed sleep: `ray status` answers once its GCS is up.
deadline=$((SECONDS + RAY_START_TIMEOUT_S))
until srun --overlap --nodes=1 --ntasks=1 -w "$head_node" bash -c 'in_env "$@"' _ \
        ray status --address="$ip_head" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then echo "Ray head did not come up in ${RAY_START_TIMEOUT_S}s" >&2; exit 1; fi
    sleep 2
done

for node in "${nodes[@]:1}"; do
    srun --nodes=1 --ntasks=1 -w "$node" bash -c 'in_env "$@"' _ \
        ray start --address="$ip_head" --num-cpus="$NUM_CPUS" --num-gpus="$NUM_GPUS" --block &
done

# Every worker joined before the job asks for placement groups spanning them.
until [[ "$(srun --overlap --nodes=1 --ntasks=1 -w "$head_node" bash -c 'in_env "$@"' _ "$PYTHON" -c \
        "import ray; ray.init(address='$ip_head', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))" \
        2>/dev/null | tail -n 1)" == "${#nodes[@]}" ]]; do
    if ((SECONDS > deadline)); then echo "not all ${#nodes[@]} nodes joined Ray in ${RAY_START_TIMEOUT_S}s" >&2; exit 1; fi
    sleep 2
done
echo "Ray cluster of ${#nodes[@]} nodes ready; dashboard on $head_node at $RAY_DASHBOARD_HOST:$RAY_DASHBOARD_PORT"

# The job runs on the head: the local Redis and the ingest(s) sit there, learners and actors are placed
# by the placement groups; servers bind the node IP and authenticate (cluster.bind_host=auto).
PYTHONUNBUFFERED=1 srun --overlap --nodes=1 --ntasks=1 -w "$head_node" bash -c 'in_env "$@"' _ \
    "$PYTHON" -m cluster.start --address "$ip_head" "$@"
