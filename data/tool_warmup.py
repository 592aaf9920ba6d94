"""A chat model taught the calculator toy's tool format by supervised fine-tuning on scripted episodes.

    python -m data.calculator --local_dir ~/data/calculator
    python -m data.tool_warmup --model <chat model folder> --data ~/data/calculator/train.parquet --out <folder>

SmolLM2-135M-Instruct, told the tools in its system message, ended none of 24 sampled turns with a well-formed
`<tool>NAME: ARGUMENT</tool>` or `<answer>...</answer>`: every episode breaks the format and earns 0, so RL
has no signal to start from. The warm-up writes episodes as a scripted player would play them (the tool call
that fits the question, then the answer read from the environment's real result) and trains the model on its
own turns. `--noise` makes that share of the scripted turns wrong (an operand or a letter changed), so the
warmed-up policy is right only part of the time and RL has room above it. Measured on CPU with the defaults
(40 steps of 8 episodes, lr 5e-5, noise 0.4; 11 minutes on 2 cores, seconds on a GPU): loss 0.98 -> 0.24, and on
16 test prompts every episode kept the format and answered (0 of 24 turns before), held-out reward 0.67.

Episodes are built by the code the actors play them with (envs/episode.py): the prompt and every observation
are the chat template's tokens as an actor renders them, so the model learns on the very token sequences RL
later samples and trains on.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from data.dataset import DataConfig, build_prompts
from envs.calculator import CalculatorConfig, CalculatorReverseEnv
from envs.episode import ChatRenderer, after_turn, start_episode

log = logging.getLogger(__name__)

MAX_EPISODE_TOKENS = 512   # a scripted episode is ~40 tokens past its prompt: far below it
LOG_EVERY = 20             # steps between progress lines
_RESULT = re.compile(r"<result>(.*?)</result>", re.S)
_REVERSE = re.compile(r"the string (\S+) written backwards")


def _nudge_number(s: str, rng: random.Random) -> str:
    return str(int(s) + rng.choice([-10, -2, -1, 1, 2, 10])) if s.lstrip("-").isdigit() else s + "1"


def _nudge_text(s: str, rng: random.Random) -> str:
    if not s:
        return "x"
    i = rng.randrange(len(s))
    return s[:i] + rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c != s[i]]) + s[i + 1:]


def scripted_turn(record: dict, messages: list[dict], rng: random.Random, noise: float) -> str:
    """The scripted player's next turn: the tool call for the question, or, once a result came back, the
    answer read from it; wrong with probability `noise`."""
    wrong = rng.random() < noise
    result = _RESULT.search(messages[-1]["content"]) if messages[-1]["role"] != "assistant" else None
    if result is not None and len(messages) > 2:   # the environment answered our call: answer with its result
        answer = result.group(1).strip()
        if wrong:
            answer = _nudge_number(answer, rng) if record["extra_info"]["task"] == "sum" else _nudge_text(answer, rng)
        return f"<answer>{answer}</answer>"
    text = messages[-1]["content"]
    if record["extra_info"]["task"] == "sum":
        nums = re.findall(r"\d+", text)
        if wrong:
            i = rng.randrange(len(nums))
            nums[i] = _nudge_number(nums[i], rng)
        return f"<tool>calc: {' + '.join(nums)}</tool>"
    word = _REVERSE.search(text).group(1)
    return f"<tool>reverse: {_nudge_text(word, rng) if wrong else word}</tool>"


def scripted_episode(record: dict, renderer: ChatRenderer, rng: random.Random, noise: float, env=None):
    """(token ids, labels, reward) of one scripted episode: labels are the ids of the model's own turns (their
    closing EOS included) and -100 elsewhere, as the learner's loss mask has them."""
    env = env or CalculatorReverseEnv(CalculatorConfig(max_turns=3))
    eos = renderer.tok.eos_token_id
    ep = start_episode(env, record, renderer, MAX_EPISODE_TOKENS)
    while not ep.done:
        turn_text = scripted_turn(record, ep.messages, rng, noise)
        ids = list(renderer.tok(turn_text, add_special_tokens=False)["input_ids"])
        ids.append(eos)   # the engine's sample of a turn ends with the model's stop token
        # what after_turn reads of an engine's completion (engines.core.Completion): the turn as sampled at version 0
        turn = SimpleNamespace(token_ids=np.asarray(ids, np.int32), logprobs=np.zeros(len(ids), np.float32),
                               version_start=0, version_end=0)
        after_turn(ep, turn, renderer, eos)
    labels = [-100] * len(ep.prompt_ids) + [t if m else -100 for t, m in zip(ep.response_ids, ep.mask)]
    return ep.prompt_ids + ep.response_ids, labels, ep.total_reward


def records_of(parquet: str, tokenizer) -> list[dict]:
    """The prompt records of data.calculator's rows, as the prompt queue carries them to the actors."""
    return [p.record() for p in build_prompts([parquet], tokenizer, DataConfig())]


def _batch(examples, pad_id: int, device):
    import torch

    width = max(len(ids) for ids, _labels, _r in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (x, y, _r) in enumerate(examples):
        ids[i, :len(x)], labels[i, :len(y)], mask[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    return ids.to(device), labels.to(device), mask.to(device)


def warm_up(model_path: str, data: str, out: str, *, steps: int, batch_size: int, lr: float, noise: float,
            device: str = "cpu", seed: int = 0) -> dict:
    """Fine-tune `model_path` on scripted episodes of the prompts in `data` (data.calculator's parquet) and save it
    (with its tokenizer) to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_path)
    renderer, rng = ChatRenderer(tok), random.Random(seed)
    records = records_of(data, tok)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0, losses, rewards = time.monotonic(), [], []
    for step in range(steps):
        examples = [scripted_episode(records[rng.randrange(len(records))], renderer, rng, noise)
                    for _ in range(batch_size)]
        rewards += [r for _x, _y, r in examples]
        ids, labels, mask = _batch(examples, pad, device)
        for g in opt.param_groups:   # cosine decay to 0: a settled start for RL
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % LOG_EVERY == 0 or step == steps - 1:
            log.info("tool warm-up step %d/%d: loss %.4f", step + 1, steps, losses[-1])
    summary = {"model": str(model_path), "steps": steps, "batch_size": batch_size, "lr": lr, "noise": noise,
               "seed": seed, "first_loss": losses[0], "final_loss": losses[-1],
               "scripted_reward": float(np.mean(rewards)),
               "seconds": round(time.monotonic() - t0, 1)}
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    (Path(out) / "tool_warmup.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.tool_warmup", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a chat model's folder (it needs a chat template)")
    p.add_argument("--data", required=True, help="data.calculator's train.parquet")
    p.add_argument("--out", required=True, help="where the warmed-up model is saved (bf16, with its tokenizer)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--noise", type=float, default=0.4, help="share of scripted turns made wrong (0 <= noise < 1)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or not 0 <= args.noise < 1 or not args.lr > 0:
        p.error("--steps and --batch_size must be >= 1, --noise in [0, 1), --lr > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    summary = warm_up(args.model, args.data, args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      noise=args.noise, device=args.device)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
