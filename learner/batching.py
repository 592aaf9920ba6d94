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


def collate(rows: list[Row], pad_id: int, token_fields: dict[str, list] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded causal-LM batch; response fields laid out on the shifted target grid.

    Position t of the `[B, L-1]` tensors is the prediction of input token t+1 from logits t.
    `token_fields` adds per-token values computed at learn time (name -> one response-length
    vector per row, e.g. GAE advantages or reference logprobs) on the same grid; a field named
    `advantages` replaces the per-row advantage by a per-token one.
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
    out = {"input_ids": input_ids, "attention_mask": attention, "targets": input_ids[:, 1:],
           "mask": mask, "behavior_logprobs": behavior, "advantages": adv, "fresh": fresh}
    for name, per_row in (token_fields or {}).items():
        grid = torch.zeros((b, length - 1))
        for i, (r, v) in enumerate(zip(rows, per_row)):
            p, n = len(r.prompt_ids), len(r.response_ids)
            grid[i, p - 1:p - 1 + n] = torch.as_tensor(v, dtype=torch.float32)[:n]
        out[name] = grid
    return out


def token_budget_count(lengths: list[int], max_tokens: int) -> int:
    """How many micro-batches `split_by_tokens` needs for these row lengths (before equalising)."""
    return len(_pack(sorted(lengths, reverse=True), max_tokens))


def _pack(desc_lengths: list[int], max_tokens: int) -> list[int]:
    """Greedy packing of lengths sorted longest first; returns the size of each micro-batch.

    A micro-batch is right-padded to its first (longest) row, so its cost in memory is
    rows x longest; rows are added while that stays within the budget. A row longer than the
    budget on its own still gets a micro-batch (it has to be trained), alone.
    """
    sizes: list[int] = []
    longest = 0
    for n in desc_lengths:
        if sizes and (sizes[-1] + 1) * longest <= max_tokens:
            sizes[-1] += 1
        else:
            sizes.append(1)
            longest = n
    return sizes


def split_by_tokens(rows: list[Row], max_tokens: int, count: int | None = None) -> list[list[Row]]:
    """Micro-batches by a token budget (padded tokens per micro-batch <= max_tokens), exactly
    `count` of them when given (every rank must run the same number: FSDP collectives).

    Rows go longest first; to reach `count`, the costliest micro-batch with two or more rows is
    halved (halving only lowers costs, so the budget still holds). `count` must lie between the
    packed count and the number of rows.
    """
    order = sorted(rows, key=lambda r: -r.num_tokens)
    mbs, i = [], 0
    for size in _pack([r.num_tokens for r in order], max_tokens):
        mbs.append(order[i:i + size])
        i += size
    count = len(mbs) if count is None else count
    if not len(mbs) <= count <= max(len(rows), len(mbs)):
        raise ValueError(f"cannot cut {len(rows)} rows into {count} micro-batches within {max_tokens} tokens")
    while len(mbs) < count:
        k = max((j for j in range(len(mbs)) if len(mbs[j]) > 1),
                key=lambda j: len(mbs[j]) * mbs[j][0].num_tokens)
        mb = mbs[k]
        mbs[k:k + 1] = [mb[:len(mb) // 2], mb[len(mb) // 2:]]
    return mbs


def padded_tokens(mb: list[Row]) -> int:
    """Memory cost of a right-padded micro-batch: rows x its longest row."""
    return len(mb) * max(r.num_tokens for r in mb)


def response_grid(per_row: list, lengths: list[int]) -> torch.Tensor:
    """Per-row response vectors -> a left-aligned, right-padded `[R, T]` float64 grid."""
    grid = torch.zeros((len(lengths), max(lengths, default=0)), dtype=torch.float64)
    for i, (v, n) in enumerate(zip(per_row, lengths)):
        grid[i, :n] = torch.as_tensor(v, dtype=torch.float64)[:n]
    return grid


def from_shifted(grid: torch.Tensor, rows: list[Row]) -> list[torch.Tensor]:
    """The response slots of a collated `[B, L-1]` tensor, one 1-D tensor per row (inverse of the
    placement `collate` does)."""
    return [grid[i, len(r.prompt_ids) - 1:len(r.prompt_ids) - 1 + len(r.response_ids)]
            for i, r in enumerate(rows)]
