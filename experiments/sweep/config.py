"""A staleness sweep's config, its settings (one per bound and correction, and the synchronous baseline) and the
names of its runs."""
from __future__ import annotations

from dataclasses import dataclass, field

from learner.config import LearnerConfig

SEED_STRIDE = 1000       # actor i of seed k samples with seed k*SEED_STRIDE + i: streams never overlap
DEFAULT_CORRECTION = LearnerConfig.correction  # its runs are named by bound alone (s=4), the others s=4 tis


@dataclass(kw_only=True)
class SweepConfig:
    """One staleness sweep."""
    max_staleness: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8])
    """Values of buffer.max_staleness to run (async)."""
    corrections: list[str] = field(default_factory=lambda: ["ppo_clip"])
    """learner.correction values; every one is run at every max_staleness."""
    seeds: int = 3
    """Seeds per setting (learner.seed = k, actors.seed = k * SEED_STRIDE)."""
    sync: bool = False
    """Also run the synchronous baseline (experiments.sync) per seed; speed-ups are relative to it."""
    steps: int = 0
    """trainer.total_steps for every run (0 = the config's own)."""
    config: str | None = None
    """YAML merged over configs/default.yaml, for every run."""
    actors: int = 0
    """cluster.actors (0 = the config's own)."""
    learners: int = 0
    """cluster.learners (0 = the config's own)."""
    overrides: list[str] = field(default_factory=list)
    """Dotted overrides passed to every run."""
    out: str = ""
    """Output directory (empty = runs/staleness-<time>)."""
    resume: bool = False
    """Keep the runs in OUT/runs that finished before (their record.json) and run only the rest: a sweep
    longer than one device call goes on over several calls, or machines."""
    budget_s: float = 0.0
    """Start no run that would end past this many seconds of this call (its estimate: the longest run so
    far, else run_seconds plus a start-up allowance); what is left runs with --resume. 0 = no budget."""
    run_seconds: float = 0.0
    """Stop each run this many seconds after its first trained step (SIGINT: every step's metrics line is
    kept), so runs are compared over equal training time; 0 = each runs to trainer.total_steps."""
    report: bool = False
    """Run nothing: write the parquet, plots and summary of every finished run in OUT/runs, whatever call
    and settings ran it (a sweep's bounds and its corrections at one bound, run as separate calls, in one table)."""

    def __post_init__(self):
        from learner.losses import CORRECTIONS  # lazy: imports torch

        if not self.max_staleness and not self.sync:
            raise ValueError("--max-staleness: nothing to run (give values, or --sync)")
        if any(s < 0 for s in self.max_staleness):
            raise ValueError("--max-staleness: values must be >= 0")
        # a value given twice would run the same (setting, seed) twice into one run directory (the second
        # deletes the first) and count it as two seeds in the summary
        for flag, vals in (("--max-staleness", self.max_staleness), ("--corrections", self.corrections)):
            if dup := sorted({v for v in vals if vals.count(v) > 1}, key=str):
                raise ValueError(f"{flag}: {dup} given more than once (each setting runs once per seed; "
                                 "use --seeds for repeats)")
        if bad := [c for c in self.corrections if c not in CORRECTIONS]:
            raise ValueError(f"--corrections: unknown {bad}; choose from {list(CORRECTIONS)}")
        if self.seeds < 1:
            raise ValueError("--seeds: must be >= 1")
        if self.steps and self.steps < 4:
            raise ValueError("--steps: at least 4 (throughput leaves out the first and the last step)")
        if self.actors < 0 or self.learners < 0:
            raise ValueError("--actors, --learners: must be >= 0 (0 = the config's)")
        if self.budget_s < 0 or self.run_seconds < 0:
            raise ValueError("--budget-s, --run-seconds: must be >= 0 (0 = none)")
        if (self.resume or self.report) and not self.out:
            raise ValueError("--resume, --report: give the --out of the sweep")


@dataclass(kw_only=True)
class Setting:
    label: str
    max_staleness: int
    correction: str
    mode: str  # async | sync


def settings(cfg: SweepConfig) -> list[Setting]:
    # one name per (bound, correction), however many corrections a call asks for: --resume finds a run by
    # its name, so `--corrections decoupled` alone must not be named like (and kept for) the default's run
    out = [Setting(label=f"s={s}" + (f" {c}" if c != DEFAULT_CORRECTION else ""), max_staleness=s, correction=c,
                   mode="async") for c in cfg.corrections for s in cfg.max_staleness]
    if cfg.sync:  # on-policy: every correction is the same gradient there (tests/unit/test_corrections.py)
        out.insert(0, Setting(label="sync", max_staleness=0, correction=cfg.corrections[0], mode="sync"))
    return out


def run_name(st: Setting, seed: int) -> str:
    return st.label.replace("=", "").replace(" ", "-") + f"-seed{seed}"


def fmt_s(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"
