r"""End to end: this system async (s=2), in lockstep (s=0), the one-process sync baseline, and TRL's
GRPOTrainer, on the same model, task, prompts, reward and sample budget, in one run.

    python -m bench.e2e [--config FILE] [--steps 60] [--only ours_async,ours_s0,sync,trl,trl_vllm]
                        [--threshold R] [--out DIR] [overrides...]

`--config FILE` (YAML merged over configs/default.yaml) and the dotted overrides configure every row:
our rows get both on their command line (`cluster.start`, `experiments.sync`), the TRL rows load the
same config and build their trainer from it (`bench/trl_vllm.py`'s `build`). Without --config: the
built-in task and tiny reverse model.

`trl` generates with transformers (TRL's default; CPU or GPU), `trl_vllm` with vLLM in colocate mode (TRL's
GPU setting with its own defaults: one vLLM engine beside the trainer, CUDA graphs on, its importance-sampling
correction on; the trainer `bench/trl_vllm.py` runs by wall clock with held-out evaluations). The TRL rows
run in this process, whose GPU memory they may keep: list them after our rows. On a config with `env.name`
(multi-turn episodes, e.g. configs/tool_toy.yaml) they run TRL's own tool loop on our environment
(bench/trl_tools.py: each sample an episode, its reward the environment's return) and every row's held-out
evaluation plays episodes.

Same for every row: the model folder (`model.path`, default the built-in tiny reverse model), the
first `steps x groups_per_step` training prompts in the order our job leases them (the config's parquet
files, `data.train_files`, or the built-in task), `actors.n` samples per prompt, temperature, max new
tokens, learning rate, clip, the reward function (rewards/scorers.py), no KL term. Each run's final policy
is scored by the same held-out evaluation (engines/evaluate.py: the config's validation prompts, fixed
samples and seed). Reported: samples/s, wall time until the training reward (mean over WINDOW steps)
first reaches --threshold, final held-out reward. Then, for the async run, where one step's time goes
(the learner's view and the actors'). TRL needs `pip install trl` (`.[bench]`).

On one GPU, SmolLM2 on configs/gsm8k_smollm2.yaml against TRL + vLLM colocate on the same machine:
`bash bench/gpu_smollm2.sh prepare` here, then there `stash` and `model` (the model in
/tmp/smollm2; ray, redis, trl, datasets, multiprocess in /tmp/site, as for its `trl` mode), then

    PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
      python3 -m bench.e2e --config configs/gsm8k_smollm2.yaml --only ours_async,trl_vllm --steps 40 \
      --threshold 0.3 --out /tmp/e2e model.path=/tmp/smollm2 actors.engine=vllm \
      "data.train_files=[$PWD/.gpu8/data/chain_sum/train.parquet]" \
      "data.val_files=[$PWD/.gpu8/data/chain_sum/test.parquet]"; cp /tmp/e2e/*.json /tmp/e2e/*.txt $OUT/

(--out in /tmp: a device call brings back few files, and our rows' run directories hold many.)

`--threshold 0.3` is a training reward, on chain_sum where SmolLM2 starts near 9% accuracy; the config's own
gsm_symbolic data is `.gpu8/data/gsm_symbolic`.
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

from bench import trl_tools, trl_vllm
from cluster.config import load_config
from data.tiny_model import resolve_model_path
from envs.episode import EpisodePlayer
from learner import metric_names as M

ROWS = ("ours_async", "ours_s0", "sync", "trl", "trl_vllm")
WINDOW = 5         # steps in the rolling mean of the training reward
THRESHOLD = 0.6    # training reward that counts as "reached" on the default task (starts near 0.38)


def run_ours(name: str, out: Path, steps: int, overrides: list[str], config: str | None = None) -> dict:
    run = out / name
    shutil.rmtree(run, ignore_errors=True)  # each measurement is a fresh job (cluster.start refuses a used run dir)
    extra = {"ours_async": ["buffer.max_staleness=2"], "ours_s0": ["buffer.max_staleness=0"]}.get(name)
    module = "experiments.sync" if extra is None else "cluster.start"
    cmd = [sys.executable, "-m", module, "--run-dir", str(run), *(["--config", config] if config else []),
           f"trainer.total_steps={steps}", "trainer.tensorboard=false", *(extra or []), *overrides]
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


def run_trl(out: Path, steps: int, overrides: list[str], vllm: bool = False, config: str | None = None) -> dict:
    """TRL GRPOTrainer on the same prompts/reward/model/budget (bench/trl_vllm.py builds it for our config);
    evaluated with our held-out eval. `vllm`: generation on TRL's colocated vLLM engine (CUDA only)."""
    import torch  # lazy: the driver and our rows run without torch in this process

    cfg = load_config(config, overrides)
    a, lc = cfg.actors, cfg.learner
    # where our learner trains (learner.device), in its precision: bf16 compute over fp32 weights
    on_gpu = lc.on_cuda(torch.cuda.is_available())
    if vllm and not (on_gpu and torch.cuda.is_available()):  # learner.device=cuda on a host without one, too
        raise ValueError("the trl_vllm row needs a CUDA GPU (TRL's colocated vLLM engine); learner.device="
                         f"{lc.device} and torch sees {'a' if torch.cuda.is_available() else 'no'} GPU")
    from engines.evaluate import evaluate_prompts  # lazy: imports torch
    from engines.hf_engine import HFEngine  # lazy: imports torch

    trained: list[float] = []
    stamps: list[float] = []
    t_start = [0.0]

    def record(rs: list[float]) -> None:  # the training reward curve, as our rows log theirs per step
        trained.append(sum(rs) / len(rs))
        stamps.append(time.monotonic() - t_start[0])

    if not on_gpu:
        torch.set_num_threads(2)  # TRL's one process on both cores of the 2-core VM (the CPU rows in BENCHMARKS.md)
    # a config with env.name plays multi-turn episodes: TRL's tool loop on our environment (bench/trl_tools.py)
    build = trl_tools.build if cfg.env.multi_turn else trl_vllm.build
    trainer, val, score, _tok = build(cfg, out, max_steps=steps, n_prompts=steps * lc.groups_per_step,
                                      vllm=vllm, on_gpu=on_gpu, on_reward=record)
    t_start[0] = time.monotonic()
    trainer.train()
    wall = time.monotonic() - t_start[0]
    # scored exactly as our learner scores its weights: a fresh engine of the base folder (TRL may
    # have changed the trained module's generation settings) loaded with the trained weights
    from weightsync.flat import checksum  # lazy: imports torch

    sd = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    judge = HFEngine(resolve_model_path(cfg.model.path, cfg.task), device="cuda" if on_gpu else "cpu")
    judge.load_weights(sd, steps, checksum(sd))
    tc = cfg.trainer
    episodes = EpisodePlayer(cfg.env, cfg.env.episode_tokens(cfg.buffer)) if cfg.env.multi_turn else None
    val_reward = evaluate_prompts(judge, val, score, samples=tc.val_samples, temperature=a.temperature,
                                  max_tokens=a.max_tokens, seed=tc.val_seed, episodes=episodes)["reward"]
    return {"name": "trl_vllm" if vllm else "trl", "wall_s": wall, "train_wall_s": wall,
            "samples": steps * lc.groups_per_step * a.n, "rewards": trained, "times": stamps, "val_start": None,
            "val_end": val_reward}


