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
    loss_mask: np.ndarray | None = None
    """A multi-turn sample's mask over response_ids (1: the model sampled the token, 0: an environment
    token, never trained on); None: every response token is the model's."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def loss_tokens(self) -> int:
        """The response tokens the loss is over (the model's): what every loss normalisation counts."""
        return len(self.response_ids) if self.loss_mask is None else int(self.loss_mask.sum())

    def response_mask(self) -> np.ndarray:
        """The loss mask as float32, all ones without one."""
        if self.loss_mask is None:
            return np.ones(len(self.response_ids), dtype=np.float32)
        return self.loss_mask.astype(np.float32)


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
                group_id=g.group_id, loss_mask=s.loss_mask) for (g, s), a in zip(rows, adv.tolist())]


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


def slots(rows: list[Row], packed: bool) -> list[tuple[int, int]]:
    """Where each row's tokens start in a collated batch: (batch row, column). Right-padded: row i
    at (i, 0); packed: every row in batch row 0, one after another."""
    if not packed:
        return [(i, 0) for i in range(len(rows))]
    starts = np.cumsum([0] + [r.num_tokens for r in rows[:-1]])
    return [(0, int(c)) for c in starts]


def collated_shape(rows: list[Row], packed: bool, pack_multiple: int = 0) -> tuple[int, int]:
    """(batch rows, tokens per row) of collate's tensors: every slot, real or padding, is computed."""
    if not packed:
        return len(rows), max(r.num_tokens for r in rows)
    real = sum(r.num_tokens for r in rows)
    m = max(1, pack_multiple)
    return 1, -(-real // m) * m


def collate(rows: list[Row], pad_id: int, token_fields: dict[str, list] | None = None, *,
            packed: bool = False, pack_multiple: int = 0) -> dict[str, torch.Tensor]:
    """A causal-LM batch; response fields laid out on the shifted target grid.

    Position t of the `[B, L-1]` tensors is the prediction of input token t+1 from logits t.
    Right-padded (default): one batch row per row, `attention_mask` marks the real tokens. Packed:
    every row back to back in one batch row of sum(num_tokens) tokens, no padding at all, with
    `position_ids` restarting at 0 for each row and no `attention_mask` (transformers then keeps
    attention within each row: masking_utils.find_packed_sequence_indices; varlen kernels with
    flash-attention). A row's last token predicts the next row's first: that target is off the mask.
    `mask` is 1 on the response tokens the model sampled (a row's `loss_mask`, else all of them): a
    multi-turn row's environment tokens are inputs, never targets, and `resp_index` (the head's positions)
    leaves them out. `advantages` is per row `[B]` when padded without a token field, else a token grid;
    `fresh` (the row was generated by the learner's current weights) and `seq_weight` (1 / the row's loss
    tokens, for sequence-mean losses) are token grids on the mask. `token_fields` adds per-token values
    computed at learn time (name -> one response-length vector per row, e.g. GAE advantages or reference
    logprobs) on every response slot; a field named `advantages` replaces the per-row advantage.
    `pack_multiple` (packed only) rounds the length up to a multiple of it with one filler sequence
    (pad tokens, its own positions from 0, off every mask): compiled attention kernels (flex_attention)
    then meet a few lengths instead of a new one per micro-batch.
    """
    where = slots(rows, packed)
    b, length = collated_shape(rows, packed, pack_multiple)
    # built in numpy (a slice assignment costs ~1 us there, ~10 in torch: this runs on the learner's critical
    # path, ~1,000 assignments a step), handed to torch without a copy at the end
    input_ids = np.full((b, length), pad_id, dtype=np.int64)
    # padded: which tokens are real; packed: each row's positions from 0 (transformers reads the rows off them)
    extra = np.zeros((b, length), dtype=np.int64)
    grids = {k: np.zeros((b, length - 1), dtype=np.float32) for k in ("mask", "behavior_logprobs", "fresh", "seq_weight")}
    adv = np.zeros((b, length - 1) if packed else b, dtype=np.float32)
    for i, (r, (row, col)) in enumerate(zip(rows, where)):
        p, n = len(r.prompt_ids), len(r.response_ids)
        input_ids[row, col:col + p] = r.prompt_ids
        input_ids[row, col + p:col + p + n] = r.response_ids
        extra[row, col:col + p + n] = np.arange(p + n) if packed else 1
        resp = slice(col + p - 1, col + p - 1 + n)
        m = 1 if r.loss_mask is None else r.loss_mask  # a scalar fill is the cheap path of the single-turn rows
        grids["mask"][row, resp] = m
        grids["behavior_logprobs"][row, resp] = r.behavior_logprobs
        grids["fresh"][row, resp] = m * float(r.staleness == 0)
        grids["seq_weight"][row, resp] = m * (1.0 / max(r.loss_tokens, 1))
        adv[(row, resp) if packed else i] = r.advantage
    real = sum(r.num_tokens for r in rows)
    if packed and length > real:  # the filler: a sequence of its own to transformers, so no real row attends to it
        extra[0, real:] = np.arange(length - real)
    ids = torch.from_numpy(input_ids)
    out = {"input_ids": ids, "targets": ids[:, 1:], "advantages": torch.from_numpy(adv),
           **{k: torch.from_numpy(v) for k, v in grids.items()},
           # the response positions of the flattened [B, L-1] grid, found here on the host: on a GPU, selecting
           # them by the mask (a nonzero) would make the host wait for the whole forward at the output head
           "resp_index": torch.from_numpy(np.flatnonzero(grids["mask"]))}
    out["position_ids" if packed else "attention_mask"] = torch.from_numpy(extra)
    if packed:  # the rows' boundaries (the filler is a row of its own), for attn_implementation=varlen
        lengths = [r.num_tokens for r in rows] + ([length - real] if length > real else [])
        out["cu_seq_lens"] = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
        out["max_length"] = length_bound(max(lengths))
    out.update({name: _token_grid(rows, where, (b, length - 1), v) for name, v in (token_fields or {}).items()})
    return out


def _token_grid(rows: list[Row], where: list[tuple[int, int]], shape: tuple[int, int], per_row: list) -> torch.Tensor:
    """One of collate's `token_fields`: each row's response-length vector on its response slots."""
    grid = torch.zeros(shape)
    for r, (row, col), v in zip(rows, where, per_row):
        p, n = len(r.prompt_ids), len(r.response_ids)
        grid[row, col + p - 1:col + p - 1 + n] = torch.as_tensor(v, dtype=torch.float32)[:n]
    return grid


def length_bound(n: int) -> int:
    """An upper bound on a packed micro-batch's longest row for the varlen kernel: the next power of
    two (at least 64). The kernel only sizes its grid from it (blocks past a row's end exit at once), and
    a compiled layer specialises on the number: a few values instead of one per step keep it from
    recompiling every step."""
    return max(64, 1 << (max(n, 1) - 1).bit_length())


def layout(lc) -> dict:
    """collate's layout keywords, from a learner config (pack_sequences, pack_multiple)."""
    return {"packed": lc.pack_sequences, "pack_multiple": lc.pack_multiple}


def model_inputs(b: dict) -> dict:
    """The keyword arguments a transformers model takes for a collated batch (either layout). No KV
    cache: a training pass needs none, and with one transformers would not see the packed rows.
    Packed: the rows' boundaries too (read by attn_implementation=varlen, ignored by the others)."""
    if "attention_mask" in b:
        return {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"], "use_cache": False}
    return {"input_ids": b["input_ids"], "position_ids": b["position_ids"], "use_cache": False,
            "cu_seq_lens": b["cu_seq_lens"], "max_length": b["max_length"]}


def to_device(b: dict, device) -> dict:
    """A collated batch on `device` (its tensors; plain numbers such as max_length stay on the host). To a
    GPU each tensor goes from pinned memory without blocking: a copy from pageable memory makes the host wait
    for every kernel queued before it (the previous step's tail), a dozen times per micro-batch. The caching
    host allocator keeps a pinned block until its copy has run."""
    pinned = torch.device(device).type == "cuda"
    return {k: ((v.pin_memory().to(device, non_blocking=True) if pinned else v.to(device)) if torch.is_tensor(v)
                else v) for k, v in b.items()}


def token_budget_count(lengths: list[int], max_tokens: int, packed: bool = False) -> int:
    """How many micro-batches `split_by_tokens` needs for these row lengths (before equalising)."""
    return len(_pack(sorted(lengths, reverse=True), max_tokens, packed))


def _pack(desc_lengths: list[int], max_tokens: int, packed: bool = False) -> list[int]:
    """Greedy packing of lengths sorted longest first; returns the size of each micro-batch.

    A right-padded micro-batch costs rows x its first (longest) row; a packed one the sum of its
    rows. Rows are added while the cost stays within the budget. A row longer than the budget on
    its own still gets a micro-batch (it has to be trained), alone.
    """
    sizes: list[int] = []
    longest = total = 0
    for n in desc_lengths:
        if sizes and ((total + n) if packed else (sizes[-1] + 1) * longest) <= max_tokens:
            sizes[-1] += 1
            total += n
        else:
            sizes.append(1)
            longest = total = n
    return sizes


def split_by_tokens(rows: list[Row], max_tokens: int, count: int | None = None, packed: bool = False
                    ) -> list[list[Row]]:
    """Micro-batches by a token budget (tokens per micro-batch <= max_tokens, counting padding unless
    `packed`), exactly `count` of them when given (every rank must run the same number: FSDP collectives).

    Rows go longest first; to reach `count`, the costliest micro-batch with two or more rows is
    halved (halving only lowers costs, so the budget still holds). `count` must lie between the
    packed count and the number of rows.
    """
    order = sorted(rows, key=lambda r: -r.num_tokens)
    mbs, i = [], 0
    for size in _pack([r.num_tokens for r in order], max_tokens, packed):
        mbs.append(order[i:i + size])
        i += size
    count = len(mbs) if count is None else count
    if not len(mbs) <= count <= max(len(rows), len(mbs)):
        raise ValueError(f"cannot cut {len(rows)} rows into {count} micro-batches within {max_tokens} tokens")
    while len(mbs) < count:
        k = max((j for j in range(len(mbs)) if len(mbs[j]) > 1),
                key=lambda j: sum(r.num_tokens for r in mbs[j]) if packed else len(mbs[j]) * mbs[j][0].num_tokens)
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
    placement `collate` does; a single batch row holding several rows is the packed layout)."""
    where = slots(rows, packed=grid.shape[0] == 1 and len(rows) > 1)
    return [grid[row, col + len(r.prompt_ids) - 1:col + len(r.prompt_ids) - 1 + len(r.response_ids)]
            for r, (row, col) in zip(rows, where)]
