"""TRL's GRPOTrainer with vLLM in colocate mode on one of our configs: the synchronous peer, measured on
the same model folder, prompts (the config's parquet files, in order), reward, samples per prompt,
temperature, max new tokens, learning rate and clip as our job, with TRL's own defaults otherwise (one
vLLM engine beside the trainer, CUDA graphs on, its importance-sampling correction on).

    python -m bench.trl_vllm --config configs/gsm8k_smollm2.yaml --seconds 200 --out DIR [overrides...]

Held-out evaluation on a fixed cadence in seconds of training (`--val-every-s`): the config's validation
prompts x `trainer.val_samples`, sampled on TRL's own vLLM engine (so it sees the current weights), scored
by our scorer; the evaluation's own time is kept off the training clock, as it runs off our learner's loop.
Writes DIR/trl.metrics.jsonl (one line per evaluation: seconds of training, steps, samples, accuracy,
reward, eval seconds) and prints each line. GPU only; needs `trl`, `datasets` and `vllm`.
`grpo_config` and `build` are also bench.e2e's TRL rows (`trl`, `trl_vllm`), stopped there by steps. A config
with `env.name` (multi-turn episodes) is bench/trl_tools.py's row, which shares this module's pieces.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cluster.config import load_config
from data.dataset import prompt_sources
from data.tasks import token_ids
from data.tiny_model import resolve_model_path
from engines.lora import enabled, peft_config
from rewards.scorers import FULL_SCORE, record_scorer

VAL_SEED = 4321  # one seed for every evaluation: the same prompts and draws, only the weights change


def grpo_config(cfg, out: Path, *, max_steps: int, vllm: bool = True, on_gpu: bool = True, micro_batch: int = 0,
                vllm_memory: float = 0.0, eos_id: int | None = None, episode_tokens: int = 0, max_turns: int = 0):
    """TRL's GRPOConfig for one of our configs: the same learning rate, clip, batch (groups_per_step x n),
    samples per prompt, temperature and max new tokens as our job, no KL term, one optimizer step per
    generation. `vllm`: generation on TRL's colocated vLLM engine (CUDA only); else with transformers.
    `micro_batch`: rows per forward/backward (gradient accumulation over the step's batch; 0: the whole batch
    at once, TRL's default); `vllm_memory`: its vllm_gpu_memory_utilization (0: TRL's default); `eos_id`: the
    token actors.eos_logit_bias applies to, passed to TRL's vLLM as SamplingParams.logit_bias.
    `episode_tokens`: multi-turn episodes (bench/trl_tools.py): TRL's completion is then the whole episode, so
    its max_completion_length bounds the episode (turns and observations, as env.max_episode_tokens bounds ours)
    and each turn is capped at actors.max_tokens by the generation kwargs; `max_turns` is TRL's
    max_tool_calling_iterations (one `step` call per turn)."""
    import torch  # lazy: bench.e2e imports this module for a driver that runs without torch
    from trl import GRPOConfig

    a, lc = cfg.actors, cfg.learner
    batch = lc.groups_per_step * a.n
    micro = micro_batch or batch
    if batch % micro:
        raise ValueError(f"micro_batch {micro} must divide the step's {batch} rows")
    args = dict(
        output_dir=str(out / "trl"), learning_rate=lc.lr, max_steps=max_steps,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro, num_generations=a.n,
        max_completion_length=episode_tokens or a.max_tokens, temperature=a.temperature, top_p=1.0, beta=0.0,
        epsilon=lc.clip_low, epsilon_high=lc.clip_high, max_grad_norm=lc.grad_clip,
        scale_rewards="group" if lc.scale_adv_by_std else "none", loss_type="dapo",
        num_iterations=1, steps_per_generation=batch // micro,  # one generation per optimizer step
        report_to=[], logging_strategy="no",
        disable_tqdm=True, save_strategy="no", seed=lc.seed, shuffle_dataset=False,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=lc.weight_decay,
        adam_beta1=lc.betas[0], adam_beta2=lc.betas[1], use_cpu=not on_gpu,
        # bf16 compute over fp32 master weights, as our learner trains with learner.param_dtype=bfloat16; a LoRA
        # run's frozen base in our learner.master_dtype, as ours holds it (a bf16 7B base beside its engine)
        bf16=on_gpu and lc.param_dtype == "bfloat16",
        model_init_kwargs={"dtype": getattr(torch, lc.master_dtype) if enabled(lc.lora) else torch.float32})
    # our engines' length controls: the EOS bias, and for episodes a turn as long as our actors' (each backend
    # names its per-call cap its own way)
    gen = {"logit_bias": {eos_id: a.eos_logit_bias}} if a.eos_logit_bias and eos_id is not None else {}
    if episode_tokens:
        gen["max_tokens" if vllm else "max_new_tokens"] = a.max_tokens
        args["max_tool_calling_iterations"] = max_turns
    if gen:
        args["generation_kwargs"] = gen
    if vllm:
        # TRL's GPU setting with its own defaults otherwise (CUDA graphs, gradient checkpointing and the
        # importance-sampling correction on): the peer measured in BENCHMARKS.md
        more = {"vllm_gpu_memory_utilization": vllm_memory} if vllm_memory else {}
        return GRPOConfig(**args, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=a.max_model_len or None,
                          **more)
    # transformers generation, bench.e2e's `trl` row as measured in BENCHMARKS.md: without gradient
    # checkpointing, which TRL turns on and our learner leaves off (learner.activation_checkpointing)
    return GRPOConfig(**args, gradient_checkpointing=False)


def wall_clock_prompts(stream) -> int:
    """Training prompts to give a run stopped by wall clock (--seconds): four passes over a dataset's rows
    are far more than it gets through, capped for the endless built-in task (no rows to count)."""
    return min(20_000, len(stream.prompts) * 4) if hasattr(stream, "prompts") else 20_000


def training_prompts(cfg, tok, n_prompts: int | None = None) -> tuple[list, list]:
    """(the first `n_prompts` training prompts in the order our job leases them (default: enough for a
    wall-clock run), the validation prompts) of one config: its parquet files or the built-in task."""
    stream, val = prompt_sources(cfg, tok)
    return [next(stream) for _ in range(n_prompts or wall_clock_prompts(stream))], val


def build(cfg, out: Path, *, max_steps: int = 100_000, n_prompts: int | None = None, vllm: bool = True,
          on_gpu: bool = True, on_reward=None, on_lengths=None, micro_batch: int = 0, vllm_memory: float = 0.0):
    """(trainer, validation prompts, scorer, tokenizer) for one config: its data (parquet files or the
    built-in task) through `prompt_sources`, the first `n_prompts` training prompts (default: enough for a
    wall-clock run) in the order our job leases them. `on_reward(rewards)` sees each scored batch.
    The default `max_steps` is never reached: this module's run is stopped by wall clock."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    path = resolve_model_path(cfg.model.path, cfg.task)
    tok = AutoTokenizer.from_pretrained(path)
    prompts, val = training_prompts(cfg, tok, n_prompts)
    by_text = {p.text: p.record() for p in prompts}
    score = record_scorer(cfg.data.reward_options())

    def reward(prompts, completions, completion_ids=None, **_kw):
        rs = [score(by_text[p], c) for p, c in zip(prompts, completions)]
        if on_reward is not None:
            on_reward(rs)
        if on_lengths is not None and completion_ids is not None:  # answer lengths in tokens, as TRL sampled them
            on_lengths([len(ids) for ids in completion_ids])
        return rs

    args = grpo_config(cfg, out, max_steps=max_steps, vllm=vllm, on_gpu=on_gpu, micro_batch=micro_batch,
                       vllm_memory=vllm_memory, eos_id=tok.eos_token_id)
    ds = Dataset.from_list([{"prompt": p.text} for p in prompts])
    # learner.lora: TRL trains the same PEFT adapter (rank, alpha, dropout, target modules) on the frozen base
    lora = peft_config(cfg.learner.lora) if enabled(cfg.learner.lora) else None
    trainer = GRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          peft_config=lora)
    return trainer, val, score, tok


