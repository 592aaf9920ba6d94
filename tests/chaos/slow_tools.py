"""An environment for the chaos tier, loaded by jobs through its import path (`slow_tools:SlowReverseEnv`, with
this folder on PYTHONPATH): the tool-using toy (envs/calculator.py) whose tools take SLOW_TOOL_S, so that an
actor killed at any moment has episodes between two turns."""
from __future__ import annotations

import time

from envs.calculator import TOOLS, CalculatorReverseEnv

SLOW_TOOL_S = 0.3   # longer than a tiny-model turn (a few ms): most of an episode's life is its tool call


def _slow(fn):
    def call(argument: str) -> str:
        time.sleep(SLOW_TOOL_S)
        return fn(argument)
    return call


class SlowReverseEnv(CalculatorReverseEnv):
    def __init__(self, config=None, runner=None):
        super().__init__(config, runner, tools={name: _slow(fn) for name, fn in TOOLS.items()})
