"""Load layered YAML configuration into nested, type-checked dataclasses.

Precedence, lowest to highest: the packaged default YAML, an optional user
config file, then ``section.key=value`` overrides from the command line.
Every error is a :class:`ConfigError` naming the full dotted key, so a typo
deep in a config is reported as e.g. ``config key 'learner.lrr': unknown key``
rather than a bare ``TypeError`` from a dataclass constructor.

Only the stdlib and PyYAML are used so that every process (launcher, actors,
learner) can import this without pulling in heavy dependencies.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ConfigError", "deep_merge", "parse_override", "set_dotted",
           "from_dict", "load", "to_dict", "dump_yaml", "local_path"]

ROOT = "<root>"


class ConfigError(ValueError):
    """A bad configuration; `key` is the dotted key at fault (e.g. 'learner.lr'), or with `file` the
    configuration file at fault (missing, unreadable, not YAML)."""

    def __init__(self, key: str, message: str, *, file: bool = False):
        super().__init__(f"config file {key}: {message}" if file else f"config key '{key}': {message}")
        self.key = key
        self.message = message
        self.file = file

    def __reduce__(self):
        # Default exception pickling replays args=(formatted str,), which does
        # not fit our two-argument __init__; errors must survive Ray/mp hops.
        return _config_error, (self.key, self.message, self.file)


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` / ``3e4`` as floats.

    YAML 1.1 requires a dot and a signed exponent, so PyYAML reads ``1e-5``
    as a *string* -- a classic silent learning-rate bug. Quoted scalars are
    never resolved implicitly, so ``'1e-5'`` still stays a string.

    A key given twice in one mapping is an error (PyYAML keeps the last one silently: an edited
    value above a forgotten one would never apply).
    """

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def local_path(path: str) -> str:
    """A path-valued setting as every process must read it: `~` expanded and, when relative, made absolute
    against the launcher's working directory, once, at config load. Ray runs the job's processes in another
    directory (on a cluster joined with cluster.address: wherever `ray start` ran), where a relative path names
    another file or none (seen: `data.train_files=[./train.parquet]` passed the launcher's check, then the
    learner failed with "./train.parquet: file not found" after every process had started). Empty stays empty."""
    return os.path.abspath(os.path.expanduser(path)) if path else path


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - SafeLoader subclass


def _join(prefix: str, name: str) -> str:
    prefix = prefix.rstrip(".")
    return f"{prefix}.{name}" if prefix else name


def deep_merge(base: dict, over: dict) -> dict:
    """Return a new dict: nested dicts merged recursively, other values replaced."""
    # Deep copies so that later set_dotted() calls never write into the inputs.
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(out.get(k), dict) and isinstance(v, dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_override(text: str) -> tuple[str, object]:
    """``"learner.lr=1e-5"`` -> ``("learner.lr", 1e-05)``; value parsed as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:  # key is the whole text: the user sees what they typed
        raise ConfigError(text, "overrides look like section.key=value")
    try:
        return key, _yaml_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(key, f"value {raw!r} is not valid YAML ({_yaml_problem(e)})") from e


def _yaml_problem(e: yaml.YAMLError) -> str:
    """The parser's complaint and where, on one line (its message spans several, with a caret)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or e}{where}"


def set_dotted(data: dict, key: str, value: Any) -> None:
    """Set ``data["a"]["b"]["c"] = value`` for key ``a.b.c``, creating sections."""
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:  # `section:` with no body parses as None
            child = node[part] = {}
        elif not isinstance(child, dict):
            where = ".".join(parents[: i + 1])
            raise ConfigError(key, f"'{where}' is a value, not a section")
        node = child
    node[leaf] = value


def _tname(tp: Any) -> str:
    # Plain classes read best as `int`; generics need their args (`list[int]`).
    if typing.get_origin(tp) is None and hasattr(tp, "__name__"):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _bad(key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(key, f"expected {expected}, got {type(value).__name__} {value!r}")


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Check `value` against annotation `tp`, coercing only int -> float."""
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[T]: let T give the precise message
            return _convert(options[0], value, key)
        for opt in options:
            try:
                return _convert(opt, value, key)
            except ConfigError:
                pass
        raise _bad(key, " | ".join(_tname(a) for a in args), value)
    if origin is typing.Literal:
        # `type(...) is` stops True from matching Literal[1] (True == 1).
        if any(value == a and type(value) is type(a) for a in args):
            return value
        choices = ", ".join(repr(a) for a in args)
        raise ConfigError(key, f"expected one of {choices}, got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _bad(key, _tname(tp), value)
        elem = args[0] if args else Any
        out = [_convert(elem, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _bad(key, _tname(tp), value)
        vt = args[1] if args else Any
        return {str(k): _convert(vt, v, _join(key, str(k))) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    # bool is an int subclass, so a stray `true` would otherwise pass as 1.
    if tp is bool or tp is int:
        if type(value) is not tp:
            raise _bad(key, tp.__name__, value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(key, "float", value)
        if not math.isfinite(value):  # YAML's .nan/.inf pass `x < 0` checks and fail deep inside a process
            raise ConfigError(key, f"expected a finite number, got {value!r}")
        return float(value)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise _bad(key, tp.__name__, value)
    return value


def from_dict(cls: type, data: Mapping | None, prefix: str = "") -> Any:
    """Build dataclass `cls` from `data`; `prefix` is this section's dotted path."""
    prefix = prefix.rstrip(".")
    section = prefix or ROOT
    data = {} if data is None else data  # an empty section means all defaults
    if not isinstance(data, Mapping):
        raise ConfigError(section, f"expected a mapping, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for k in data:
        if k not in fields:
            raise ConfigError(_join(prefix, str(k)),
                              f"unknown key; valid keys in '{section}': {', '.join(fields)}")
    # get_type_hints resolves string annotations from `from __future__ import annotations`.
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in data:
            kwargs[name] = _convert(hints.get(name, Any), data[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(key, "required")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # __post_init__ only knows its own field names; add where it lives.
        raise ConfigError(_join(prefix, e.key), e.message) from e
    except ValueError as e:
        raise ConfigError(section, str(e)) from e


def _config_error(key: str, message: str, file: bool) -> ConfigError:
    return ConfigError(key, message, file=file)


def _read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(str(p), "not found", file=True)
    try:
        data = _yaml_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(str(p), f"not valid YAML: {_yaml_problem(e)}", file=True) from e
    except UnicodeDecodeError as e:
        raise ConfigError(str(p), f"not a UTF-8 text file (byte {e.start}: {e.reason})", file=True) from e
    except OSError as e:
        raise ConfigError(str(p), f"cannot be read: {e.strerror or e}", file=True) from e
    data = {} if data is None else data  # an empty file is an empty mapping
    if not isinstance(data, dict):
        raise ConfigError(str(p), f"top level must be a mapping, got {type(data).__name__}", file=True)
    return data


def load(cls: type, default_path: str | Path, config_file: str | Path | None = None,
         overrides: Iterable[str] = (), aliases: dict[str, str] | None = None) -> Any:
    """default YAML <- config_file YAML <- ``key=value`` overrides, then from_dict."""
    merged = _read_yaml(default_path)
    if config_file is not None:
        merged = deep_merge(merged, _read_yaml(config_file))
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(merged, (aliases or {}).get(key, key), value)
    return from_dict(cls, merged)


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain nested dict/list/scalars (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # init=False fields are derived; emitting them would break reloading.
        return {f.name: to_dict(getattr(obj, f.name))
                for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def dump_yaml(obj: Any, path: str | Path) -> None:
    """Write to_dict(obj) as YAML in field order, loadable again by load()."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=False))
