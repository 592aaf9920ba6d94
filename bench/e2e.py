"""End to end: this system async (s=2), in lockstep (s=0), the one-process sync baseline, and TRL's
GRPOTrainer, on the same model, task, prompts, reward and sample budget, in one run.

    python -m bench.e2e [--steps 60] [--only ours_async,ours_s0,sync,trl,trl_vllm] [--out DIR] [overrides...]

`trl` generates with transformers (TRL's default; CPU or GPU), `trl_vllm` with vLLM in colocate mode (TRL's
GPU setting: one vLLM engine beside the trainer, CUDA graphs on, its importance-sampling correction on; the
rows of `bench/trl_vllm.py`, which runs the same trainer by wall clock with held-out evaluations).

Same for every row: the model folder (`model.path`, default the built-in tiny reverse model), the
first `steps x groups_per_step` training prompts of the task in order, `actors.n` samples per prompt,
temperature, max new tokens, learning rate, the reward function (rewards/scorers.py), no KL term.
Each run's final policy is scored by the same held-out evaluation (engines/evaluate.py: fixed
prompts, samples and seed). Reported: samples/s, wall time until the training reward (mean over
WINDOW steps) first reaches THRESHOLD, final held-out reward. Then, for the async run, where one
step's time goes (the learner's view and the actors'). TRL needs `pip install trl` (`.[bench]`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from cluster.config import load_config
from data.tasks import train_prompts, val_prompts
from data.tiny_model import resolve_model_path
from learner import metric_names as M
from rewards.scorers import record_scorer

ROWS = ("ours_async", "ours_s0", "sync", "trl", "trl_vllm")
WINDOW = 5         # steps in the rolling mean of the training reward
THRESHOLD = 0.6    # training reward that counts as "reached" on the default task (starts near 0.38)


def run_ours(name: str, out: Path, steps: int, overrides: list[str]) -> dict:
    run = out / name
    shutil.rmtree(run, ignore_errors=True)  # each measurement is a fresh job (cluster.start refuses a used run dir)
    extra = {"ours_async": ["buffer.max_staleness=2"], "ours_s0": ["buffer.max_staleness=0"]}.get(name)
    module = "experiments.sync" if extra is None else "cluster.start"
    cmd = [sys.executable, "-m", module, "--run-dir", str(run), f"trainer.total_steps={steps}",
           "trainer.tensorboard=false", *(extra or []), *overrides]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{name} failed: {res.stderr[-2000:]}")
    wall = time.monotonic() - t0
    lines = M.read_metrics(run / "metrics.jsonl")
    start = lines[0][M.TIME] - lines[0].get(M.WAIT_S, 0) - lines[0].get(M.TRAIN_S, 0)
    rewards = [m[M.REWARD_MEAN] for m in lines]
    times = [m[M.TIME] - start for m in lines]
    return {"name": name, "wall_s": wall, "train_wall_s": times[-1], "samples": sum(m[M.SAMPLES] for m in lines),
            "rewards": rewards, "times": times, "val_start": lines[0][M.VAL_REWARD_INITIAL],
            "val_end": lines[-1][M.VAL_REWARD], "run_dir": str(run), "lines": lines}


def run_trl(out: Path, steps: int, overrides: list[str], vllm: bool = False) -> dict:
    """TRL GRPOTrainer on the same prompts/reward/model/budget; evaluated with our held-out eval. `vllm`:
    generation on TRL's colocated vLLM engine (CUDA only)."""
    import torch

    cfg = load_config(None, overrides)
    a, lc = cfg.actors, cfg.learner
    # where our learner trains (learner.device), in its precision: bf16 compute over fp32 weights
    on_gpu = lc.on_cuda(torch.cuda.is_available())
    if vllm and not on_gpu:
        raise ValueError("the trl_vllm row needs a CUDA GPU (TRL's colocated vLLM engine); learner.device="
                         f"{lc.device} and torch sees {'a' if torch.cuda.is_available() else 'no'} GPU")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from engines.evaluate import evaluate_prompts  # lazy: imports torch
    from engines.hf_engine import HFEngine  # lazy: imports torch

    path = resolve_model_path(cfg.model.path, cfg.task)
    stream = train_prompts(cfg.task)
    prompts = [next(stream) for _ in range(steps * lc.groups_per_step)]
    score = record_scorer(cfg.data.reward_options())
    by_text = {p.text: p.record() for p in prompts}
    ds = Dataset.from_list([{"prompt": p.text} for p in prompts])
    trained: list[float] = []
    stamps: list[float] = []
    t_start = [0.0]

    def reward(prompts, completions, **_kw):
        rs = [score(by_text[p], c) for p, c in zip(prompts, completions)]
        trained.append(sum(rs) / len(rs))
        stamps.append(time.monotonic() - t_start[0])
        return rs

    if not on_gpu:
        torch.set_num_threads(2)  # TRL's one process on both cores of the 2-core VM (the CPU rows in BENCHMARKS.md)
    device = "cuda" if on_gpu else "cpu"
    args = GRPOConfig(output_dir=str(out / "trl"), learning_rate=lc.lr, max_steps=steps,
                      per_device_train_batch_size=lc.groups_per_step * a.n, num_generations=a.n,
                      max_completion_length=a.max_tokens, temperature=a.temperature, top_p=1.0, beta=0.0,
                      epsilon=lc.clip_low, epsilon_high=lc.clip_high, max_grad_norm=lc.grad_clip,
                      scale_rewards="group" if lc.scale_adv_by_std else "none", loss_type="dapo",
                      num_iterations=1, steps_per_generation=1, use_cpu=not on_gpu,
                      bf16=on_gpu and lc.param_dtype == "bfloat16", report_to=[], logging_strategy="no",
                      disable_tqdm=True, gradient_checkpointing=False,
                      save_strategy="no", seed=lc.seed, shuffle_dataset=False, lr_scheduler_type="constant",
                      warmup_steps=0, weight_decay=lc.weight_decay, adam_beta1=lc.betas[0], adam_beta2=lc.betas[1],
                      **({"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": a.max_model_len or None}
                         if vllm else {}))
    engine = HFEngine(path, device=device)
    trainer = GRPOTrainer(model=engine.model, reward_funcs=reward, args=args, train_dataset=ds,
                          processing_class=engine.tokenizer)
    t_start[0] = time.monotonic()
    trainer.train()
    wall = time.monotonic() - t_start[0]
    # scored exactly as our learner scores its weights: a fresh engine of the base folder (TRL may
    # have changed the trained module's generation settings) loaded with the trained weights
    from weightsync.flat import checksum  # lazy: imports torch

    sd = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    judge = HFEngine(path, device=device)
    judge.load_weights(sd, steps, checksum(sd))
    tc = cfg.trainer
    val = evaluate_prompts(judge, val_prompts(cfg.task), score, samples=tc.val_samples, temperature=a.temperature,
                           max_tokens=a.max_tokens, seed=tc.val_seed)["reward"]
    return {"name": "trl_vllm" if vllm else "trl", "wall_s": wall, "train_wall_s": wall, "samples": steps * lc.groups_per_step * a.n,
            "rewards": trained, "times": stamps, "val_start": None, "val_end": val}


