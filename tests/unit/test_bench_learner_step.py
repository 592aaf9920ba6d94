"""bench/learner_step.py's variant isolation: a variant's monkey patches of a modeling module (liger patches
the architecture's rotary function module-wide) do not outlive it."""
from __future__ import annotations

import types

import pytest

from bench.learner_step import unpatched_after

pytestmark = pytest.mark.unit


def test_a_variants_module_patches_are_undone_after_it():
    def rope(q):
        return q

    mod = types.ModuleType("fake_modeling")
    mod.apply_rotary_pos_emb = rope
    with pytest.raises(RuntimeError):  # also when the variant fails
        with unpatched_after(mod):
            mod.apply_rotary_pos_emb = lambda q: -q  # what liger's instance patch does to modeling_llama
            mod.added = 1
            raise RuntimeError("variant failed")
    assert mod.apply_rotary_pos_emb is rope and not hasattr(mod, "added")


def test_synthetic_batches_of_each_kind():
    """--batch: the SmolLM2 run's step (128 rows, responses <= 320), bench.learner's long-tailed RL rows of one
    rank (the 1.5B RL batches: 2 prompts x 8, responses 16..3072) and its dense rows (8 x 2048)."""
    from bench.learner_step import synthetic_rows

    small, rl, dense = (synthetic_rows(1000, 0, kind) for kind in ("smollm2", "rl", "dense"))
    assert len(small) == 128 and max(len(r.response_ids) for r in small) <= 320
    assert len(rl) == 16 and all(16 <= len(r.response_ids) <= 3072 for r in rl)
    assert len({len(r.response_ids) for r in rl}) > 8  # long-tailed lengths, not one length
    assert len(dense) == 8 and all(r.num_tokens == 2048 for r in dense)
    assert [r.num_tokens for r in synthetic_rows(1000, 1, "rl")] != [r.num_tokens for r in rl]  # seeds differ


def test_smaller_synthetic_batches_for_quick_checks():
    """bench.learner_step --groups G: G of the SmolLM2 step's 16 prompt groups; bench.learner --scale S: every row
    length times S (prompt range, response median and cap, dense rows)."""
    from bench.learner import make_rows
    from bench.learner_step import synthetic_rows

    two = synthetic_rows(1000, 0, "smollm2", groups=2)
    assert len(two) == 2 * 8 and len({r.group_id for r in two}) == 2
    dense, rl = make_rows("dense", 1000, 0, scale=0.25), make_rows("rl", 1000, 0, scale=0.25)
    assert len(dense) == 8 and all(r.num_tokens == 512 for r in dense)
    assert len(rl) == 16 and all(16 <= len(r.response_ids) <= 768 and 16 <= len(r.prompt_ids) < 128 for r in rl)
    assert len({len(r.response_ids) for r in rl}) > 8  # still long-tailed
