"""Environments by name, as reward functions are by data_source (rewards/scorers.py): the built-in ones,
those added with `register_env`, and a user's own class by its import path `package.module:ClassName`
(importable where the episodes run, as verl's custom_reward_function is).

    make_env("calculator_reverse", CalculatorConfig(max_turns=3))
    make_env("my_project.envs:SearchEnv", runner=runner, index="wiki")
"""
from __future__ import annotations

import importlib

from envs.calculator import CalculatorReverseEnv
from envs.core import Environment
from envs.python_tool import PythonToolEnv

ENVIRONMENTS: dict[str, type[Environment]] = {
    "calculator_reverse": CalculatorReverseEnv,
    "python_tool": PythonToolEnv,
}


def register_env(name: str, cls: type[Environment]) -> None:
    """Add an environment class under `name` (a name without ':', which marks an import path)."""
    if not name or ":" in name:
        raise ValueError(f"an environment's name is non-empty and has no ':' (that marks an import path): {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"register_env({name!r}, ...) needs a subclass of envs.core.Environment, got {cls!r}")
    ENVIRONMENTS[name] = cls


def load_env_class(path: str) -> type[Environment]:
    """The class at `package.module:ClassName`, which must subclass envs.core.Environment."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"environment path {path!r} is not of the form package.module:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"environment {path!r}: cannot import module {module_name!r} ({e})") from e
    cls = getattr(module, attr, None)
    if cls is None:
        found = sorted(k for k, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, Environment) and v is not Environment)
        raise AttributeError(f"environment {path!r}: module {module_name!r} has no {attr!r}; "
                             f"the environments it defines or imports: {found}")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"environment {path!r} is {cls!r}, not a subclass of envs.core.Environment")
    return cls


def get_env_class(name: str) -> type[Environment]:
    """A registered environment's class, or the class at an import path (`package.module:ClassName`)."""
    if ":" in name:
        return load_env_class(name)
    try:
        return ENVIRONMENTS[name]
    except KeyError:
        raise KeyError(f"no environment named {name!r}; registered: {sorted(ENVIRONMENTS)} (or give a class of "
                       f"your own as package.module:ClassName)") from None


def make_env(name: str, *args, **kwargs) -> Environment:
    """A new environment of `name` (registered or an import path), built with the given arguments."""
    return get_env_class(name)(*args, **kwargs)
