"""Where processes sit on one host's GPUs (pure): learner rank r on GPU r; actors on the GPUs
the learners leave free, round-robin, or all on GPU 0 beside learner rank 0 when none is free.
The weight backend follows from it (weightsync/backends.py): actors on rank 0's GPU get cuda_ipc
(NCCL refuses two ranks on one device), actors on other GPUs nccl, CPU actors gloo."""
from __future__ import annotations


def actor_gpu(index: int, n_gpus: int, learners: int) -> int:
    if n_gpus <= 0:
        raise ValueError("actor_gpu needs at least one GPU")
    free = n_gpus - learners
    return learners + index % free if free > 0 else 0

