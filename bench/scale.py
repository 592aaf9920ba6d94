"""python -m bench.scale RUN_DIR [--gpu-mem CSV] [--peak-tflops X] [--launched UNIX_S] [--json OUT]

One row of the real-model-size benchmark (bench/gpu_scale.sh) from a finished run directory: samples/s and
tokens/s after the first step, the learner's step broken down (wait, train, publish: bench.run_summary), the
learner's RL-effective MFU inside the run, each process's peak GPU memory (nvidia-smi samples taken during
the run), the weights' publication time, launch -> first trained step, and the answer lengths of every
trained sample (mean, p50, p99, max), read from the batches the learner recorded (trainer.record_batches).

RL-effective MFU: the model FLOPs of the tokens the step really trained (prompt + response of every sample,
causal attention over each sample's own context: bench/learner.py's count) over the step's train time
(scatter, forward/backward and optimizer step, perf/train_s), against the card's measured bf16 matmul rate.
Padding, recomputation (activation checkpointing) and the logprob head's chunk recompute are not counted.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

import msgpack
import numpy as np

from bench.learner import flops_per_token
from bench.run_summary import breakdown
from buffer.schema import decode
from cluster.config import load_config
from data.tiny_model import resolve_model_path
from learner import metric_names as M

SKIP_STEPS = 2   # the first steps' start-up costs (compile, first publication) are not a step's


def steps_to_skip(n: int) -> int:
    """SKIP_STEPS, or fewer for a run of few steps (a 7b row makes 3-5 in its window): at least two steps are
    summarised, the first line being the clock's start."""
    if n < 2:
        raise ValueError(f"{n} step(s): a summary needs two")
    return min(SKIP_STEPS, n - 2)


def sample_lengths(run: Path) -> tuple[list[int], list[list[int]]]:
    """Every trained sample's response length, and per step the (prompt + response) length of each sample."""
    responses, per_step = [], []
    for f in sorted((run / "batches").glob("step-*.msgpack")):
        rows = []
        for payload in msgpack.unpackb(f.read_bytes()):
            g = decode(payload, trusted=True)
            for s in g.samples:
                responses.append(len(s.response_ids))
                rows.append(len(g.prompt_ids) + len(s.response_ids))
        per_step.append(rows)
    return responses, per_step


def length_stats(lengths: list[int]) -> dict:
    a = np.asarray(lengths)
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "max": int(a.max())}


def step_flops(model_cfg, rows: list[int]) -> float:
    """Model FLOPs of training these (prompt + response) lengths once: 6 x params per token plus causal
    attention over each row's own context (bench.learner.flops_per_token at the row's mean context)."""
    return sum(flops_per_token(model_cfg, n / 2) * n for n in rows)


def mfu(lines: list[dict], per_step: list[list[int]], model_cfg, peak: float, skip: int) -> float | None:
    """RL-effective MFU over the steps after the first `skip`: recorded batches pair with metrics lines by step."""
    flops = train = 0.0
    for m in lines[skip:]:
        if m[M.STEP] < len(per_step) and m.get(M.TRAIN_S):
            flops += step_flops(model_cfg, per_step[m[M.STEP]])
            train += m[M.TRAIN_S]
    return flops / train / peak if train else None


def gpu_memory_peaks(csv_path: Path, status: dict) -> dict[str, float]:
    """role -> peak GiB from `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -l`
    samples, pids named by status.json's placement (others by pid)."""
    roles = {str(w.get("pid")): role for role, w in status.get("placement", {}).items()}
    peaks: dict[str, float] = {}
    with open(csv_path) as fh:
        for row in csv.reader(fh):
            if len(row) < 2 or not row[0].strip().isdigit():
                continue
            who = roles.get(row[0].strip(), f"pid {row[0].strip()}")
            peaks[who] = max(peaks.get(who, 0.0), float(row[1]) / 1024)
    return dict(sorted(peaks.items()))


def member_receive_s(status: dict) -> dict[str, float]:
    """Per actor, the mean time from taking up a version's first message to holding the version checked (its weight
    subscriber's part of a publication: what `acks_each` adds to it is the messages' and acknowledgements' way)."""
    return {who: m["weights_receive_s"] / m["weights_received"] for who, m in status.get("members", {}).items()
            if m.get("weights_received")}


def member_phases_s(status: dict) -> dict[str, dict[str, float]]:
    """Per actor, `member_receive_s` by phase of its backend's receive (cuda_ipc: open, sender, copy, ack, wait, verify),
    each a mean per version received."""
    return {who: {k: v / m["weights_received"] for k, v in m.get("weights_phase_s", {}).items()}
            for who, m in status.get("members", {}).items() if m.get("weights_received")}


def summarise(run: Path, *, gpu_mem: Path | None, peak_tflops: float, launched: float | None) -> dict:
    from transformers import AutoConfig

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    status = json.loads((run / "status.json").read_text()) if (run / "status.json").exists() else {}
    cfg_model = AutoConfig.from_pretrained(_model_path(run))
    responses, per_step = sample_lengths(run)
    skip = steps_to_skip(len(lines))
    b = breakdown(lines, skip)
    steady = lines[1:]
    wall = lines[-1][M.TIME] - lines[0][M.TIME]
    tokens = sum(sum(r) for r in per_step[1:len(lines)])
    out = {"steps": len(lines), "skipped_steps": skip, "samples_per_s": b["samples_per_s"],
           "tokens_per_s": tokens / wall if wall else None,
           "response_tokens_per_s": sum(responses[len(per_step[0]):]) / wall if wall else None,
           "step": {k: b.get(k) for k in (M.WAIT_S, M.TRAIN_S, M.PUBLISH_S, M.WS_PUBLISH_S, M.OTHER_S)},
           "publish_s": {"mean": statistics.fmean(m[M.WS_PUBLISH_S] for m in steady if M.WS_PUBLISH_S in m),
                         "max": max(m[M.WS_PUBLISH_S] for m in steady if M.WS_PUBLISH_S in m),
                         "each": [m[M.WS_PUBLISH_S] for m in steady if M.WS_PUBLISH_S in m],
                         "acks_each": [m[M.WS_ACKS_S] for m in steady if M.WS_ACKS_S in m],
                         "member_receive_mean": member_receive_s(status),
                         "member_phases_mean": member_phases_s(status)},
           "weights_bytes": lines[-1].get(M.WS_BYTES),
           "mfu_rl_effective": mfu(lines, per_step, cfg_model, peak_tflops * 1e12, skip),
           "peak_tflops": peak_tflops, "lengths": length_stats(responses),
           "launch_to_first_step_s": lines[0][M.TIME] - launched if launched is not None
           else status.get("startup", {}).get("learner-0:first_step")}
    if gpu_mem is not None and gpu_mem.exists():
        out["gpu_peak_gib"] = gpu_memory_peaks(gpu_mem, status)
    return out


def _model_path(run: Path) -> str:
    """The run's model folder (a built-in model: its cached folder)."""
    cfg = load_config(str(run / "config.yaml"))
    return resolve_model_path(cfg.model.path, cfg.task)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--gpu-mem", type=Path, help="nvidia-smi --query-compute-apps samples (CSV)")
    ap.add_argument("--peak-tflops", type=float, required=True, help="the card's measured dense bf16 TFLOP/s")
    ap.add_argument("--launched", type=float, help="unix time the job was launched (launch -> first step)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    res = summarise(args.run, gpu_mem=args.gpu_mem, peak_tflops=args.peak_tflops, launched=args.launched)
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
