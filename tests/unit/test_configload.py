"""Unit tests for runbase.configload (layered YAML -> typed dataclasses)."""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest
import yaml

from runbase.configload import (
    ConfigError,
    deep_merge,
    dump_yaml,
    from_dict,
    load,
    parse_override,
    set_dotted,
    to_dict,
)

pytestmark = pytest.mark.unit


@dataclass(kw_only=True)
class Inner:
    lr: float = 1e-3
    x: int = 1
    y: int = 10
    mode: Literal["sync", "async"] = "async"
    sizes: list[int] = field(default_factory=lambda: [1, 2])
    note: Optional[str] = None

    def __post_init__(self):
        if self.x > self.y:
            raise ConfigError("x", f"must be <= y ({self.y}), got {self.x}")


@dataclass(kw_only=True)
class Leaf:
    depth: int = 0

    def __post_init__(self):
        if self.depth < 0:
            raise ValueError("depth must be non-negative")


@dataclass(kw_only=True)
class Root:
    name: str
    seed: int = 0
    enabled: bool = True
    tags: dict[str, int] = field(default_factory=dict)
    extra: Any = None
    inner: Inner = field(default_factory=Inner)
    leaf: Leaf = field(default_factory=Leaf)


def _write(path, data):
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def default_yaml(tmp_path):
    return _write(tmp_path / "default.yaml", {
        "name": "base", "seed": 1,
        "inner": {"lr": 0.1, "x": 2, "mode": "sync", "sizes": [4]},
    })


# --- merging / overrides ----------------------------------------------------

def test_deep_merge_is_recursive_and_pure():
    base = {"a": {"b": 1, "c": 2}, "d": [1]}
    out = deep_merge(base, {"a": {"c": 3}, "d": [2]})
    assert out == {"a": {"b": 1, "c": 3}, "d": [2]}
    assert base == {"a": {"b": 1, "c": 2}, "d": [1]}
    out["a"]["b"] = 9  # the result shares nothing with its inputs
    assert base["a"]["b"] == 1


def test_parse_override_yaml_values():
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override("a=[1,2]") == ("a", [1, 2])
    assert parse_override("a=abc") == ("a", "abc")
    assert parse_override("a=x=y") == ("a", "x=y")
    assert parse_override("a=") == ("a", None)


@pytest.mark.parametrize("text,expected", [
    ("learner.lr=1e-5", 1e-5), ("a=3e4", 3e4), ("a=1.0e5", 1e5), ("a=-2.5E-3", -2.5e-3),
])
def test_parse_override_scientific_notation_is_float(text, expected):
    key, value = parse_override(text)
    assert type(value) is float and value == expected


def test_parse_override_quoted_number_stays_str():
    assert parse_override("a='1e-5'") == ("a", "1e-5")
    assert parse_override("a=e5") == ("a", "e5")


@pytest.mark.parametrize("text", ["learner.lr", "=3", " =3"])
def test_parse_override_malformed(text):
    with pytest.raises(ConfigError, match="section.key=value") as ei:
        parse_override(text)
    assert ei.value.key == text


def test_set_dotted_creates_sections():
    d = {"a": None}
    set_dotted(d, "a.b.c", 1)
    set_dotted(d, "top", 2)
    assert d == {"a": {"b": {"c": 1}}, "top": 2}
    with pytest.raises(ConfigError, match="'top' is a value"):
        set_dotted(d, "top.x", 3)


# --- load: precedence, aliases, files ---------------------------------------

def test_load_precedence_default_file_overrides(tmp_path, default_yaml):
    user = _write(tmp_path / "user.yaml", {"seed": 2, "inner": {"x": 3, "lr": 0.2}})
    cfg = load(Root, default_yaml, user, ["inner.lr=1e-5", "enabled=false", "inner.note=hi"])
    assert cfg == Root(
        name="base", seed=2, enabled=False,
        inner=Inner(lr=1e-5, x=3, mode="sync", sizes=[4], note="hi"),
    )
    assert isinstance(cfg.inner, Inner) and type(cfg.inner.lr) is float


def test_load_scientific_notation_in_yaml_file(tmp_path):
    p = tmp_path / "d.yaml"
    p.write_text("name: n\ninner:\n  lr: 1e-5\n")
    assert load(Root, p).inner.lr == 1e-5


def test_load_aliases_rewrite_override_keys(default_yaml):
    cfg = load(Root, default_yaml, overrides=["data.train_batch_size=7"],
               aliases={"data.train_batch_size": "inner.y"})
    assert cfg.inner.y == 7


def test_load_missing_file_names_path(tmp_path, default_yaml):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as ei:
        load(Root, default_yaml, missing)
    assert ei.value.key == str(missing)
    assert str(ei.value) == f"config file {missing}: not found" and "config key" not in str(ei.value)
    import pickle  # errors cross process boundaries (Ray): the file label survives the trip

    again = pickle.loads(pickle.dumps(ei.value))
    assert (str(again), again.file) == (str(ei.value), True)


def test_load_non_mapping_yaml(tmp_path, default_yaml):
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping") as ei:
        load(Root, default_yaml, bad)
    assert ei.value.key == str(bad)


