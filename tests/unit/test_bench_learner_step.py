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
