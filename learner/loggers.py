"""Where per-step metrics go besides metrics.jsonl: one class per sink, picked by name (`trainer.logger`).

The names are verl's (`trainer.logger=[console,wandb]`). Every sink gets the scalars of each metrics line
(lists such as `staleness/hist`, strings and group ids stay in metrics.jsonl) under the same keys. A sink's
package is imported only when the sink is asked for, so wandb and mlflow are optional extras; asking for
one that is not installed fails when the config is loaded, naming the key and the install command.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from learner.metric_names import STEP
from runbase.configload import ConfigError, to_dict

log = logging.getLogger("metrics")


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What a sink may need to know about the run."""

    run_dir: str
    """The job's output directory (TensorBoard events in tb/, wandb's local files in wandb/)."""
    run_id: str
    """The job's run id: wandb's run id, so `--resume` continues the same wandb run."""
    project: str
    """trainer.project_name: wandb's project, MLflow's experiment."""
    name: str
    """trainer.experiment_name, or the run id when that is empty: the run's display name."""
    config: dict
    """The resolved config (as config.yaml holds it), recorded with the run by wandb and MLflow."""


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """A nested config as dotted keys (`learner.lr`), the form MLflow's params take."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def scalars(m: dict) -> dict[str, float]:
    """The plottable values of a metrics line: numbers other than the step itself."""
    return {k: float(v) for k, v in m.items() if isinstance(v, (int, float)) and k != STEP}


class ConsoleLogger:
    """verl's console format, `step:N - key:value - ...`, one line per step in the learner's log
    (logs/learner-0.log); the launcher's terminal shows the progress line."""

    def __init__(self, run: RunInfo):
        pass

    def write(self, step: int, values: dict[str, float]) -> None:
        log.info("step:%d - %s", step, " - ".join(f"{k}:{v:.6g}" for k, v in values.items()))

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """TensorBoard event files in <run_dir>/tb (torch's SummaryWriter)."""

    def __init__(self, run: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run.run_dir) / "tb"))

    def write(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A wandb run with the job's id (a resumed job continues it). Its local files go to <run_dir>/wandb;
    with WANDB_MODE=offline that is all it writes (no account needed; `wandb sync` uploads it later)."""

    def __init__(self, run: RunInfo):
        import wandb

        self.run = wandb.init(project=run.project, name=run.name, id=run.run_id, resume="allow",
                              dir=run.run_dir, config=run.config)

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """An MLflow run at MLFLOW_TRACKING_URI, else in <run_dir>/mlflow.db (SQLite: MLflow's file store is in
    maintenance mode and refuses new runs); the resolved config is its params, as dotted keys."""

    def __init__(self, run: RunInfo):
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(f"sqlite:///{Path(run.run_dir).resolve() / 'mlflow.db'}")
        mlflow.set_experiment(run.project)
        mlflow.start_run(run_name=run.name)
        mlflow.log_params(flatten(run.config))  # params, not an artifact: a local run then writes only mlflow.db

    def write(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


@dataclass(frozen=True)
class Sink:
    cls: type
    """The class that writes it."""
    module: str
    """The package it imports (checked before the job starts, imported only by the learner)."""
    install: str
    """How to get that package."""


# The one table of sinks: trainer.logger names its keys.
SINKS = {
    "console": Sink(ConsoleLogger, "logging", "part of Python"),
    "tensorboard": Sink(TensorBoardLogger, "tensorboard", "a base dependency: pip install -e ."),
    "wandb": Sink(WandbLogger, "wandb", "pip install -e '.[wandb]'"),
    "mlflow": Sink(MlflowLogger, "mlflow", "pip install -e '.[mlflow]'"),
}


def check(names: list[str]) -> None:
    """A ConfigError (key `logger`) for an unknown sink or one whose package is not installed."""
    for name in names:
        if name not in SINKS:
            raise ConfigError("logger", f"unknown logger {name!r}; choose from {', '.join(SINKS)}")
        sink = SINKS[name]
        if importlib.util.find_spec(sink.module) is None:
            raise ConfigError("logger", f"{name!r} needs the {sink.module} package, which is not installed: "
                                        f"{sink.install}")


def open_loggers(names: list[str], run: RunInfo) -> list:
    """One open sink per name, in the order given."""
    check(names)
    return [SINKS[name].cls(run) for name in names]


def for_run(cfg, run_dir: str, run_id: str) -> list:
    """The sinks `cfg.trainer.logger` asks for, opened for this run."""

    tc = cfg.trainer
    return open_loggers(tc.logger, RunInfo(run_dir=str(run_dir), run_id=run_id, project=tc.project_name,
                                           name=tc.experiment_name or run_id, config=to_dict(cfg)))


FORWARDED_ENV_PREFIXES = ("WANDB_", "MLFLOW_")  # the sinks' own settings (mode, tracking URI, API key)


def forwarded_env(environ) -> dict[str, str]:
    """The sinks' settings in the launcher's environment, for processes on other nodes (which do not
    inherit it; on one machine they do)."""
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
