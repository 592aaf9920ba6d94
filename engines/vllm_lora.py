"""LoRA adapters as the vLLM engine serves them: one adapter per weight version, loaded through vLLM's own LoRA
API (`add_lora` / `remove_lora`), every request submitted with the adapter of the version current at submission.

A version's adapter is written as PEFT's adapter folder (`adapter_model.safetensors` + `adapter_config.json`, what
vLLM's LoRA loader reads) into a private folder in shared memory. A request keeps its adapter to its end: an old
version's adapter stays loaded, and its folder on disk, until no request in flight uses it (vLLM may load an
adapter again from its folder when it was evicted from its cache).
"""
from __future__ import annotations

import logging
import os
import shutil
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
        v0 = initial_adapter(model_path, lora, dtype)   # the learner's version 0, from the config alone
        self.shapes = {k: tuple(t.shape) for k, t in v0.items()}
        self.load(v0, 0)

    def load(self, state_dict: dict, version: int, expected: str | None = None) -> str:
        """Write `version`'s adapter, prove it, hand it to vLLM and make it current; returns the checksum of the
        tensors written (what vLLM reads). `expected`: the publisher's checksum, any other is refused (RuntimeError,
        the current version unchanged)."""
        from safetensors.torch import load_file, save_file
        from vllm.lora.request import LoRARequest

        from weightsync.flat import checksum   # lazy: imports torch (the launcher's memory plan reads this module)

        check_adapter(self.shapes, state_dict)
        if version == self.version and expected == self.checksum:   # the version held, sent again (a rejoin)
            return self.checksum
        folder = os.path.join(self.dir, f"v{version}")
        if os.path.isdir(folder):   # vLLM keys adapters by id (version + 1): one adapter per version
            raise RuntimeError(f"vLLM holds another adapter of version {version} (checksum {self.checksum} when "
                               f"current); a version's adapter cannot change")
        os.makedirs(folder)
        try:
            save_file({k: t.detach().contiguous().cpu() for k, t in state_dict.items()},
                      os.path.join(folder, "adapter_model.safetensors"))
            got = checksum(load_file(os.path.join(folder, "adapter_model.safetensors")))
            if expected is not None and got != expected:
                raise RuntimeError(f"vLLM adapter of version {version} has checksum {got}, publisher sent {expected}")
            cfg = peft_config(self.lora)
            cfg.base_model_name_or_path = self.model_path
            cfg.save_pretrained(folder)
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
