"""Multi-turn rows in the learner: the loss mask on collate's grids, in the losses, the train step and a step's
REINFORCE++ advantages, each against a NumPy reference or the single-turn path (the token-level rewards,
returns and GAE themselves: tests/unit/test_advantages.py)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from learner import metric_names as M
from learner.batching import Row, collate, from_shifted, groups_to_rows
from learner.config import LearnerConfig
from learner.losses import CORRECTIONS, normalize, policy_loss_terms
from learner.metrics import model_token_frac
from learner.model import response_logprobs
from learner.step import train_step
from learner.train import build_policy
from test_advantages import np_returns
from test_logprob_head import _model
from test_shadow_weights import one_rank_group  # noqa: F401 - the one-rank gloo group train_step all-reduces over

pytestmark = pytest.mark.unit

VOCAB = 250  # below the tiny model's vocabulary


def random_mask(rng, n: int, trailing_env: bool = False) -> np.ndarray:
    """A multi-turn mask: starts with the model's turn, then runs of environment and model tokens; with
    `trailing_env` the response ends with environment tokens (a tool result after the last turn)."""
    mask, model = [], True
    while len(mask) < n:
        mask += [int(model)] * int(rng.integers(1, 4))
        model = not model
    mask = np.array(mask[:n], np.uint8)
    if trailing_env:
        mask[-2:] = 0
    mask[0] = 1
    return mask


def make_row(rng, k: int, n: int, mask: np.ndarray | None, staleness: int = 0) -> Row:
    lp = (-rng.random(n) * 3).astype(np.float32)
    if mask is not None:
        lp[mask == 0] = 0.0  # as the wire carries environment tokens
    return Row(prompt_ids=rng.integers(0, VOCAB, int(rng.integers(2, 7))).astype(np.int32),
               response_ids=rng.integers(0, VOCAB, n).astype(np.int32), behavior_logprobs=lp,
               advantage=float(rng.normal()), reward=float(rng.random()), staleness=staleness, group_id=f"g{k}",
               loss_mask=mask)


def mixed_rows(seed: int, count: int = 6) -> list[Row]:
    """Multi-turn rows (one ending in environment tokens) among single-turn ones."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(count):
        n = int(rng.integers(5, 12))
        mask = None if k % 3 == 2 else random_mask(rng, n, trailing_env=k == 0)
        rows.append(make_row(rng, k, n, mask, staleness=k % 2))
    return rows