def reached(r: dict, threshold: float = THRESHOLD) -> float | None:
    x = r["rewards"]
    for i in range(WINDOW, len(x) + 1):
        if sum(x[i - WINDOW:i]) / WINDOW >= threshold:
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
    p.add_argument("--config", default=None, help="YAML file merged over configs/default.yaml, for every row")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threshold", type=float, default=THRESHOLD,
                   help=f"training reward (mean of {WINDOW} steps) timed as reached (default: the built-in task's)")
    p.add_argument("--only", default=",".join(ROWS))
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    only = args.only.split(",")
    unknown = set(only) - set(ROWS)
    if unknown or len(set(only)) < len(only):  # a repeated row would reuse (and append to) its run directory
        p.error(f"--only: unknown or repeated rows in {args.only!r}; choose from {','.join(ROWS)}")
    if args.steps < 2:  # profile() times the steps after the first (which includes start-up)
        p.error(f"--steps: at least 2, got {args.steps}")
    if args.config and not Path(args.config).is_file():  # now, not once per row after the rows before it ran
        p.error(f"--config: no file {args.config!r}")
    out = Path(args.out or f"/tmp/bench-e2e-{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    results, failed = [], []
    for name in only:
        print(f"running {name} ({args.steps} steps) ...", flush=True)
        try:
            r = run_trl(out, args.steps, args.overrides, vllm=name == "trl_vllm", config=args.config) \
                if name.startswith("trl") else run_ours(name, out, args.steps, args.overrides, config=args.config)
        except Exception as e:  # one failed row must not lose the rows already measured (or those after it)
            (out / f"{name}.error.txt").write_text(traceback.format_exc())
            print(f"{name} failed: {type(e).__name__}: {str(e)[-300:]} (traceback: {out / f'{name}.error.txt'})",
                  flush=True)
            failed.append(name)
            continue
        results.append(r)
        # each row as soon as it is measured: a later row that crashes or times out leaves these
        (out / f"{name}.json").write_text(json.dumps({k: v for k, v in r.items() if k != "lines"}))
    print(f"\ne2e: {args.steps} steps{f' on {args.config}' if args.config else ''}, same model/prompts/reward/"
          f"budget; threshold: training reward (mean of {WINDOW} steps) >= {args.threshold}")
    print("| run | samples | train wall | samples/s | time to threshold | held-out reward start -> end |")
    print("|---|---|---|---|---|---|")
    for r in results:
        t = reached(r, args.threshold)
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