def test_a_key_given_twice_and_a_file_that_is_not_utf8_name_the_file(tmp_path, default_yaml):
    """PyYAML keeps the last of two equal keys silently (an edited value above a forgotten one never applied);
    bytes that are not UTF-8 gave a UnicodeDecodeError traceback."""
    dup = tmp_path / "dup.yaml"
    dup.write_text("inner:\n  lr: 1e-5\n  x: 2\n  lr: 2e-5\n")
    with pytest.raises(ConfigError, match="key 'lr' given twice in one mapping at line 4") as ei:
        load(Root, default_yaml, dup)
    assert ei.value.key == str(dup)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"inner:\n  x: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not a UTF-8 text file") as ei:
        load(Root, default_yaml, binary)
    assert ei.value.key == str(binary)


@pytest.mark.parametrize("text", ["inner.lr=.nan", "inner.lr=.inf", "inner.lr=-.inf"])
def test_non_finite_floats_are_refused(default_yaml, text):
    with pytest.raises(ConfigError, match="expected a finite number") as ei:
        load(Root, default_yaml, overrides=[text])
    assert ei.value.key == "inner.lr"


def test_load_bad_override(default_yaml):
    with pytest.raises(ConfigError, match="section.key=value"):
        load(Root, default_yaml, overrides=["inner.lr"])


# --- from_dict: validation ---------------------------------------------------

def test_unknown_key_names_dotted_key_and_valid_keys():
    with pytest.raises(ConfigError) as ei:
        from_dict(Root, {"name": "n", "inner": {"lrr": 1}})
    assert ei.value.key == "inner.lrr"
    assert "'inner.lrr'" in str(ei.value)
    assert "valid keys in 'inner': lr, x, y, mode, sizes, note" in str(ei.value)


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match="valid keys in '<root>'") as ei:
        from_dict(Root, {"name": "n", "bogus": 1})
    assert ei.value.key == "bogus"


def test_required_field():
    with pytest.raises(ConfigError, match="required") as ei:
        from_dict(Root, {})
    assert ei.value.key == "name"


@pytest.mark.parametrize("data,key,expected", [
    ({"inner": {"x": 1.5}}, "inner.x", "expected int, got float 1.5"),
    ({"inner": {"x": True}}, "inner.x", "expected int, got bool"),
    ({"inner": {"lr": "fast"}}, "inner.lr", "expected float, got str"),
    ({"inner": {"lr": False}}, "inner.lr", "expected float, got bool"),
    ({"enabled": 1}, "enabled", "expected bool, got int"),
    ({"name": 5}, "name", "expected str, got int"),
    ({"inner": {"sizes": [1, "a"]}}, "inner.sizes[1]", "expected int, got str"),
    ({"inner": {"sizes": 3}}, "inner.sizes", "expected list[int], got int 3"),
    ({"inner": {"note": 3}}, "inner.note", "expected str, got int"),
    ({"tags": {"a": "b"}}, "tags.a", "expected int, got str"),
    ({"inner": 3}, "inner", "expected a mapping"),
])
def test_wrong_type_names_key_and_expected_type(data, key, expected):
    with pytest.raises(ConfigError) as ei:
        from_dict(Root, {"name": "n", **data})
    assert ei.value.key == key
    assert f"config key '{key}'" in str(ei.value)
    assert expected in str(ei.value)


def test_literal_lists_choices():
    with pytest.raises(ConfigError) as ei:
        from_dict(Root, {"name": "n", "inner": {"mode": "fast"}})
    assert ei.value.key == "inner.mode"
    assert "'sync', 'async'" in str(ei.value)


def test_coercions_and_passthrough():
    cfg = from_dict(Root, {"name": "n", "inner": {"lr": 1, "sizes": (5, 6), "note": None},
                           "extra": {"anything": [1]}, "leaf": None})
    assert type(cfg.inner.lr) is float and cfg.inner.lr == 1.0
    assert cfg.inner.sizes == [5, 6]
    assert cfg.extra == {"anything": [1]}
    assert cfg.leaf == Leaf()


def test_post_init_config_error_is_prefixed():
    with pytest.raises(ConfigError, match="must be <= y") as ei:
        from_dict(Root, {"name": "n", "inner": {"x": 20}})
    assert ei.value.key == "inner.x"
    assert str(ei.value).startswith("config key 'inner.x':")


def test_post_init_value_error_is_wrapped_with_section():
    with pytest.raises(ConfigError, match="non-negative") as ei:
        from_dict(Root, {"name": "n", "leaf": {"depth": -1}})
    assert ei.value.key == "leaf"
    with pytest.raises(ConfigError) as ei:
        from_dict(Leaf, {"depth": -1})
    assert ei.value.key == "<root>"


def test_prefix_argument():
    with pytest.raises(ConfigError) as ei:
        from_dict(Inner, {"x": "a"}, prefix="learner")
    assert ei.value.key == "learner.x"


def test_config_error_pickles():
    e = pickle.loads(pickle.dumps(ConfigError("a.b", "bad")))
    assert (e.key, e.message, str(e)) == ("a.b", "bad", "config key 'a.b': bad")


# --- to_dict / dump_yaml ---------------------------------------------------

def test_to_dict_plain_and_lists():
    d = to_dict(from_dict(Root, {"name": "n", "inner": {"sizes": (3,)}}))
    assert d["inner"]["sizes"] == [3]
    assert d["inner"]["mode"] == "async"
    assert list(d) == ["name", "seed", "enabled", "tags", "extra", "inner", "leaf"]


def test_dump_yaml_round_trip(tmp_path, default_yaml):
    cfg = load(Root, default_yaml, overrides=["inner.lr=1e-5", "tags={a: 1}", "inner.note=z"])
    out = tmp_path / "sub" / "resolved.yaml"
    dump_yaml(cfg, out)
    assert load(Root, out) == cfg
