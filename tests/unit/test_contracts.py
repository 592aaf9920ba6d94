"""The abstract bases at process boundaries declare what is used through them: every attribute a base's own
methods read from `self`, and every attribute the learner uses on its trajectory source and its weight
publisher, is declared on the base (a method, or a class-level annotation with a docstring saying what it holds),
so an implementation sees the whole contract in one place."""
from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from buffer.core import TrajectorySource
from weightsync.core import WeightPublisher

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
BASES = [TrajectorySource, WeightPublisher]


def used_on(tree: ast.AST, owner: str) -> set[str]:
    """The attribute names read or written as `<owner>.name`, where the owner is `self` or any expression
    ending in the name `owner` (`self.sampler`, `trainer.sampler`, `sampler`)."""
    def is_owner(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == owner) or (isinstance(node, ast.Attribute)
                                                                     and node.attr == owner)
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_owner(node.value)}


def declared(cls) -> set[str]:
    """What a class and its bases define or annotate at class level."""
    return {name for klass in cls.__mro__ for name in (*vars(klass), *inspect.get_annotations(klass))}


def annotations_without_docstring(cls) -> list[str]:
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return [ast.unparse(node.target) for node, after in zip(body, body[1:] + [None])
            if isinstance(node, ast.AnnAssign) and not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                                                        and isinstance(after.value.value, str))]


@pytest.mark.parametrize("cls", BASES, ids=lambda c: c.__name__)
def test_a_base_declares_every_attribute_its_methods_use(cls):
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    missing = sorted(used_on(tree, "self") - declared(cls))
    assert not missing, f"{cls.__name__}'s methods use undeclared attributes: {missing}"
    assert not annotations_without_docstring(cls), f"annotations without a docstring in {cls.__name__}"


@pytest.mark.parametrize("owner,cls", [("sampler", TrajectorySource), ("publisher", WeightPublisher)])
def test_the_learner_uses_only_what_the_bases_declare(owner, cls):
    used = set().union(*(used_on(ast.parse(p.read_text()), owner) for p in sorted((ROOT / "learner").rglob("*.py"))))
    assert used, f"learner/ no longer uses a `{owner}`: point this test at what it calls its {cls.__name__}"
    missing = sorted(used - declared(cls))
    assert not missing, f"the learner uses {owner}.{missing}, which {cls.__name__} does not declare"


def test_the_check_sees_an_undeclared_attribute():
    class Source(TrajectorySource):
        def next_batch(self, learner_version):
            return self.queue.pop()

    tree = ast.parse(textwrap.dedent(inspect.getsource(Source)))
    assert used_on(tree, "self") - declared(Source) == {"queue"}
