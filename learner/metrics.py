"""Per-step metrics: JSON lines (always), the sinks of trainer.logger (learner/loggers.py), latest line in Redis."""
from __future__ import annotations

import json
from pathlib import Path

from learner import metric_names as M
from learner.loggers import scalars


class MetricsWriter:
    def __init__(self, run_dir: str, *, loggers=(), redis=None, key: str | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.file = open(self.path, "a", buffering=1)
        self.loggers = list(loggers)  # open sinks (learner.loggers.open_loggers), each fed every line's scalars
        self.redis, self.key = redis, key

    def write(self, m: dict) -> None:
        line = json.dumps(m)
        self.file.write(line + "\n")
        values = scalars(m)
        for sink in self.loggers:
            sink.write(m[M.STEP], values)
        if self.redis is not None:
            self.redis.set(self.key, line)

    def close(self) -> None:
        self.file.close()
        for sink in self.loggers:
            sink.close()
