"""The live progress line: step, reward, staleness, rates, actors alive, held-out reward."""
from __future__ import annotations

import json
import sys
import time

from learner import metric_names as M

NON_TTY_EVERY_S = 5.0       # without a terminal, print a full line this often instead of redrawing
HEARTBEAT_TIMEOUT_S = 10.0  # an actor silent this long does not count as alive


# the learner's start-up marks (learner/train.py, learner/batches.py) in order, and what it is doing once it has reached each
LEARNER_PHASES = (("first_batch", "training its first step"), ("initial_eval", "waiting for its first batch"),
                  ("ready", "evaluating the initial weights"))


def startup_state(marks: dict[str, float], now: float, actors: int) -> str:
    """Where a starting job is, from its start-up marks (runbase.keys.mark_startup: "role:event" -> unix time):
    seconds since launch, actor engines built, what the learner does; "" before the launcher wrote any."""
    if "launcher:launched" not in marks:
        return ""
    engines = sum(k.startswith("actor-") and k.endswith(":engine") for k in marks)
    learner = next((doing for event, doing in LEARNER_PHASES if f"learner-0:{event}" in marks), "loading")
    evaluator = ", evaluator ready" if "evaluator:engine" in marks else ""
    return (f" {now - marks['launcher:launched']:.0f} s ({engines}/{actors} actor engines built, learner "
            f"{learner}{evaluator})")


class Progress:
    def __init__(self, cfg, r, keys):
        self.cfg, self.r, self.keys = cfg, r, keys
        self.tty = sys.stdout.isatty()
        self.last_print = 0.0
        self.last = ""

    def line(self) -> str:
        raw = self.r.get(self.keys.metrics)
        m = json.loads(raw) if raw else {}
        now = time.time()
        members = [json.loads(v) for v in self.r.hgetall(self.keys.members).values()]
        alive = sum(now - mm["heartbeat"] < HEARTBEAT_TIMEOUT_S for mm in members)
        vals = sorted((int(k), float(v)) for k, v in self.r.hgetall(self.keys.val).items())
        val = f" | val {vals[0][1]:.3f}" if vals else ""
        if len(vals) > 1:
            val += f" -> {vals[-1][1]:.3f} (v{vals[-1][0]})"
        target = int(self.r.get(self.keys.scale_target) or self.cfg.cluster.actors)  # cluster.scale moves it
        if not m:
            marks = {f.decode(): float(t) for f, t in self.r.hgetall(self.keys.startup).items()}
            return f"starting{startup_state(marks, now, target)}: actors alive {alive}/{target}{val}"
        if m.get(M.SKIPPED):  # nothing applied: the same step is tried again on the next batch
            return (f"step {m[M.STEP] + 1}/{self.cfg.trainer.total_steps} skipped ({m[M.SKIP_REASON]}; its groups "
                    f"dead-lettered), trying again | actors {alive}/{target}{val}")
        return (f"step {m[M.STEP] + 1}/{self.cfg.trainer.total_steps} | reward {m[M.REWARD_MEAN]:.3f} | "
                f"staleness {m[M.STALENESS_MEAN]:.2f} (max {m[M.STALENESS_MAX]}, dropped {m[M.DROPPED_STALE]}) | "
                f"{m[M.SAMPLES_PER_S]:.0f} samples/s {m[M.TOKENS_PER_S]:.0f} tok/s | "
                f"actors {alive}/{target}{val}")

    def update(self) -> None:
        text = self.line()
        if self.tty:
            sys.stdout.write("\r\033[K" + text)
            sys.stdout.flush()
        elif text != self.last and time.monotonic() - self.last_print > NON_TTY_EVERY_S:
            print(text, flush=True)
            self.last_print = time.monotonic()
        self.last = text

    def finish(self) -> None:
        text = self.line()
        print(("\r\033[K" if self.tty else "") + text, flush=True)
