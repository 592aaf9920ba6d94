"""LoRA adapters as the vLLM engine serves them: one adapter per weight version, loaded through vLLM's own LoRA
API (`add_lora` / `remove_lora`), every request submitted with the adapter of the version current at submission.

A version's adapter is written as PEFT's adapter folder (`adapter_model.safetensors` + `adapter_config.json`, what
vLLM's LoRA loader reads) into a private folder in shared memory, from the tensors' own bytes (from a GPU: one
batch of copies into one pinned buffer, the file's body as it stands), LoRA's scale folded into B (`scaled`). A
request keeps its adapter to its end: an old version's adapter stays loaded, and its folder on disk, until no
request in flight uses it (vLLM may load an adapter again from its folder when it was evicted from its cache).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
import typing
import weakref
from collections import Counter

from engines.lora import check_adapter, initial_adapter, peft_config

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # the ranks vLLM accepts (the memory plan pads to them)


def padded_rank(rank: int, allowed=VLLM_LORA_RANKS) -> int | None:
    """The smallest of the `allowed` ranks that holds an adapter of `rank` (vLLM pads every slot to it), or None."""
    return min((r for r in allowed if r >= rank), default=None)


def max_lora_rank(rank: int) -> int:
    """vLLM's max_lora_rank for an adapter of `rank`: the smallest rank it accepts (config/lora.py MaxLoRARanks)
    that holds it; every slot is padded to it, so no larger than needed."""
    try:
        from vllm.config.lora import MaxLoRARanks
        allowed = sorted(typing.get_args(MaxLoRARanks))
    except ImportError:   # a vLLM that does not name them (they have been these since 0.10)
        allowed = list(VLLM_LORA_RANKS)
    if (fits := padded_rank(rank, allowed)) is None:
        raise ValueError(f"learner.lora.rank {rank}: vLLM serves LoRA ranks up to {allowed[-1]}")
    return fits


def lora_kwargs(lora, max_loras: int) -> dict:
    """The `vllm.LLM` arguments that make an engine serve adapters of the job's `lora` (learner.lora), `max_loras`
    of them in one batch (actors.vllm_max_loras)."""
    return {"enable_lora": True, "max_lora_rank": max_lora_rank(lora.rank), "max_loras": max_loras}


SAFETENSORS_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32"}


def safetensors_layout(tensors: dict) -> tuple[bytes, list[tuple[object, int, int]]]:
    """The safetensors header of `tensors` and each tensor's (tensor, start, end) byte span in the body after it,
    laid end to end widest element first (as safetensors' own writer does: every tensor then starts aligned to its
    element). The format: an 8-byte little-endian header length, the JSON header (padded with spaces to 8 bytes),
    then the raw bytes; safetensors' loaders read the spans in any order."""
    header, spans, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in sorted(tensors.items(), key=lambda kv: -kv[1].element_size()):
        if str(t.dtype) not in SAFETENSORS_DTYPES:
            raise ValueError(f"adapter tensor {name}: dtype {t.dtype} is not one vLLM's LoRA loader takes")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [off, off + n]}
        spans.append((t, off, off + n))
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head, spans


def write_safetensors(path: str, tensors: dict, host=None):
    """Write `tensors` as a safetensors file, returning the host buffer to pass to the next call. Tensors on a GPU
    are copied into one pinned host buffer (`host`, reused, grown when too small) with one wait for all the copies,
    then written at once; tensors in host memory are written from where they are."""
    import torch   # lazy: the launcher's memory plan reads this module

    head, spans = safetensors_layout(tensors)
    size = spans[-1][2] if spans else 0
    gpu = next((t.device for t, _, _ in spans if t.is_cuda), None)
    raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t, _, _ in spans]
    if gpu is not None:
        if host is None or host.numel() < size:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        for r, (_, a, b) in zip(raw, spans):
            host[a:b].copy_(r, non_blocking=True)
        torch.cuda.current_stream(gpu).synchronize()   # the copies were queued on the tensors' device's stream
        raw = [host[:size]]
    with open(path, "wb") as f:
        f.write(head)
        for r in raw:
            f.write(memoryview(r.cpu().numpy()))
    return host


B_SUFFIXES = ("lora_B.weight", "lora_embedding_B")   # PEFT's names of B (engines/lora.py initial_tensors)