def reached(r: dict) -> float | None:
    x = r["rewards"]
    for i in range(WINDOW, len(x) + 1):
        if sum(x[i - WINDOW:i]) / WINDOW >= THRESHOLD:
            return r["times"][i - 1]
    return None


def profile(r: dict) -> list[tuple[str, float]]:
    """Where the async learner's step time goes (per step means), from its own metrics."""
    L = r["lines"][1:]  # the first step includes start-up
    n = len(L)
    wall = (L[-1][M.TIME] - r["lines"][0][M.TIME]) / n
    parts = [("waiting for trajectories (sampling + decode)", sum(m[M.WAIT_S] for m in L) / n),
             ("forward/backward + optimizer", sum(m.get(M.TRAIN_S, 0.0) for m in L) / n),
             ("weight publication", sum(m[M.WS_PUBLISH_S] for m in L) / n)]
    parts.append(("other (scatter, metrics, acks, evaluation)", max(0.0, wall - sum(p for _, p in parts))))
    return [("step wall", wall)] + parts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--only", default=",".join(ROWS))
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    only = args.only.split(",")
    unknown = set(only) - set(ROWS)
    if unknown or len(set(only)) < len(only):  # a repeated row would reuse (and append to) its run directory
        p.error(f"--only: unknown or repeated rows in {args.only!r}; choose from {','.join(ROWS)}")
    out = Path(args.out or f"/tmp/bench-e2e-{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    results, failed = [], []
    for name in only:
        print(f"running {name} ({args.steps} steps) ...", flush=True)
        try:
            r = run_trl(out, args.steps, args.overrides, vllm=name == "trl_vllm") if name.startswith("trl") \
                else run_ours(name, out, args.steps, args.overrides)
        except Exception as e:  # one failed row must not lose the rows already measured (or those after it)
            (out / f"{name}.error.txt").write_text(traceback.format_exc())
            print(f"{name} failed: {type(e).__name__}: {str(e)[-300:]} (traceback: {out / f'{name}.error.txt'})",
                  flush=True)
            failed.append(name)
            continue
        results.append(r)
        # each row as soon as it is measured: a later row that crashes or times out leaves these
        (out / f"{name}.json").write_text(json.dumps({k: v for k, v in r.items() if k != "lines"}))
    print(f"\ne2e: {args.steps} steps, same model/prompts/reward/budget; threshold: training reward "
          f"(mean of {WINDOW} steps) >= {THRESHOLD}")
    print("| run | samples | train wall | samples/s | time to threshold | held-out reward start -> end |")
    print("|---|---|---|---|---|---|")
    for r in results:
        t = reached(r)
        start = f"{r['val_start']:.3f}" if r["val_start"] is not None else "(same model)"
        print(f"| {r['name']} | {r['samples']} | {r['train_wall_s']:.1f} s | {r['samples'] / r['train_wall_s']:.1f} | "
              f"{f'{t:.1f} s' if t is not None else 'not reached'} | {start} -> {r['val_end']:.3f} |")
    for name in failed:
        print(f"| {name} | failed | | | | |")
    asy = next((r for r in results if r["name"] == "ours_async"), None)
    if asy:
        print("\nwhere one async learner step goes (mean per step):")
        print("| part | seconds |\n|---|---|")
        for k, v in profile(asy):
            print(f"| {k} | {v:.3f} |")
    with open(out / "e2e.json", "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "lines"} for r in results], f, indent=1)
    print(f"\n(json: {out / 'e2e.json'})")
    return 1 if failed else 0


if __name__ == "__main__":
    # Run as the importable module bench.e2e, not as __main__: TRL's `datasets` hashes objects with dill,
    # which copies __main__'s functions by value. On the H200 image the TRL row failed there (dill could
    # not pickle pyarrow's MonthDayNano type); it ran once imported this way and on the image's own pyarrow.
    from bench.e2e import main as _main

    raise SystemExit(_main())
