"""Pieces the single-GPU learner benches share: timed learner steps, and one fresh process per setting."""
from __future__ import annotations

import multiprocessing as mp
import queue
import resource
import time

from learner import metric_names as M
from runbase.net import free_port

POLL_S = 5  # how often the parent checks that a setting's process is still alive
# What a bench's processes import, loaded once by the fork server they are forked from: spawned, each paid these
# imports again (~4 CPU-s, more than a short CPU bench's own steps).
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.qwen2.modeling_qwen2", "learner.model",
           "learner.step"]


def fresh_processes():
    """A multiprocessing context for a bench's processes: each forked from a fork server that has only imported
    PRELOAD (it runs no torch op and touches no GPU), so each still starts with a clean allocator, a clean peak and
    CUDA uninitialised, as a spawned one did."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def timed_steps(model, opt, rows, lc, *, dev, group, steps: int) -> tuple[list[float], list[float], float]:
    """`steps` learner `train_step`s on one fixed batch (one rank): (seconds per step, losses, peak
    memory in GiB: torch.cuda.max_memory_allocated since the call on CUDA, else the process's max RSS)."""
    import torch

    from learner.step import train_step  # lazy: imports torch

    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        st = train_step(model, opt, rows, rows, lc, temperature=1.0, world=1, pad_id=0, device=dev, group=group)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(st[M.LOSS])
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    return times, losses, peak


def run_each(target, settings: list, args) -> list[dict]:
    """target(setting, args, port, out_queue) in a fresh process per setting (fresh_processes: a clean allocator
    and a clean peak for each), one after another; a process that dies (e.g. out of memory) ends the
    bench at once instead of leaving it waiting."""

    ctx = fresh_processes()
    results = []
    for setting in settings:
        out = ctx.Queue()
        pr = ctx.Process(target=target, args=(setting, args, free_port(), out))
        pr.start()
        while True:
            try:
                results.append(out.get(timeout=POLL_S))
                break
            except queue.Empty:
                if not pr.is_alive():
                    raise SystemExit(f"{setting} failed (exit code {pr.exitcode}); see its traceback above")
        pr.join(120)
    return results
