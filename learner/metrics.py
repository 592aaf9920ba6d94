"""Per-step metrics: JSON lines (always), the sinks of trainer.logger (learner/loggers.py), latest line in Redis."""
from __future__ import annotations

import json
import time
from pathlib import Path

from buffer.staleness import histogram
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


def model_token_frac(rows) -> float:
    """Loss tokens over response tokens of the batch; 1.0 without any response token (nothing of the environment)."""
    total = sum(len(r.response_ids) for r in rows)
    return sum(r.loss_tokens for r in rows) / total if total else 1.0


def step_metrics(step: int, version: int, rows, groups, *, hist_bound: int, dropped_stale: int, wait_s: float,
                 wall_s: float, loss_norm: str) -> dict:
    """A step's metrics line, the part every trainer writes alike (the learner and the synchronous baseline,
    experiments/sync.py): rewards, staleness and its histogram (0..hist_bound), throughput over `wall_s`,
    response lengths (every token, the environment's too) and the model's share of them, the version span of
    the trained groups."""
    st = [r.staleness for r in rows]
    return {M.STEP: step, M.VERSION: version, M.REWARD_MEAN: sum(r.reward for r in rows) / len(rows),
            M.STALENESS_MEAN: sum(st) / len(st), M.STALENESS_MAX: max(st), M.STALENESS_HIST: histogram(st, hist_bound),
            M.DROPPED_STALE: dropped_stale, M.SAMPLES: len(rows), M.SAMPLES_PER_S: len(rows) / wall_s,
            M.TOKENS_PER_S: sum(r.num_tokens for r in rows) / wall_s, M.WAIT_S: wait_s,
            M.RESPONSE_LEN_MEAN: sum(len(r.response_ids) for r in rows) / len(rows),
            M.RESPONSE_LEN_MAX: max(len(r.response_ids) for r in rows),
            M.MODEL_TOKEN_FRAC: model_token_frac(rows),
            M.VERSION_START_MIN: min(g.version_start for g in groups),
            M.VERSION_END_MAX: max(g.version_end for g in groups),
            M.MIXED_VERSION_GROUPS: sum(g.version_start != g.version_end for g in groups),
            M.GROUPS_TRAINED: [g.group_id for g in groups], M.LOSS_NORM: loss_norm, M.TIME: time.time()}
