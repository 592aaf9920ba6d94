"""The embedded default task: reverse a short string (verifiable, offline, scored 0..1).

Prompts are `"<s>>"` for a random string `s` over a small alphabet; the answer is `s`
reversed, followed by EOS. Held-out prompts are drawn from a disjoint set of strings, so a
rising `val/reward` means the policy improved on strings it never trained on.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from runbase.configload import ConfigError

SEPARATOR = ">"


@dataclass(kw_only=True)
class TaskConfig:
    name: str = "reverse"
    """Task name; `reverse` is the embedded default (the only built-in one so far)."""
    alphabet: str = "abcdefgh"
    """Characters the strings are drawn from."""
    length: int = 4
    """Length of every string to reverse."""
    num_val_prompts: int = 128
    """Size of the fixed held-out prompt set evaluated at step 0 and at the end."""
    seed: int = 1234
    """Seed of the prompt stream and of the held-out split."""

    def __post_init__(self):
        if self.name != "reverse":
            raise ConfigError("name", f"unknown task {self.name!r}; built-in tasks: reverse")
        if len(set(self.alphabet)) != len(self.alphabet) or len(self.alphabet) < 2:
            raise ConfigError("alphabet", "needs at least 2 distinct characters")
        if SEPARATOR in self.alphabet:
            raise ConfigError("alphabet", f"must not contain the separator {SEPARATOR!r}")
        if not 1 <= self.length <= 32:
            raise ConfigError("length", "must be in 1..32")
        if self.num_val_prompts * 4 > len(self.alphabet) ** self.length:
            raise ConfigError("num_val_prompts", "too many for the number of distinct strings")


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    answer: Any                          # the ground truth its reward function compares with
    data_source: str = "reverse"         # picks the reward function (rewards/scorers.py)
    prompt_ids: tuple[int, ...] | None = None  # token ids, when the source tokenized it (datasets)
    extra_info: dict | None = None       # dataset row's extra_info, for reward functions that need it
    messages: tuple | None = None        # dataset row's chat messages ({role, content}), for environments

    def record(self) -> dict:
        """The JSON record the prompt queue carries to actors."""
        rec = {"prompt_id": self.prompt_id, "text": self.text, "answer": self.answer, "data_source": self.data_source}
        if self.prompt_ids is not None:
            rec["prompt_ids"] = list(self.prompt_ids)
        if self.extra_info is not None:
            rec["extra_info"] = self.extra_info
        if self.messages is not None:   # a multi-turn environment starts its episodes from them (envs/core.py)
            rec["messages"] = [dict(m) for m in self.messages]
        return rec


def token_ids(record: dict, tokenizer) -> list[int]:
    """A prompt record's token ids: those its data source stored (datasets render the chat template
    and tokenize once), else its text tokenized. Actors, the evaluation and the sync baseline alike."""
    ids = record.get("prompt_ids")
    return list(ids) if ids is not None else tokenizer(record["text"])["input_ids"]


def make_prompt(s: str) -> Prompt:
    return Prompt(prompt_id=s, text=s + SEPARATOR, answer=s[::-1])


def val_prompts(cfg: TaskConfig) -> list[Prompt]:
    rng = random.Random(cfg.seed)
    seen: set[str] = set()
    while len(seen) < cfg.num_val_prompts:
        seen.add("".join(rng.choice(cfg.alphabet) for _ in range(cfg.length)))
    return [make_prompt(s) for s in sorted(seen)]


class PromptStream:
    """Endless deterministic stream of training prompts (held-out strings excluded).

    `position` is the prompt cursor to save: a stream created with `start=position` yields
    exactly what this one yields next (held-out strings skipped count as positions too).
    """

    def __init__(self, cfg: TaskConfig, start: int = 0):
        self.cfg, self.position = cfg, start
        self.held_out = {p.prompt_id for p in val_prompts(cfg)}

    def __iter__(self):
        return self

    def __next__(self) -> Prompt:
        while True:
            rng = random.Random(f"{self.cfg.seed}:{self.position}")
            s = "".join(rng.choice(self.cfg.alphabet) for _ in range(self.cfg.length))
            self.position += 1
            if s not in self.held_out:
                return make_prompt(s)


def train_prompts(cfg: TaskConfig, start: int = 0) -> PromptStream:
    return PromptStream(cfg, start)
