"""Replay of a model's own weight loader as a list of tensor copies.

vLLM's `model.load_weights` walks the checkpoint names in Python for every version (stacked q/k/v and
gate/up parameters, per-parameter weight loaders): 32 ms per version for SmolLM2-135M on the H200, on the
engine's own thread, at every weight update of an RL run. What it does to the parameters is, for the
models we serve, a fixed set of copies from (views of) the named input tensors into (views of) the
parameters. `CopyPlan.record` runs the loader once under a torch function mode that notes every
`Tensor.copy_` whose source is a view of an input tensor; `replay` makes the same copies from the next
version's tensors of the same names and shapes.

A plan is only as good as what was recorded: a loader may also write in other ways (an in-place op or a
setitem with an input, a tensor built by `torch.cat` and then copied, a parameter moved to new memory).
Anything of the kind seen while recording makes the plan unusable at once; and a plan is trusted only
after one check (`PlannedLoader`): replay a new version, fingerprint the parameters, run the real loader
on the same version, check every recorded destination is still a parameter's memory and the fingerprints
are equal. A copy the recording missed shows there as long as its target changed between the two
versions, as every trained weight does.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from weightsync.flat import checksum


class _Recorder(TorchFunctionMode):
    def __init__(self, plan: "CopyPlan", inputs: dict[str, torch.Tensor]):
        super().__init__()
        self.plan = plan
        # storage pointer -> [(name, tensor)]: inputs may be views of one flat buffer
        self.by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, t in inputs.items():
            if t.numel():
                self.by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((name, t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.plan.usable:
            if func is torch.Tensor.copy_:
                self._note(args[0], args[1] if len(args) > 1 else kwargs.get("src"))
            elif _writes_in_place(func) and any(self._source(a) is not None for a in _tensors(args, kwargs)):
                # an input written into something another way (setitem, index_copy_, ...): not replayable
                self.plan.drop(f"{getattr(func, '__name__', func)} on an input: a write other than copy_")
        return func(*args, **kwargs)

    def _note(self, dst, src) -> None:
        if not isinstance(src, torch.Tensor) or not src.numel():
            return
        hit = self._source(src)
        if hit is None:  # a copy from something computed, not read from an input: cannot replay it
            self.plan.drop(f"a copy into {tuple(dst.shape)} from a tensor that is no view of an input")
            return
        name, rel = hit
        self.plan.copies.append((dst.detach(), name, rel, tuple(src.shape), tuple(src.stride())))

    def _source(self, src):
        """(input name, storage offset of `src` relative to that input) if `src` lies inside one input."""
        if not isinstance(src, torch.Tensor) or not src.numel():
            return None
        lo = src.storage_offset()
        hi = lo + max((s - 1) * st for s, st in zip(src.shape, src.stride())) + 1 if src.dim() else lo + 1
        for name, t in self.by_storage.get(src.untyped_storage().data_ptr(), []):
            if src.dtype == t.dtype and t.storage_offset() <= lo and hi <= t.storage_offset() + t.numel():
                return name, lo - t.storage_offset()
        return None


def _writes_in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


class CopyPlan:
    """The copies one call of a weight loader made; replayable on tensors of the same names and layout."""

    def __init__(self):
        self.copies: list[tuple[torch.Tensor, str, int, tuple, tuple]] = []
        self.shapes: dict[str, tuple] = {}
        self.usable = True
        self.verified = False
        self.why = ""

    @classmethod
    def record(cls, load, named: dict[str, torch.Tensor]) -> "CopyPlan":
        """Run `load()` (which reads `named`) and note its copies."""
        plan = cls()
        plan.shapes = {k: (tuple(v.shape), v.dtype) for k, v in named.items()}
        with _Recorder(plan, named):
            load()
        if not plan.copies and plan.usable:
            plan.drop("the loader made no copy from the inputs")
        return plan

    def drop(self, why: str) -> None:
        """Never replay this plan (and let go of the parameter views it holds)."""
        self.usable, self.why, self.copies = False, why, []

    def fits(self, named: dict[str, torch.Tensor]) -> bool:
        return self.usable and {k: (tuple(v.shape), v.dtype) for k, v in named.items()} == self.shapes

    def replay(self, named: dict[str, torch.Tensor]) -> None:
        for dst, name, rel, shape, stride in self.copies:
            t = named[name]
            dst.copy_(t.as_strided(shape, stride, t.storage_offset() + rel), non_blocking=True)


class PlannedLoader:
    """A weight loader that records itself on the first call, checks the replay once, then replays.

    `load(named)` runs the real loader; `params()` returns the parameters it writes (for the check).
    Each call returns how it loaded: `recorded`, `verified` (replayed, then the loader ran and left the
    parameters bit-identical), `replayed`, or `loader` (no usable plan: the loader as always)."""

    def __init__(self, load, params):
        self.load, self.params = load, params
        self.plan: CopyPlan | None = None

    def __call__(self, named: dict[str, torch.Tensor]) -> str:
        if self.plan is None:
            try:
                self.plan = CopyPlan.record(lambda: self.load(named), named)
            except Exception as e:  # noqa: BLE001 - the loader under a torch function mode: never trusted
                self.plan = CopyPlan()
                self.plan.drop(f"recording failed: {type(e).__name__}: {e}")
                self.load(named)  # the loader alone, whole (a genuine loading error raises here)
            return "recorded"
        if not self.plan.fits(named):
            self.load(named)
            return "loader"
        self.plan.replay(named)
        if self.plan.verified:
            return "replayed"
        replayed = checksum(self.params())
        self.load(named)
        live = {p.untyped_storage().data_ptr() for p in self.params().values()}
        if any(dst.untyped_storage().data_ptr() not in live for dst, *_ in self.plan.copies):
            self.plan.drop("the loader moved a parameter to new memory: the recorded copies write the old one")
        elif checksum(self.params()) != replayed:
            self.plan.drop("its replay left other parameters than the loader")
        else:
            self.plan.verified = True
            return "verified"
        return "loader"