def np_reference(rows: list[Row], packed: bool, pack_multiple: int = 0) -> dict[str, np.ndarray]:
    """collate's mask, seq_weight and fresh grids and resp_index, token by token from the rows, and where each
    row starts (batch row, column)."""
    if packed:
        total = sum(r.num_tokens for r in rows)
        m = max(1, pack_multiple)
        b, length = 1, -(-total // m) * m
        where = list(zip([0] * len(rows), np.cumsum([0] + [r.num_tokens for r in rows[:-1]])))
    else:
        b, length = len(rows), max(r.num_tokens for r in rows)
        where = [(i, 0) for i in range(len(rows))]
    grids = {k: np.zeros((b, length - 1), np.float32) for k in ("mask", "seq_weight", "fresh")}
    for r, (row, col) in zip(rows, where):
        lm = np.ones(len(r.response_ids)) if r.loss_mask is None else r.loss_mask.astype(np.float64)
        for k in range(len(r.response_ids)):
            pos = col + len(r.prompt_ids) - 1 + k  # the logits that predict response token k
            grids["mask"][row, pos] = lm[k]
            grids["seq_weight"][row, pos] = lm[k] / lm.sum()
            grids["fresh"][row, pos] = lm[k] * (r.staleness == 0)
    grids["resp_index"] = np.flatnonzero(grids["mask"])
    grids["where"] = where
    return grids


@pytest.mark.parametrize("packed,pack_multiple", [(False, 0), (True, 0), (True, 16)])
@pytest.mark.parametrize("seed", range(3))
def test_collate_puts_the_loss_mask_on_the_grids(seed, packed, pack_multiple):
    rows = mixed_rows(seed)
    b = collate(rows, pad_id=0, packed=packed, pack_multiple=pack_multiple)
    ref = np_reference(rows, packed, pack_multiple)
    for k in ("mask", "seq_weight", "fresh"):
        np.testing.assert_array_equal(b[k].numpy(), ref[k], err_msg=k)
    np.testing.assert_array_equal(b["resp_index"].numpy(), ref["resp_index"])
    # the head's positions predict exactly the model's tokens, with their behavior logprobs
    model_tokens = np.concatenate([r.response_ids[r.response_mask() > 0] for r in rows])
    np.testing.assert_array_equal(b["targets"].reshape(-1)[b["resp_index"]].numpy(), model_tokens)
    model_lp = np.concatenate([r.behavior_logprobs[r.response_mask() > 0] for r in rows])
    np.testing.assert_array_equal(b["behavior_logprobs"].reshape(-1)[b["resp_index"]].numpy(), model_lp)
    for r, (row, col) in zip(rows, ref["where"]):  # environment tokens are inputs all the same
        np.testing.assert_array_equal(b["input_ids"][row, col:col + r.num_tokens].numpy(),
                                      np.concatenate([r.prompt_ids, r.response_ids]))


def test_rows_carry_the_samples_loss_mask():
    from buffer.schema import Group, Sample

    rng = np.random.default_rng(0)
    mask = random_mask(rng, 8)
    lp = np.where(mask == 1, -0.5, 0.0).astype(np.float32)
    samples = [Sample(response_ids=np.arange(8, dtype=np.int32), behavior_logprobs=lp, reward=r, finish_reason="stop",
                      version_start=1, version_end=1, loss_mask=m) for r, m in ((1.0, mask), (0.0, None))]
    g = Group(group_id="g", prompt_id="p", actor_id="a", prompt_ids=np.arange(3, dtype=np.int32), samples=samples,
              created_at=0.0)
    masked, plain = groups_to_rows([g], learner_version=1)
    assert masked.loss_mask is mask and plain.loss_mask is None
    assert masked.loss_tokens == int(mask.sum()) < 8 and plain.loss_tokens == 8
    assert model_token_frac([masked, plain]) == (mask.sum() + 8) / 16
    assert model_token_frac([plain]) == 1.0 and model_token_frac([make_row(rng, 0, 0, None)]) == 1.0
    assert M.MODEL_TOKEN_FRAC in M.TABLE


# ---- the losses --------------------------------------------------------------------------------

def np_policy_loss(rows: list[Row], lps: list[np.ndarray], mode: str, clip: float = 0.2) -> float:
    """PPO-clip over the model's tokens only, normalised by model tokens (token_mean) or per row (seq_mean)."""
    per_row = []
    for r, lp in zip(rows, lps):
        on = r.response_mask() > 0
        ratio = np.exp(lp[on].astype(np.float64) - r.behavior_logprobs[on])
        terms = -np.minimum(ratio * r.advantage, np.clip(ratio, 1 - clip, 1 + clip) * r.advantage)
        per_row.append(terms)
    if mode == "token_mean":
        return sum(t.sum() for t in per_row) / sum(r.loss_tokens for r in rows)
    return sum(t.mean() for t in per_row) / len(rows)


def perturb_environment(rows: list[Row], seed: int) -> list[Row]:
    """The rows with what the loss must not see changed: the behavior logprobs of environment tokens, and the
    tokens of a trailing environment span (no model token comes after them, so nothing trained reads them)."""
    rng = np.random.default_rng(seed)
    out = copy.deepcopy(rows)
    for r in out:
        if r.loss_mask is None:
            continue
        env = r.loss_mask == 0
        r.behavior_logprobs[env] = -rng.random(int(env.sum())).astype(np.float32) * 5
        last_model = int(np.flatnonzero(r.loss_mask)[-1])
        tail = len(r.response_ids) - last_model - 1
        r.response_ids[last_model + 1:] = (r.response_ids[last_model + 1:] + 1 + rng.integers(0, 9, tail)) % VOCAB
    return out


def _loss_and_grads(model, rows, correction, mode, chunk, packed, adv_fields=None):
    model.zero_grad(set_to_none=True)
    b = collate(rows, pad_id=0, token_fields=adv_fields, packed=packed)
    lp = response_logprobs(model, b, 1.0, chunk)
    terms, _ = policy_loss_terms(correction, lp, b["behavior_logprobs"], b["advantages"], b["mask"], clip_low=0.2,
                                 clip_high=0.2, decoupled_cap=2.0, tis_cap=2.0)
    loss = normalize(terms, b["mask"], mode, total_tokens=float(sum(r.loss_tokens for r in rows)),
                     total_seqs=len(rows), seq_weight=b["seq_weight"])
    loss.backward()
    return b, lp.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("chunk,packed", [(0, False), (5, False), (5, True)])
def test_the_loss_reads_only_the_models_tokens(mode, chunk, packed):
    model, rows = _model(False), mixed_rows(4)
    assert any(r.loss_mask is not None and r.loss_mask[-1] == 0 for r in rows)  # a trailing environment span
    b, lp, loss, grads = _loss_and_grads(model, rows, "ppo_clip", mode, chunk, packed)
    lps = [t.numpy() for t in from_shifted(lp, rows)]
    assert float(loss) == pytest.approx(np_policy_loss(rows, lps, mode), rel=1e-5)
    if chunk:  # the chunked head computes the model's tokens only
        assert lp.reshape(-1)[b["mask"].reshape(-1) == 0].abs().max() == 0
    moved = perturb_environment(rows, seed=1)
    for correction in CORRECTIONS:
        _, _, want, want_g = _loss_and_grads(model, rows, correction, mode, chunk, packed)
        # token advantages (GAE, REINFORCE++) of any value on environment tokens change nothing either
        noise = [torch.as_tensor(np.where(r.response_mask() > 0, r.advantage, 1e3 * (k + 1)), dtype=torch.float32)
                 for k, r in enumerate(moved)]
        for fields in (None, {"advantages": noise}):
            _, _, got, got_g = _loss_and_grads(model, moved, correction, mode, chunk, packed, fields)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=correction)
            for n in want_g:
                torch.testing.assert_close(got_g[n], want_g[n], rtol=1e-5, atol=1e-7, msg=f"{correction} {n}")


