"""torch.profiler over a window of the learner's own loop (`trainer.profile_steps`), and the summary
that the learner and `bench.learner_step` both write: GPU kernel time against wall time, kernel
launches, and the top operators by device time and by CPU time.

A real run's steps differ from a bench's: other threads of the learner (the overlapped publication,
the metrics sinks) and other processes on the GPU (actors, the evaluator) share the host and the
device with it. The window covers whole loop iterations (batch read, step, publication, log line),
so what they cost shows up where it happens; the Chrome trace (open it in Perfetto) has the timeline.
"""
from __future__ import annotations

import gzip
import logging
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TOP_OPERATORS = 30   # rows per table in a summary: enough to account for most of a step's time


def summarize(prof, out: Path, wall_s: float, cuda: bool, title: str = "") -> dict:
    """Write `prof`'s summary to `out`; returns wall, GPU kernel time and launches (seconds, count)."""
    from torch.autograd import DeviceType

    ka = prof.key_averages()
    # kernels only (an operator's own row would count its kernels' time again)
    kernel_us = sum(e.self_device_time_total for e in ka if e.device_type == DeviceType.CUDA)
    launches = sum(e.count for e in ka if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        f.write(f"{title}wall {wall_s * 1e3:.1f} ms (profiled), GPU kernel time {kernel_us / 1e3:.1f} ms, "
                f"kernel launches {launches}\n\n")
        f.write(ka.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                         row_limit=TOP_OPERATORS))
        f.write("\n\nby CPU time\n")
        f.write(ka.table(sort_by="cpu_time_total", row_limit=TOP_OPERATORS))
    return {"profiled_wall_s": wall_s, "gpu_kernel_s": kernel_us / 1e6, "launches": launches}


def profiler(cuda: bool):
    """A torch.profiler recording CPU operators and, on a GPU, its kernels."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))


class StepProfiler:
    """Profiles loop iterations `first`..`last` (inclusive) of the learner: `step(n)` at the top of each
    iteration starts and stops it; `close()` at the end stops a window the run ended inside. Writes
    `<out_dir>/learner-rank<R>-steps-<first>-<last>.txt` (the summary) and `.trace.json.gz`."""

    def __init__(self, steps: list[int], out_dir: str | Path, *, rank: int, cuda: bool):
        self.first, self.last = (steps[0], steps[1]) if steps else (None, None)
        self.path = Path(out_dir) / f"learner-rank{rank}-steps-{self.first}-{self.last}"
        self.cuda, self.prof, self.t0, self.done = cuda, None, 0.0, not steps

    def step(self, step: int) -> None:
        if self.done:
            return
        if self.prof is None and self.first <= step <= self.last:
            self.prof = profiler(self.cuda)
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.prof is not None and step > self.last:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        res = summarize(self.prof, self.path.with_suffix(".txt"), wall, self.cuda,
                        title=f"learner loop iterations {self.first}-{self.last}: ")
        trace = Path(f"{self.path}.trace.json")
        self.prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        log.info("profiled steps %s-%s: %s -> %s", self.first, self.last, res, self.path.with_suffix(".txt"))
        self.prof, self.done = None, True