def evaluate(trainer, val, score, tok, cfg) -> dict:
    """Accuracy and mean reward of the current weights on the held-out prompts (TRL's vLLM engine)."""
    from vllm import SamplingParams

    gen = trainer.vllm_generation
    gen.sync_weights()  # the engine holds the weights of the last generation; evaluate the trained ones
    recs = [p.record() for p in val]
    sp = SamplingParams(n=cfg.trainer.val_samples, temperature=cfg.actors.temperature, top_p=1.0,
                        max_tokens=cfg.actors.max_tokens, seed=VAL_SEED)
    outs = gen.llm.generate([{"prompt_token_ids": token_ids(r, tok)} for r in recs], sp, use_tqdm=False)
    s = [score(r, c.text) for r, o in zip(recs, outs) for c in o.outputs]
    return {"accuracy": sum(x >= FULL_SCORE for x in s) / len(s), "reward": sum(s) / len(s), "samples": len(s)}


def make_clock(trainer, val, score, tok, cfg, seconds: float, every_s: float, log, evaluate_fn=None):
    """A TrainerCallback that evaluates every `every_s` seconds of training and stops at `seconds`
    (`evaluate_fn`: this module's `evaluate` unless given, bench/trl_tools.py's for episodes)."""
    evaluate_fn = evaluate_fn or evaluate
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.off = 0.0        # seconds spent evaluating: not training time
            self.next_eval = 0.0

        def train_s(self) -> float:
            return time.monotonic() - self.t0 - self.off

        def on_step_end(self, args, state, control, **kw):
            if self.t0 is None:  # the clock starts after the first step, as our "seconds after the first step"
                self.t0 = time.monotonic()
                self._eval(state)
                return control
            if self.train_s() >= self.next_eval:
                self._eval(state)
            if self.train_s() >= seconds:
                control.should_training_stop = True
            return control

        def _eval(self, state):
            t = time.monotonic()
            at = self.train_s()
            r = evaluate_fn(trainer, val, score, tok, cfg)
            self.off += time.monotonic() - t
            n = cfg.learner.groups_per_step * cfg.actors.n
            log({"train_s": round(at, 2), "step": state.global_step, "samples": state.global_step * n,
                 "val/accuracy": r["accuracy"], "val/reward": r["reward"], "eval_s": round(time.monotonic() - t, 3)})
            self.next_eval = at + every_s

    return Clock()