# ---- the train step ----------------------------------------------------------------------------

def _step(rows, **lc_kw):
    lc = LearnerConfig(plain_one_rank=True, lr=1e-2, device="cpu", micro_batch_size_per_gpu=3, **lc_kw)
    model, opt = build_policy(lc, "", torch.device("cpu"), model=_model(False))
    stats = train_step(model, opt, rows, rows, lc, temperature=1.0, world=1, pad_id=0, device=torch.device("cpu"))
    return stats, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("lc_kw", [{}, {"loss_norm": "seq_mean_token_mean", "correction": "decoupled"},
                                   {"pack_sequences": True, "logprob_chunk_tokens": 4}])
def test_a_mask_of_all_ones_trains_exactly_as_no_mask(one_rank_group, lc_kw):
    rows = mixed_rows(6)
    for r in rows:
        r.loss_mask = None
    ones = copy.deepcopy(rows)
    for r in ones:
        r.loss_mask = np.ones(len(r.response_ids), np.uint8)
    (s0, w0), (s1, w1) = _step(rows, **lc_kw), _step(ones, **lc_kw)
    assert s0 == s1
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


@pytest.mark.parametrize("lc_kw", [{}, {"loss_norm": "seq_mean_token_mean", "pack_sequences": True}])
def test_environment_tokens_do_not_move_the_train_step(one_rank_group, lc_kw):
    rows = mixed_rows(7)
    (s0, w0), (s1, w1) = _step(rows, **lc_kw), _step(perturb_environment(rows, seed=2), **lc_kw)
    assert s0[M.LOSS] == pytest.approx(s1[M.LOSS], rel=1e-6, abs=1e-8)
    assert s0[M.GRAD_NORM] == pytest.approx(s1[M.GRAD_NORM], rel=1e-5)
    for a, b in zip(w0, w1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # the step's loss is normalised by the model's tokens, and its token statistics count them
    b = collate(rows, pad_id=0)
    lps = [t.numpy() for t in from_shifted(response_logprobs(_model(False), b, 1.0, 0).detach(), rows)]
    assert s0[M.LOSS] == pytest.approx(np_policy_loss(rows, lps, lc_kw.get("loss_norm", "token_mean")), rel=1e-5)
    assert s0[M.FRESH_TOKENS] == sum(r.loss_tokens for r in rows if r.staleness == 0)
    # an environment token inside the response is context for the model's later tokens: changing it does move it
    # (in a row of positive advantage: far off-policy, a negative one's terms are all clipped, constant)
    inner = copy.deepcopy(rows)
    r = next(r for r in inner if r.advantage > 0 and r.loss_mask is not None
             and (np.diff(r.loss_mask.astype(int)) == 1).any())
    j = int(np.flatnonzero(np.diff(r.loss_mask.astype(int)) == 1)[0])  # the last environment token before a turn
    r.response_ids[j] = (r.response_ids[j] + 1) % VOCAB
    assert _step(inner, **lc_kw)[0][M.LOSS] != s0[M.LOSS]


# ---- token-level advantages of a step ---------------------------------------------------------

def test_reinforce_pp_advantages_of_a_step_use_the_loss_mask():
    """PPOExtras.prepare (REINFORCE++: no critic, no reference) gives each row's model tokens the whitened
    returns of the reward on its last model token, and its environment tokens nothing."""
    from cluster.config import load_config
    from learner.ppo import PPOExtras

    cfg = load_config(overrides=["algorithm.adv_estimator=reinforce_pp", "algorithm.gamma=0.9"])
    rows = mixed_rows(8)
    prep = PPOExtras(cfg, "", torch.device("cpu")).prepare(rows, rows, [], pad_id=0, temperature=1.0)
    returns = [np_returns(np.eye(r.loss_tokens)[-1] * r.reward, 0.9) for r in rows]  # on the model's tokens
    flat = np.concatenate(returns)
    for r, g in zip(rows, returns):
        got = prep.fields["advantages"][id(r)].numpy()
        on = r.response_mask() > 0
        np.testing.assert_allclose(got[on], (g - flat.mean()) / np.sqrt(flat.var(ddof=1) + 1e-8), rtol=1e-5, atol=1e-6)
        assert not got[~on].any()
