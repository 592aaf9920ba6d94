"""Turning a step's prompt groups into equal per-rank shares and padded micro-batches.

Pure: lists and tensors in, lists and tensors out. The FSDP contract this keeps: every
rank gets the same number of rows, hence the same number of micro-batches, or the
collectives inside forward/backward would deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from learner.losses import grpo_advantages


@dataclass
class Row:
    """One trainable sample: a prompt, its response, and what the loss needs about it."""
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behavior_logprobs: np.ndarray
    advantage: float
    reward: float
    staleness: int
    group_id: str

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def groups_to_rows(groups, learner_version: int, *, scale_std: bool = True) -> list[Row]:
    """Flatten groups into rows with GRPO advantages computed per group."""
    rewards, index, rows = [], [], []
    for gi, g in enumerate(groups):
        for s in g.samples:
            rewards.append(s.reward)
            index.append(gi)
            rows.append((g, s))
    adv = grpo_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(index), scale=scale_std)
    return [Row(prompt_ids=g.prompt_ids, response_ids=s.response_ids, behavior_logprobs=s.behavior_logprobs,
                advantage=float(a), reward=float(s.reward), staleness=learner_version - s.version_start,
                group_id=g.group_id) for (g, s), a in zip(rows, adv.tolist())]


def split_rows(rows: list[Row], num_ranks: int) -> list[list[Row]]:
    """Deal rows to ranks, longest first in snake order: equal counts, near-equal tokens."""
    if len(rows) % num_ranks:
        raise ValueError(f"{len(rows)} rows cannot be split equally over {num_ranks} ranks")
    order = sorted(range(len(rows)), key=lambda i: -rows[i].num_tokens)
    shares: list[list[Row]] = [[] for _ in range(num_ranks)]
    for pos, i in enumerate(order):
        r = pos % (2 * num_ranks)
        shares[r if r < num_ranks else 2 * num_ranks - 1 - r].append(rows[i])
    return shares


def micro_batches(rows: list[Row], size: int) -> list[list[Row]]:
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded causal-LM batch; response fields laid out on the shifted target grid.

    Position t of the `[B, L-1]` tensors is the prediction of input token t+1 from logits t.
    """
    length = max(r.num_tokens for r in rows)
    b = len(rows)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention = torch.zeros((b, length), dtype=torch.long)
    mask = torch.zeros((b, length - 1))
    behavior = torch.zeros((b, length - 1))
    adv = torch.zeros(b)
    fresh = torch.zeros(b)
    for i, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.response_ids)
        input_ids[i, :p] = torch.tensor(np.asarray(r.prompt_ids, dtype=np.int64))
        input_ids[i, p:p + n] = torch.tensor(np.asarray(r.response_ids, dtype=np.int64))
        attention[i, :p + n] = 1
        mask[i, p - 1:p - 1 + n] = 1
        behavior[i, p - 1:p - 1 + n] = torch.tensor(np.asarray(r.behavior_logprobs, dtype=np.float32))
        adv[i] = r.advantage
        fresh[i] = float(r.staleness == 0)
    return {"input_ids": input_ids, "attention_mask": attention, "targets": input_ids[:, 1:],
            "mask": mask, "behavior_logprobs": behavior, "advantages": adv, "fresh": fresh}
