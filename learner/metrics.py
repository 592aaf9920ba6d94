"""Per-step metrics: JSON lines (always), TensorBoard (optional), latest line in Redis."""
from __future__ import annotations

import json
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: str, *, tensorboard: bool, redis=None, key: str | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.file = open(self.path, "a", buffering=1)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
        self.redis, self.key = redis, key

    def write(self, m: dict) -> None:
        line = json.dumps(m)
        self.file.write(line + "\n")
        if self.tb is not None:
            for k, v in m.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, m["step"])
        if self.redis is not None:
            self.redis.set(self.key, line)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
