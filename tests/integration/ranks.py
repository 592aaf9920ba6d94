"""Child processes for tests that run torch.distributed ranks or weight-sync members.

They are forked from one fork server per pytest process, which has imported torch, transformers and the learner
once. Spawned, each child paid those imports itself (~4 CPU-s; two or three children a test in a dozen tests);
forked, it starts in a fraction of a second. The fork server only imports: it runs no torch op (a process forked
after its thread pools started can hang) and joins no process group, so each child sets up its own group, as a
spawned one did, in a process that has run nothing else."""
from __future__ import annotations

import multiprocessing as mp

# What the children import, heaviest first; a module that fails to import is left to the child (the fork server
# skips it).
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.qwen2.modeling_qwen2",
           "torch.distributed.fsdp", "numpy", "pytest", "redis", "data.tiny_model", "learner.model", "learner.step",
           "learner.ppo", "cluster.config", "weightsync.gloo"]


def context():
    """A multiprocessing context whose Process forks from the preloaded fork server (started on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
