"""engines/copy_plan.py: a weight loader recorded as copies replays the loader's effect on new versions,
and a loader that writes in ways a replay cannot repeat is caught (never trusted)."""
from __future__ import annotations

import pytest
import torch

from engines.copy_plan import CopyPlan, PlannedLoader
from weightsync.flat import layout, pack, unpack

pytestmark = pytest.mark.unit

H, Q, KV, F = 8, 8, 4, 12


class Stacked(torch.nn.Module):
    """Parameters laid out as vLLM lays out a Llama layer: q/k/v and gate/up stacked, bf16."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(Q + 2 * KV, H, dtype=torch.bfloat16), requires_grad=False)
        self.gate_up = torch.nn.Parameter(torch.zeros(2 * F, H, dtype=torch.bfloat16), requires_grad=False)
        self.down_t = torch.nn.Parameter(torch.zeros(H, F, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(H, dtype=torch.bfloat16), requires_grad=False)


def vllm_like_load(m: Stacked, named: dict) -> None:
    """narrow + copy_ per checkpoint tensor, with dtype conversion and a transposed view, as vLLM's
    weight loaders do (QKVParallelLinear / MergedColumnParallelLinear / default_weight_loader)."""
    rows = {"q": (0, Q), "k": (Q, KV), "v": (Q + KV, KV)}
    for name, w in named.items():
        kind = name.split(".")[-1]
        if kind in rows:
            m.qkv.data.narrow(0, *rows[kind]).copy_(w)
        elif kind in ("gate", "up"):
            m.gate_up.data.narrow(0, 0 if kind == "gate" else F, F).copy_(w)
        elif kind == "down":
            m.down_t.data.copy_(w.t())
        else:
            m.norm.data.copy_(w)


def version(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {"l.q": torch.randn(Q, H, generator=g), "l.k": torch.randn(KV, H, generator=g),
          "l.v": torch.randn(KV, H, generator=g), "l.gate": torch.randn(F, H, generator=g),
          "l.up": torch.randn(F, H, generator=g), "l.down": torch.randn(F, H, generator=g),
          "l.norm": torch.randn(H, generator=g)}
    lay = layout(sd)
    return unpack(pack(sd, lay), lay)  # views of one flat fp32 buffer, as a weight subscriber delivers them


def reference(named: dict) -> dict:
    m = Stacked()
    vllm_like_load(m, named)
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_recorded_copies_replay_the_loader_on_new_versions():
    m = Stacked()
    loader = PlannedLoader(lambda named: vllm_like_load(m, named), lambda: dict(m.named_parameters()))
    outcomes = []
    for v in range(1, 5):
        named = version(v)
        outcomes.append(loader(named))
        want = reference(named)
        for k, t in m.state_dict().items():
            assert torch.equal(t, want[k]), (v, k)
    assert outcomes == ["recorded", "verified", "replayed", "replayed"]
    assert len(loader.plan.copies) == 7


def test_a_loader_that_copies_computed_tensors_is_never_replayed():
    m = Stacked()

    def cat_then_copy(named):  # builds the stacked tensor first: the copy's source is no view of an input
        m.qkv.data.copy_(torch.cat([named["l.q"], named["l.k"], named["l.v"]]))

    plan = CopyPlan.record(lambda: cat_then_copy(version(1)), version(1))
    assert not plan.usable and "no view of an input" in plan.why
    loader = PlannedLoader(cat_then_copy, lambda: dict(m.named_parameters()))
    assert [loader(version(v)) for v in (1, 2, 3)] == ["recorded", "loader", "loader"]
    assert torch.equal(m.qkv[:Q], version(3)["l.q"].to(torch.bfloat16))


def test_a_loader_that_also_writes_in_place_fails_the_check_and_keeps_loading_itself():
    m = Stacked()

    def scaled(named):  # copies, then scales in place: a replay of the copies alone would miss the scaling
        vllm_like_load(m, named)
        m.norm.data.mul_(2)

    loader = PlannedLoader(scaled, lambda: dict(m.named_parameters()))
    assert [loader(version(v)) for v in (1, 2, 3)] == ["recorded", "loader", "loader"]
    assert not loader.plan.usable
    assert torch.equal(m.norm, (version(3)["l.norm"].to(torch.bfloat16) * 2))


def test_a_version_of_other_shapes_goes_through_the_loader():
    m = Stacked()
    loader = PlannedLoader(lambda named: vllm_like_load(m, named), lambda: dict(m.named_parameters()))
    loader(version(1))
    other = dict(version(2))
    other["l.norm"] = other["l.norm"].double()
    assert loader(other) == "loader"


def test_a_loader_that_fails_under_recording_is_run_again_alone_and_never_replayed():
    m = Stacked()
    calls = []

    def load(named):  # fails while being recorded (as code that refuses a torch function mode would)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no modes here")
        vllm_like_load(m, named)

    loader = PlannedLoader(load, lambda: dict(m.named_parameters()))
    assert [loader(version(v)) for v in (1, 2)] == ["recorded", "loader"]
    assert "recording failed" in loader.plan.why and len(calls) == 3
    assert torch.equal(m.qkv[:Q], version(2)["l.q"].to(torch.bfloat16))


def test_a_loader_writing_inputs_by_setitem_is_never_replayed():
    m = Stacked()

    def setitem_load(named):  # writes the norm by setitem, the rest by copy_
        vllm_like_load(m, {k: v for k, v in named.items() if k != "l.norm"})
        m.norm.data[:] = named["l.norm"]

    loader = PlannedLoader(setitem_load, lambda: dict(m.named_parameters()))
    assert [loader(version(v)) for v in (1, 2)] == ["recorded", "loader"]
    assert "write other than copy_" in loader.plan.why and loader.plan.copies == []
    assert torch.equal(m.norm, version(2)["l.norm"].to(torch.bfloat16))


def test_a_loader_that_moves_a_parameter_to_new_memory_fails_the_check():
    m = Stacked()
    moves = []

    def moving_load(named):  # from the second call on, the norm gets new memory before it is written
        if moves:
            m.norm.data = torch.zeros_like(m.norm.data)
        moves.append(1)
        vllm_like_load(m, named)

    loader = PlannedLoader(moving_load, lambda: dict(m.named_parameters()))
    assert [loader(version(v)) for v in (1, 2, 3)] == ["recorded", "loader", "loader"]
    assert "new memory" in loader.plan.why
    assert torch.equal(m.norm, version(3)["l.norm"].to(torch.bfloat16))
