"""learner/batching.py: rank shares, collation on the shifted grid, rows from groups."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from buffer.schema import Group, Sample
from learner.batching import Row, collate, groups_to_rows, split_rows
from learner.losses import grpo_advantages

pytestmark = pytest.mark.unit


def make_rows(rng, n):
    rows = []
    for k in range(n):
        p, m = int(rng.integers(1, 20)), int(rng.integers(0, 40))
        rows.append(Row(prompt_ids=rng.integers(3, 100, p).astype(np.int32),
                        response_ids=rng.integers(3, 100, m).astype(np.int32),
                        behavior_logprobs=-rng.random(m).astype(np.float32),
                        advantage=float(rng.normal()), reward=0.0, staleness=0, group_id=f"g{k}"))
    return rows


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_split_rows_equal_counts_and_balanced(seed, ranks):
    rng = np.random.default_rng(seed)
    rows = make_rows(rng, ranks * int(rng.integers(1, 9)))
    shares = split_rows(rows, ranks)
    assert len(shares) == ranks
    assert len({len(s) for s in shares}) == 1
    ids = sorted(id(r) for s in shares for r in s)
    assert ids == sorted(id(r) for r in rows)  # every row exactly once
    tokens = [sum(r.num_tokens for r in s) for s in shares]
    assert max(tokens) - min(tokens) <= max(r.num_tokens for r in rows)


def test_split_rows_not_divisible():
    rows = make_rows(np.random.default_rng(0), 5)
    with pytest.raises(ValueError):
        split_rows(rows, 2)


def test_collate_shifted_grid():
    rng = np.random.default_rng(7)
    rows = make_rows(rng, 5)
    b = collate(rows, pad_id=0)
    L = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    assert b["input_ids"].shape == (5, L)
    for k in ("targets", "mask", "behavior_logprobs"):
        assert b[k].shape == (5, L - 1)
    assert torch.equal(b["targets"], b["input_ids"][:, 1:])
    for i, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.response_ids)
        ids = b["input_ids"][i].numpy()
        np.testing.assert_array_equal(ids[:p], r.prompt_ids)
        np.testing.assert_array_equal(ids[p:p + n], r.response_ids)
        assert (ids[p + n:] == 0).all() and b["attention_mask"][i].sum().item() == p + n
        m = b["mask"][i].numpy().astype(bool)
        expected_mask = np.zeros(L - 1, bool)
        expected_mask[p - 1:p - 1 + n] = True
        np.testing.assert_array_equal(m, expected_mask)
        for t in range(L - 1):
            assert b["targets"][i, t] == b["input_ids"][i, t + 1]
        np.testing.assert_array_equal(b["targets"][i].numpy()[m], r.response_ids)
        np.testing.assert_array_equal(b["behavior_logprobs"][i].numpy()[m], r.behavior_logprobs)
        assert (b["behavior_logprobs"][i].numpy()[~m] == 0).all()
        assert b["advantages"][i].item() == pytest.approx(r.advantage, rel=1e-6)


def make_group(rng, gid, n, versions):
    samples = []
    for j in range(n):
        m = int(rng.integers(1, 6))
        samples.append(Sample(response_ids=rng.integers(0, 50, m).astype(np.int32),
                              behavior_logprobs=-rng.random(m).astype(np.float32),
                              reward=float(rng.random()), finish_reason="stop",
                              version_start=versions[j], version_end=versions[j] + 1))
    return Group(group_id=gid, prompt_id=gid, actor_id="a0",
                 prompt_ids=rng.integers(0, 50, 4).astype(np.int32), samples=samples, created_at=0.0)


@pytest.mark.parametrize("scale", [True, False])
def test_groups_to_rows(scale):
    rng = np.random.default_rng(11)
    groups = [make_group(rng, f"g{k}", 4, [k, k, k + 1, 2]) for k in range(3)]
    groups[1].samples[0].reward = groups[1].samples[1].reward = 0.25  # a tie inside a group
    rows = groups_to_rows(groups, learner_version=5, scale_std=scale)
    assert len(rows) == 12
    it = iter(rows)
    for g in groups:
        rw = np.array([s.reward for s in g.samples])
        c = rw - rw.mean()
        ref = c / (rw.std(ddof=1) + 1e-6) if scale else c
        for s, a in zip(g.samples, ref):
            r = next(it)
            assert r.group_id == g.group_id and r.reward == s.reward
            assert r.staleness == 5 - s.version_start
            assert r.response_ids is s.response_ids and r.prompt_ids is g.prompt_ids
            assert r.advantage == pytest.approx(a, abs=1e-9)
    # and it agrees with grpo_advantages on the flattened batch
    flat = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float64)
    idx = torch.tensor([k for k, g in enumerate(groups) for _ in g.samples])
    np.testing.assert_allclose([r.advantage for r in rows], grpo_advantages(flat, idx, scale=scale).numpy())


# ---- dynamic batch size: micro-batches by a token budget -----------------------------------------
from learner.batching import from_shifted, padded_tokens, response_grid, split_by_tokens, token_budget_count  # noqa: E402


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("budget", [40, 64, 200])
def test_split_by_tokens_within_budget_and_complete(seed, budget):
    rng = np.random.default_rng(seed)
    rows = make_rows(rng, int(rng.integers(1, 30)))
    mbs = split_by_tokens(rows, budget)
    assert sorted(id(r) for mb in mbs for r in mb) == sorted(id(r) for r in rows)  # every row once
    for mb in mbs:
        assert mb and (padded_tokens(mb) <= budget or len(mb) == 1)  # an over-long row goes alone
    assert len(mbs) == token_budget_count([r.num_tokens for r in rows], budget)
    # minimal for longest-first packing: merging any two neighbours would exceed the budget
    for a, b in zip(mbs, mbs[1:]):
        assert padded_tokens(a + b) > budget


@pytest.mark.parametrize("seed", range(6))
def test_split_by_tokens_equal_counts_over_ranks(seed):
    """FSDP: every rank runs the same number of micro-batches, the most any rank needs."""
    rng = np.random.default_rng(seed)
    rows = make_rows(rng, 16)
    shares = split_rows(rows, 2)
    budget = 60
    need = max(token_budget_count([r.num_tokens for r in s], budget) for s in shares)
    for s in shares:
        mbs = split_by_tokens(s, budget, need)
        assert len(mbs) == need
        assert sorted(id(r) for mb in mbs for r in mb) == sorted(id(r) for r in s)
        assert all(padded_tokens(mb) <= budget or len(mb) == 1 for mb in mbs)
    with pytest.raises(ValueError):
        split_by_tokens(shares[0], budget, len(shares[0]) + 1)  # more micro-batches than rows


def test_collate_token_fields_and_inverse():
    rng = np.random.default_rng(11)
    rows = [r for r in make_rows(rng, 6) if len(r.response_ids)]
    vals = [torch.arange(len(r.response_ids), dtype=torch.float32) + 100 * i for i, r in enumerate(rows)]
    b = collate(rows, pad_id=0, token_fields={"advantages": vals, "ref_logprobs": vals})
    assert b["advantages"].shape == b["mask"].shape
    assert torch.equal(b["advantages"] * b["mask"], b["advantages"])  # nothing outside response slots
    for got, want in zip(from_shifted(b["ref_logprobs"], rows), vals):
        assert torch.equal(got, want)
    grid = response_grid(vals, [len(v) for v in vals])
    assert grid.shape == (len(rows), max(len(v) for v in vals))
    assert torch.equal(grid[2, :len(vals[2])].float(), vals[2]) and grid[2, len(vals[2]):].abs().sum() == 0


@pytest.mark.parametrize("packed", [False, True])
def test_collate_response_index_and_dtypes(packed):
    """collate's `resp_index` lists exactly the mask's response positions of the flattened grid (what the output
    head selects on a GPU without a host sync), and every field keeps its dtype whatever the rows' arrays hold."""
    rng = np.random.default_rng(11)
    rows = make_rows(rng, 6)
    rows[0].behavior_logprobs = rows[0].behavior_logprobs.astype(np.float64)  # a source handing float64
    rows[1].prompt_ids = list(rows[1].prompt_ids)                             # or plain lists
    b = collate(rows, pad_id=3, packed=packed)
    assert torch.equal(b["resp_index"], b["mask"].reshape(-1).nonzero().squeeze(1))
    assert len(b["resp_index"]) == sum(len(r.response_ids) for r in rows)
    assert b["input_ids"].dtype == b["resp_index"].dtype == torch.int64
    assert all(b[k].dtype == torch.float32 for k in ("mask", "behavior_logprobs", "fresh", "seq_weight", "advantages"))
    first = slice(len(rows[0].prompt_ids) - 1, len(rows[0].prompt_ids) - 1 + len(rows[0].response_ids))
    np.testing.assert_allclose(b["behavior_logprobs"][0, first].numpy(), rows[0].behavior_logprobs, rtol=1e-6)
    assert b["seq_weight"][0, first].tolist() == [np.float32(1.0 / len(rows[0].response_ids))] * len(rows[0].response_ids)