def _lengths_and_memory(lengths: list[int], first: int, wall: float) -> dict:
    """Answer lengths of every sample TRL generated (mean, p50, p99, max), response tokens per training
    second after the first step's batch, and the process's peak GPU memory (trainer and engine share it)."""
    import numpy as np
    import torch

    out = {}
    if lengths:
        a = np.asarray(lengths)
        out["lengths"] = {"n": int(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
                          "p99": float(np.percentile(a, 99)), "max": int(a.max())}
        out["response_tokens_per_s"] = round(float(a[first:].sum()) / max(wall, 1e-9), 1)
    if torch.cuda.is_available():
        out["torch_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def arg_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of a wall-clock TRL run (this module's, bench/trl_tools.py's)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--seconds", type=float, default=200.0, help="training seconds after the first step")
    ap.add_argument("--val-every-s", type=float, default=15.0, help="evaluation cadence in training seconds")
    ap.add_argument("--out", default="runs/trl_vllm")
    ap.add_argument("--micro-batch", type=int, default=0, help="rows per forward/backward (0: the whole step)")
    ap.add_argument("--vllm-memory", type=float, default=0.0, help="vllm_gpu_memory_utilization (0: TRL's)")
    ap.add_argument("overrides", nargs="*")
    return ap


def main(argv=None) -> None:
    args = arg_parser(__doc__).parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if cfg.env.multi_turn:  # else TRL would train single-turn on the episodes' prompts, scored as plain answers
        raise SystemExit(f"--config {args.config} plays multi-turn episodes (env.name={cfg.env.name}): their TRL "
                         f"row is `python -m bench.trl_tools` with the same arguments")
    run(cfg, args, build, evaluate)


def run(cfg, args, build_fn, evaluate_fn, summary_fn=None) -> None:
    """Train by wall clock with held-out evaluations, then log the summary line (with `summary_fn()`'s fields):
    `build_fn` is `build` or bench/trl_tools.py's, `evaluate_fn` the matching evaluation."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sink = (out / "trl.metrics.jsonl").open("w")

    def log(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        sink.write(json.dumps(rec) + "\n")
        sink.flush()

    t_launch = time.monotonic()
    lengths: list[int] = []
    trainer, val, score, tok = build_fn(cfg, out, on_lengths=lengths.extend, micro_batch=args.micro_batch,
                                        vllm_memory=args.vllm_memory)
    clock = make_clock(trainer, val, score, tok, cfg, args.seconds, args.val_every_s, log, evaluate_fn)
    trainer.add_callback(clock)
    try:
        trainer.train()
    finally:
        steps = trainer.state.global_step
        n = steps * cfg.learner.groups_per_step * cfg.actors.n
        wall = clock.train_s() if clock.t0 else 0.0
        # the window opens at the first step's end: its samples are not counted, and before two steps there is no rate
        rate = (n - cfg.learner.groups_per_step * cfg.actors.n) / wall if steps >= 2 and wall > 0 else None
        log({"summary": True, "steps": steps, "samples": n, "train_s": round(wall, 2),
             "samples_per_s": None if rate is None else round(rate, 1),
             "launch_to_first_step_s": round(clock.t0 - t_launch, 1) if clock.t0 else None,
             **_lengths_and_memory(lengths, cfg.learner.groups_per_step * cfg.actors.n, wall),
             **(summary_fn() if summary_fn else {})})
        sink.close()


if __name__ == "__main__":
    main()