def scaled(state_dict: dict, scale: float) -> dict:
    """The adapter with LoRA's scale (alpha / rank) folded into its B matrices, on their device. vLLM folds it
    itself when an adapter's scale is not 1, with a multiply per layer on the host for every version it loads (two
    thirds of `add_lora`'s time on vLLM's CPU build, profiled); an adapter written with it folded and alpha = rank
    is loaded without it."""
    if scale == 1:
        return state_dict
    return {k: t * scale if k.endswith(B_SUFFIXES) else t for k, t in state_dict.items()}


def _shared_dir() -> str:
    """A private folder for the adapters' files, in shared memory where there is one (no disk write per version)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="asyncrl-lora-", dir=base)


class AdapterVersions:
    """The adapters a vLLM engine (`llm_engine`, vllm.LLM's) holds, one per version, and the requests using each.
    vLLM's adapter id of version v is v + 1 (ids are > 0 and must differ between adapters)."""

    def __init__(self, llm_engine, model_path: str, lora, dtype: str):
        self.engine, self.model_path, self.lora = llm_engine, model_path, lora
        self.dir = _shared_dir()
        weakref.finalize(self, shutil.rmtree, self.dir, True)   # the folder goes with the engine, or at exit
        self.requests: dict[int, object] = {}   # version -> its vLLM LoRARequest (loaded adapters only)
        self.users: Counter = Counter()          # version -> requests in flight that use its adapter
        self.version, self.checksum = -1, ""
        self.host = None   # the host buffer each version's file is written from (write_safetensors)
        # what each version's folder records; peft_config sets no rsLoRA and no per-module rank or alpha, so LoRA's
        # scale is alpha / rank for every module (what `scaled` folds in)
        self.config = peft_config(lora)
        self.config.base_model_name_or_path = model_path
        self.config.lora_alpha = self.config.r   # the scale is in B: vLLM's alpha / rank is 1
        v0 = initial_adapter(model_path, lora, dtype)   # the learner's version 0, from the config alone
        self.shapes = {k: tuple(t.shape) for k, t in v0.items()}
        self.load(v0, 0)

    def load(self, state_dict: dict, version: int, expected: str | None = None, *, verified: bool = False) -> str:
        """Write `version`'s adapter, hand it to vLLM and make it current; returns its checksum, that of the tensors
        as published (the file holds them with LoRA's scale folded into B). `expected`: the publisher's checksum,
        any other is refused (RuntimeError, the current version unchanged); `verified`: the caller has proven these
        tensors against `expected` already (a weight subscriber does), so they are not fingerprinted again."""
        from vllm.lora.request import LoRARequest

        from weightsync.flat import checksum   # lazy: imports torch (the launcher's memory plan reads this module)

        check_adapter(self.shapes, state_dict)
        if version == self.version and expected == self.checksum:   # the version held, sent again (a rejoin)
            return self.checksum
        folder = os.path.join(self.dir, f"v{version}")
        if os.path.isdir(folder):   # vLLM keys adapters by id (version + 1): one adapter per version
            raise RuntimeError(f"vLLM holds another adapter of version {version} (checksum {self.checksum} when "
                               f"current); a version's adapter cannot change")
        got = expected if verified and expected is not None else checksum(state_dict)
        if expected is not None and got != expected:
            raise RuntimeError(f"vLLM adapter of version {version} has checksum {got}, publisher sent {expected}")
        os.makedirs(folder)
        try:
            self.host = write_safetensors(os.path.join(folder, "adapter_model.safetensors"),
                                          scaled(state_dict, self.lora.alpha / self.lora.rank), self.host)
            self.config.save_pretrained(folder)
            request = LoRARequest(f"v{version}", version + 1, folder)
            if not self.engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the adapter of version {version} from {folder}")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.requests[version], self.version, self.checksum = request, version, got
        self.prune()
        return got

    def current(self):
        """The LoRARequest a request submitted now carries (the current version's adapter)."""
        return self.requests[self.version]

    def hold(self, version: int) -> None:
        self.users[version] += 1

    def release(self, version: int) -> None:
        self.users[version] -= 1
        if self.users[version] <= 0:
            del self.users[version]
            self.prune()

    def prune(self) -> None:
        """Unload the adapters of old versions no request in flight uses, and delete their folders."""
        for v in [v for v in self.requests if v != self.version and not self.users[v]]:
            request = self.requests.pop(v)
            self.engine.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)
