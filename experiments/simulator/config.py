"""One simulated system (SimConfig) and what a simulation of it returns (SimResult)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

WARMUP_STEPS = 1   # like the measured throughput (experiments.sweep.analysis.run_throughput): step 0 is start-up


@dataclass(kw_only=True)
class SimConfig:
    """One simulated system. Times are seconds of one process running alone on its core/GPU."""
    actors: int = 2
    """Rollout actor processes."""
    learners: int = 1
    """Learner ranks (data parallel: a step's samples are split equally)."""
    mode: str = "async"
    """`async` (admission with max_staleness) or `sync` (generation and training alternate: s = 0)."""
    max_staleness: int = 2
    """s of the admission rule and the hard filter (ignored in sync mode: 0)."""
    groups_per_step: int = 8
    """Prompt groups per learner step (G)."""
    n: int = 8
    """Samples per group."""
    groups_per_batch: int = 4
    """Groups an actor leases and generates in one engine call."""
    steps: int = 200
    """Learner steps to simulate."""
    gen_batch_s: float = 0.01
    """Per generate call: prefill, scoring pass, Python overhead (stream: per lease of groups_per_batch groups, as
    lockstep measures it; a smaller lease pays its share, the prefill growing with the prompts it holds)."""
    gen_step_s: float = 0.002
    """Per decode step of a batch (all its rows advance together)."""
    gen_step_row_s: float = 0.0
    """Extra per decode step per row (a bigger batch decodes a little slower per step)."""
    gen_step_seq_s: float = 0.0
    """stream: extra per engine step per leased sequence in flight (every sample of a group until the whole
    group ends, as the actor's heartbeat counts them): on a GPU shared with the learner the engine's step grows
    about linearly with them (engine_step_s)."""
    gen_step_curve: tuple = ()
    """stream: the engine step as a curve in the leased sequences in flight, ((leased, seconds), ...) knots with
    leased increasing (engine_curve); when given it replaces gen_step_s + gen_step_seq_s x leased: piecewise linear
    through the knots, continued by the end segments' lines (step_curve_s)."""
    len_mean: float = 5.0
    """Mean response length (tokens)."""
    len_sigma: float = 0.0
    """Log-normal sigma of response lengths (0 = all equal; ~1 = the long tail of reasoning RL)."""
    len_group_share: float = 0.0
    """Share of the log-length variance common to a group's samples (its prompt's difficulty): 0 = independent
    samples; more makes a group's longest sample closer to its mean, so its slots idle less while it ends."""
    len_schedule: tuple = ()
    """Lengths as the policy changes them (long and long-tailed first, then shorter): (len_mean, len_sigma) of
    the groups trained at steps [w x len_window, (w + 1) x len_window) for entry w (groups are trained in about
    the order they are admitted), the last entry for every later one; empty: len_mean and len_sigma throughout."""
    len_window: int = 10
    """Learner steps per len_schedule entry."""
    max_tokens: int = 8
    """Length cap; a batch decodes until its longest sample ends."""
    actor_batch_overhead_s: float = 0.0
    """CPU per batch on the actor beyond generation (tokenize, encode, send)."""
    system_batch_s: float = 0.0
    """CPU per batch in the ingest and Redis (one process, batches queue): the group becomes visible to
    the learner when it is done, and the actor that sent it (its send waits for the ack) goes on."""
    train_step_s: float = 0.0
    """CPU per learner rank per step independent of the batch size (optimizer step, sampler, metrics)."""
    train_sample_s: float = 0.0005
    """Learner CPU per sample (forward + backward), divided over ranks."""
    learner_comm_s: float = 0.0
    """Extra CPU per rank per step with more than one rank (gradient all-reduce, scatter)."""
    learner_latency_s: float = 0.0
    """Wall time per learner step that is not CPU work (Redis round trips, waits inside collectives):
    it takes no core."""
    publish_s: float = 0.005
    """Publishing a version (gather + broadcast) on rank 0; the next step starts after it."""
    load_s: float = 0.0
    """An actor swapping in a new version (between two batches), CPU."""
    background_cores: float = 0.0
    """Cores taken by the rest of the job all the time (launcher, Ray's daemons)."""
    cores: float = math.inf
    """CPU cores shared by all processes (processor sharing); inf = one device per process."""
    seed: int = 0
    """Seed of the sampled lengths."""
    actor_mode: str = "batch"
    """`batch`: one engine call per leased batch, lasting as long as its longest sample (the HF engine);
    `stream`: the vLLM actor (actors/rollout.py): up to `inflight_seqs` sequences in flight, all advancing
    one token per engine step (gen_step_s + gen_step_row_s x rows in flight, gen_batch_s more on a step that
    prefills new prompts); groups leased whenever there is room and sent the moment their last sample ends
    (the sender is off the loop: the actor does not wait for the ingest, and system_batch_s is per group);
    new weights swapped in between two engine steps while sequences are in flight."""
    inflight_seqs: int = 0
    """stream: sequences an actor keeps in flight (0 = groups_per_batch x n)."""
    inflight_count: str = "leased"
    """stream: what inflight_seqs counts (actors.inflight_count): `leased`, every sample of a group until the
    group is sent; `running`, the samples still decoding (the engine's rows)."""
    admission: str = "actor"
    """buffer.admission: the admission cap counts from the older of the learner's version and the leasing
    actor's weights (`actor`), or from the learner's version alone (`learner`, AReaL's rule)."""
    weights_lag_s: float = 0.0
    """Seconds from a version becoming visible to admission until actors hold its weights (the learner
    publishes with overlap: its version moves before the transfer ends; ~0.1 s on the H200)."""
    learner_contention: float = 0.0
    """One GPU shared: a learner step that starts while actors generate takes this fraction longer."""
    actor_contention: float = 0.0
    """One GPU shared: an engine step that starts while the learner trains takes this fraction longer (the GPU
    calibration leaves it 0: its engine line, fitted to steps taken beside a training learner, carries that)."""
    delivery_s: float = 0.0
    """stream: seconds from a group's last token until the learner can read it that take no engine step and
    no core (the send and the ingest's ack, the buffer write, the learner's poll): latency only."""
    abort_stale: bool = True
    """stream: groups in flight that started more than s versions before the actor's weights are aborted
    at its next turn and counted as drops, freeing their rows and admission slots (actors.abort_stale)."""

    def __post_init__(self):
        if self.actors < 1 or self.learners < 1:
            raise ValueError("actors and learners must be >= 1")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be async or sync, not {self.mode!r}")
        if self.max_staleness < 0 or self.groups_per_step < 1 or self.groups_per_batch < 1 or self.n < 1:
            raise ValueError("max_staleness >= 0, groups_per_step, groups_per_batch, n >= 1")
        if self.steps < WARMUP_STEPS + 2:
            raise ValueError(f"steps must be >= {WARMUP_STEPS + 2}")
        if not self.cores > 0:
            raise ValueError("cores must be > 0")
        if not 0 <= self.background_cores < self.cores:
            raise ValueError("background_cores must be >= 0 and leave some of the cores")
        if self.actor_mode not in ("batch", "stream"):
            raise ValueError(f"actor_mode must be batch or stream, not {self.actor_mode!r}")
        if self.inflight_count not in ("leased", "running"):
            raise ValueError(f"inflight_count must be leased or running, not {self.inflight_count!r}")
        if self.admission not in ("actor", "learner"):
            raise ValueError(f"admission must be actor or learner, not {self.admission!r}")
        if min(self.weights_lag_s, self.learner_contention, self.actor_contention, self.gen_step_seq_s) < 0:
            raise ValueError("weights_lag_s, learner_contention, actor_contention and gen_step_seq_s must be >= 0")
        if self.delivery_s < 0 or (self.delivery_s and self.actor_mode != "stream"):
            raise ValueError("delivery_s must be >= 0, and is a streaming actor's (actor_mode=stream)")
        if not 0 <= self.len_group_share < 1:
            raise ValueError("len_group_share must be in [0, 1)")
        if self.len_window < 1 or any(m <= 0 or sg < 0 for m, sg in self.len_schedule):
            raise ValueError("len_window must be >= 1 and every len_schedule entry (mean > 0, sigma >= 0)")
        xs = [x for x, _y in self.gen_step_curve]
        if any(b <= a for a, b in zip(xs, xs[1:])) or any(y < 0 for _x, y in self.gen_step_curve):
            raise ValueError("gen_step_curve: knots (leased, seconds) with leased increasing and seconds >= 0")
        if self.inflight_seqs < 0 or (self.inflight_seqs and self.inflight_seqs < self.n):
            raise ValueError(f"inflight_seqs must be 0 (groups_per_batch x n) or >= n ({self.n}): one group")

    @property
    def inflight_target(self) -> int:
        return self.inflight_seqs or self.groups_per_batch * self.n

    @property
    def s(self) -> int:
        return 0 if self.mode == "sync" else self.max_staleness


@dataclass
class SimResult:
    samples_per_s: float
    staleness_hist: list[int]
    learner_idle: float
    """Fraction of time the learner ranks wait for data (GPU idle on the learner side)."""
    actor_idle: float
    """Fraction of actor time not generating (waiting for admission or weights)."""
    dropped_frac: float
    """Groups dropped as stale (on arrival, or aborted in flight) over groups trained plus dropped."""
    aborted: int
    """Of those, groups aborted in flight (actor_mode=stream with abort_stale)."""
    step_end_times: list[float] = field(repr=False)
    config: dict = field(repr=False, default_factory=dict)
    engine_step_ms: float = math.nan
    """stream: the engines' mean step in milliseconds (as the actors' heartbeat reports it)."""
    leased_inflight: float = math.nan
    """stream: leased sequences in flight at an engine step, on average (the heartbeat's leased_inflight)."""
    running: float = math.nan
    """stream: of those, samples still decoding (the rows the step computes; the heartbeat's running)."""
    trained_share: float = math.nan
    """stream: tokens of the trained groups over the rows the engines stepped (every generated token): what
    aborts and stale drops did not waste."""

    def staleness_fractions(self) -> list[float]:
        t = sum(self.staleness_hist) or 1
        return [c / t for c in self.staleness_hist]
