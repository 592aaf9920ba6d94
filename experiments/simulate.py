"""python -m experiments.simulate --actors 8 64 1024 --learners 8 [--max-staleness 0 1 2 4] [--cores inf]
                                [--sync-run D --s0-run D ...] [--set FIELD=VALUE ...] [--out DIR]
python -m experiments.simulate --sync-run D --s0-run D [D] --validate RUN ...   (predicted vs measured)
python -m experiments.simulate --validate-loo RUN ...   (GPU: each run predicted from the runs at other bounds)

A discrete-event simulator of this system: rollout actors lease prompt groups under the admission
rule of `buffer/store.py` (LEASE_LUA), generate batches whose duration follows their longest
sample (long-tailed lengths), and send them through the ingest (one process, batches queue) to a
FIFO buffer; the learner waits for `groups_per_step` admissible groups (the hard staleness filter
drops the rest and frees their admission slots, as `buffer/sampler.py` does), trains, publishes
version k+1, and actors swap weights between batches. It predicts throughput, idle fractions of
actors and learners (GPU idle time at scale), and the staleness distribution, for `sync`
(generation and training alternate: s = 0, which tests/integration/test_experiments.py shows is
the synchronous schedule) and `async`. Actors are batch actors (the HF engine: one call per leased
batch) or, with `actor_mode=stream`, the streaming vLLM actor: sequences kept in flight and advanced one
token per engine step, groups leased when there is room (a group's samples hold their slots until its last
one ends, as engine.in_flight() counts them) and sent as each ends, weights swapped between engine steps (no
batch barrier). An engine step is a line in the leased sequences in flight (`gen_step_seq_s`), or a monotone
piecewise-linear curve through measured points (`gen_step_curve`): on a GPU shared with the learner a full
engine (512) steps ~7x slower than a lockstep one (~50).

CPU runs share few cores among every process, so the simulator runs processor sharing: with
`cores = C` and a constant background load B, P busy processes each progress at min(1, (C-B)/P);
the learner's latency (waits that are not CPU work) takes no core. On GPUs each process has its
own device: `cores = inf`.

Inputs come from measured runs (`calibrate`): generation cost per batch and per decode step, and
learner cost per sample, from a synchronous run (`experiments.sync` logs them per step); every
other cost from the CPU time each process of an s = 0 run of `cluster.start` spent per step
(`RUN/cpu.jsonl`, written by the launcher: cluster/cpu.py).
"""
from __future__ import annotations

import argparse
import bisect
import functools
import heapq
import json
import math
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from buffer.staleness import admissible, admission_cap, lease_version
from cluster import cpu as cpu_log
from cluster.status import engine_steps
from experiments.sweep.analysis import run_throughput, trained_share
from learner import metric_names as M

WARMUP_STEPS = 1   # like the measured throughput (experiments.sweep.analysis.run_throughput): step 0 is start-up
LEN_WINDOW = 10    # steps per entry of a measured run's length schedule: lengths move over tens of steps
# Async tails searched from as light as the lossless runs' (1) to three times their excess over the mean; a
# bisection of TAIL_FIT_ITERS halvings finds the factor to ~0.03, which moves a prediction by ~1%.
TAIL_FACTOR_RANGE = (1.0, 3.0)
TAIL_FIT_ITERS = 6


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


def lease_rule(version: int, s: int, G: int, actor_version: int, started: int, dropped: int, want: int,
               admission: str = "actor") -> int:
    """LEASE_LUA of buffer/store.py as a pure function: -1 if the actor's weights are too old,
    else how many groups it may start now."""
    if not admissible(version, actor_version, s):
        return -1
    base = lease_version(version, actor_version, admission)
    return max(0, min(want, admission_cap(base, s, G, dropped) - started))


def engine_step_s(c: SimConfig, rows: int, leased: int) -> float:
    """A streaming engine's decode step: fixed, plus per sample still decoding (`rows`), plus per leased
    sequence in flight (`leased`: a group's samples count until its last one ends, as the heartbeat's do); with
    gen_step_curve, that curve at `leased` replaces the fixed and per-leased parts."""
    if c.gen_step_curve:
        return step_curve_s(c.gen_step_curve, leased) + c.gen_step_row_s * rows
    return c.gen_step_s + c.gen_step_row_s * rows + c.gen_step_seq_s * leased


def step_curve_s(knots, leased: float) -> float:
    """The piecewise-linear curve through `knots` ((x, y), x increasing) at `leased`: np.interp between the first
    and last knot, the line of the end segment beyond them (one knot: flat); never below 0 (no step is free)."""
    if len(knots) == 1:
        return knots[0][1]
    i = min(max(bisect.bisect_right(knots, leased, key=lambda k: k[0]) - 1, 0), len(knots) - 2)
    (x0, y0), (x1, y1) = knots[i], knots[i + 1]
    return max(0.0, y0 + (y1 - y0) * (leased - x0) / (x1 - x0))


def response_lengths(rng: random.Random, k: int, mean: float, sigma: float, cap: int, share: float = 0.0) -> list[int]:
    """k log-normal lengths with the given mean (before the cap), clipped to 1..cap; `share` of the log-variance is
    one draw common to all k (call it once per group: its prompt's difficulty)."""
    if sigma <= 0:
        return [max(1, min(cap, round(mean)))] * k
    mu = math.log(mean) - sigma * sigma / 2
    if share > 0:
        mu += rng.gauss(0.0, sigma * math.sqrt(share))
        sigma *= math.sqrt(1 - share)
    return [max(1, min(cap, round(rng.lognormvariate(mu, sigma)))) for _ in range(k)]


class _Sim:
    """Event loop over processor-shared jobs, with a virtual clock: every running job advances at
    the same rate min(1, cores / running), so job j ends when the virtual time reaches its start
    virtual time plus its work, and one heap ordered by that end orders all completions."""

    def __init__(self, c: SimConfig):
        self.c = c
        self.rng = random.Random(c.seed)
        self.t = 0.0
        self.v = 0.0                     # virtual time: work done by any one running job so far
        self.heap: list = []             # (virtual end, seq, owner, kind, payload)
        self.seq = 0
        self.running = 0
        self.version = 0                 # the learner version admission sees (set after publication)
        self.weights_version = 0         # the newest weights actors can swap in (weights_lag_s after it)
        self.started = 0                 # groups admitted (the admission counter)
        self.dropped = 0
        self.buffer: list[tuple[int, int]] = []  # (version_start, tokens; 0 for batches) of finished groups, FIFO
        self.group_tokens: dict[int, int] = {}   # stream: tokens of each group in flight, by its seq
        self.trained_tokens = 0
        self.actor_ver = [0] * c.actors
        self.actor_busy = [0.0] * c.actors
        self.actor_since = [None] * c.actors
        self.blocked: set[int] = set()
        self.learner_state = "wait"
        self.learner_busy = 0.0
        self.learner_since = None
        self.step = 0
        self.step_ends: list[float] = []
        self.hist = [0] * (c.s + 1)
        self.learner_pending = 0          # rank jobs of the current learner phase still running
        self.timers: list = []            # (real end, seq, owner, kind, payload): waits that take no core
        self.ingest_queue: list = []      # batches waiting for the ingest process
        self.ingest_busy = False
        # stream actors: engine steps taken, sequences in flight, and heaps of the engine step at which
        # each in-flight sample ends and each in-flight group ends (with its version_start)
        self.estep = [0] * c.actors
        self.rows = [0] * c.actors
        self.sample_ends: list[list[int]] = [[] for _ in range(c.actors)]
        self.group_ends: list[list] = [[] for _ in range(c.actors)]
        self.finished_groups = [0] * c.actors  # sent at the last step: their decode/score/encode CPU
        self.aborted: set[int] = set()            # group seqs aborted in flight (their sample ends are skipped)
        self.aborted_groups = 0
        self.engine_log = [0, 0.0, 0, 0]          # stream: engine steps, their seconds, leased and running sequences

    def rate(self) -> float:
        cores = self.c.cores - self.c.background_cores
        return 1.0 if self.running == 0 else min(1.0, cores / self.running)

    def length_params(self, group: int) -> tuple[float, float]:
        """(mean, sigma) of the lengths of the group with `group` groups to be trained before it (admitted so far
        less those dropped: len_schedule, else fixed). Groups are trained in about the order they are admitted,
        so it is trained at step group // G: the step whose measured lengths the schedule holds (by lease
        version it would be s steps off, and with half the groups dropped, twice as far)."""
        c = self.c
        if not c.len_schedule:
            return c.len_mean, c.len_sigma
        return c.len_schedule[min(group // c.groups_per_step // c.len_window, len(c.len_schedule) - 1)]

    def start_timer(self, owner, kind, seconds, payload=None):
        heapq.heappush(self.timers, (self.t + seconds, self.seq, owner, kind, payload))
        self.seq += 1

    def ingest(self, batch=None) -> None:
        """The ingest process stores batches one at a time; the learner sees a batch once stored."""
        if batch is not None:
            self.ingest_queue.append(batch)
        if not self.ingest_busy and self.ingest_queue:
            self.ingest_busy = True
            self.start_job(("ingest", 0), "store", self.c.system_batch_s, self.ingest_queue.pop(0))

    def start_job(self, owner, kind, work, payload=None):
        heapq.heappush(self.heap, (self.v + max(work, 0.0), self.seq, owner, kind, payload))
        self.seq += 1
        self.running += 1

    # -- actors -----------------------------------------------------------------------------------
    def actor_try(self, i: int) -> None:
        c = self.c
        if c.actor_mode == "stream":
            self._stream_turn(i)
            return
        if self.actor_ver[i] < self.weights_version:     # new weights are there: swap between batches
            self.actor_ver[i] = self.weights_version
            if c.load_s > 0:
                self._busy_actor(i, True)
                self.start_job(("actor", i), "load", c.load_s)
                return
        k = lease_rule(self.version, c.s, c.groups_per_step, self.actor_ver[i], self.started, self.dropped,
                       c.groups_per_batch, c.admission)
        if k <= 0:
            self._busy_actor(i, False)
            self.blocked.add(i)
            return
        lengths = [x for _ in range(k) for x in response_lengths(
            self.rng, c.n, *self.length_params(self.started - self.dropped), c.max_tokens, c.len_group_share)]
        self.started += k
        steps = max(lengths)
        work = c.gen_batch_s + steps * (c.gen_step_s + c.gen_step_row_s * k * c.n) + c.actor_batch_overhead_s
        self._busy_actor(i, True)
        self.start_job(("actor", i), "gen", work, (k, self.actor_ver[i]))

    def _stream_turn(self, i: int) -> None:
        """One turn of the streaming actor's loop: swap weights, lease while there is room, take an engine
        step; with nothing in flight and no lease granted it waits to be woken (publication, drops)."""
        c = self.c
        if self.actor_ver[i] < self.weights_version:   # between two engine steps, sequences in flight continue
            self.actor_ver[i] = self.weights_version
            if c.load_s > 0:
                self._busy_actor(i, True)
                self.start_job(("actor", i), "load", c.load_s)
                return
        if c.abort_stale:
            self._abort_stale(i)
        # engine.in_flight(): whole groups until sent; engine.decoding(): the rows still decoding
        counted = self.rows[i] if c.inflight_count == "running" else len(self.group_ends[i]) * c.n
        room = (c.inflight_target - counted) // c.n
        work = c.actor_batch_overhead_s * self.finished_groups[i]
        self.finished_groups[i] = 0
        k = lease_rule(self.version, c.s, c.groups_per_step, self.actor_ver[i], self.started, self.dropped,
                       min(room, c.groups_per_batch), c.admission) if room > 0 else 0
        if k > 0:
            for j in range(k):
                lengths = response_lengths(self.rng, c.n, *self.length_params(self.started - self.dropped + j),
                                           c.max_tokens, c.len_group_share)
                for n_tokens in lengths:
                    heapq.heappush(self.sample_ends[i], (self.estep[i] + n_tokens, self.seq))
                self.group_tokens[self.seq] = sum(lengths)
                heapq.heappush(self.group_ends[i], (self.estep[i] + max(lengths), self.seq, self.actor_ver[i]))
                self.seq += 1
            self.started += k
            self.rows[i] += k * c.n
            work += c.gen_batch_s * k / c.groups_per_batch   # the new prompts' prefill rides on this step
        if self.rows[i] == 0:
            self._busy_actor(i, False)
            self.blocked.add(i)
            return
        self._busy_actor(i, True)
        slow = 1 + c.actor_contention if self.learner_state == "train" else 1.0
        leased = len(self.group_ends[i]) * c.n
        work = (work + engine_step_s(c, self.rows[i], leased)) * slow
        self.engine_log[0] += 1
        self.engine_log[1] += work
        self.engine_log[2] += leased
        self.engine_log[3] += self.rows[i]
        self.start_job(("actor", i), "estep", work)

    def _stream_step_done(self, i: int) -> None:
        """An engine step ended: samples at their last token leave the batch; finished groups are sent."""
        self.estep[i] += 1
        ends = self.sample_ends[i]
        while ends and ends[0][0] <= self.estep[i]:
            _end, g = heapq.heappop(ends)
            self.rows[i] -= g not in self.aborted  # an aborted group's rows left when it was aborted
        groups = self.group_ends[i]
        while groups and groups[0][0] <= self.estep[i]:
            _end, seq, ver = heapq.heappop(groups)
            self.finished_groups[i] += 1
            group = (1, ver, self.group_tokens.pop(seq))
            if self.c.delivery_s > 0:
                self.start_timer(("delivery", 0), "deliver", self.c.delivery_s, group)
            else:
                self._deliver(group)

    def _deliver(self, group) -> None:
        """A streamed group reaches the buffer (through the one ingest process when it has a cost)."""
        if self.c.system_batch_s > 0:
            self.ingest((*group, None))      # the sender waits for the ack, the actor does not
        else:
            self.stored(group)

    def _abort_stale(self, i: int) -> None:
        """actors.abort_stale: groups in flight started more than s versions before the actor's weights
        would be dropped on arrival; they leave the engine now and count as drops (slots freed)."""
        below = self.actor_ver[i] - self.c.s
        doomed = {g for _end, g, ver in self.group_ends[i] if ver < below}
        if not doomed:
            return
        self.group_ends[i] = [e for e in self.group_ends[i] if e[1] not in doomed]
        heapq.heapify(self.group_ends[i])
        self.rows[i] -= sum(1 for end, g in self.sample_ends[i] if g in doomed and end > self.estep[i])
        self.aborted |= doomed
        for g in doomed:
            del self.group_tokens[g]
        self.aborted_groups += len(doomed)
        self.dropped += len(doomed)
        self.wake_actors()  # other actors waiting for admission slots

    def _busy_actor(self, i: int, busy: bool) -> None:
        if busy and self.actor_since[i] is None:
            self.actor_since[i] = self.t
        elif not busy and self.actor_since[i] is not None:
            self.actor_busy[i] += self.t - self.actor_since[i]
            self.actor_since[i] = None

    def wake_actors(self) -> None:
        blocked, self.blocked = self.blocked, set()
        for i in sorted(blocked):
            self.actor_try(i)

    # -- learner ----------------------------------------------------------------------------------
    def stored(self, batch) -> None:
        k, ver, *tokens = batch   # (groups, version_start[, tokens of a streamed group])
        self.buffer.extend([(ver, tokens[0] if tokens else 0)] * k)
        self.learner_try()

    def learner_try(self) -> None:
        c = self.c
        if self.learner_state != "wait":
            return
        k = self.step
        take = []
        freed = False
        while self.buffer and len(take) < c.groups_per_step:
            vs, tokens = self.buffer.pop(0)
            if not admissible(k, vs, c.s):  # the hard filter: dropped, its admission slot freed
                self.dropped += 1
                freed = True
            else:
                take.append((vs, tokens))
        if len(take) < c.groups_per_step:
            self.buffer[:0] = take      # not enough yet: keep them, in order
            if freed:
                self.wake_actors()
            return
        self.taken = [(k - vs, tokens) for vs, tokens in take]  # (staleness, tokens): counted when the step completes
        self.learner_state = "train"
        self.learner_since = self.t
        if c.learner_latency_s > 0:
            self.start_timer(("learner", 0), "latency", c.learner_latency_s)
        else:
            self.learner_train()
        if freed:
            self.wake_actors()

    def learner_train(self) -> None:
        c = self.c
        per_rank = c.train_step_s + c.train_sample_s * c.groups_per_step * c.n / c.learners \
            + (c.learner_comm_s if c.learners > 1 else 0.0)
        generating = any(self.rows) if c.actor_mode == "stream" else any(t is not None for t in self.actor_since)
        if generating:   # actors generating on the shared device
            per_rank *= 1 + c.learner_contention
        self.learner_pending = c.learners
        for r in range(c.learners):
            self.start_job(("learner", r), "train", per_rank)

    def _learner_done(self, kind: str) -> None:
        """A learner rank's training job ended (the step publishes when all have), or the publication did:
        version k+1 is visible, actors may swap and lease."""
        c = self.c
        if kind == "train":
            self.learner_pending -= 1
            if self.learner_pending == 0:
                self.learner_state = "publish"
                self.start_job(("learner", 0), "publish", c.publish_s)
            return
        self.learner_busy += self.t - self.learner_since
        for st, tokens in self.taken:
            self.hist[st] += c.n
            self.trained_tokens += tokens
        self.step += 1
        self.version = self.step
        if c.weights_lag_s > 0:
            self.start_timer(("actors", 0), "weights", c.weights_lag_s, self.step)
        else:
            self.weights_version = self.step
        self.step_ends.append(self.t)
        self.learner_state = "wait"
        self.learner_try()
        self.wake_actors()

    def run(self) -> SimResult:
        c = self.c
        for i in range(c.actors):
            self.actor_try(i)
        while self.step < c.steps:
            if not self.heap and not self.timers:
                raise RuntimeError("simulated system deadlocked (no job running, learner waiting)")
            t_cpu = self.t + (self.heap[0][0] - self.v) / self.rate() if self.heap else math.inf
            if self.timers and self.timers[0][0] <= t_cpu:
                t_end, _, owner, kind, payload = heapq.heappop(self.timers)
                self.v += (t_end - self.t) * self.rate() if self.heap else 0.0
                self.t = t_end
                if kind == "weights":   # a version's weights reached the actors
                    self.weights_version = max(self.weights_version, payload)
                    self.wake_actors()
                elif kind == "deliver":  # a streamed group's send, ack and buffer write took their time
                    self._deliver(payload)
                else:                   # the learner's non-CPU wait before training
                    self.learner_train()
                continue
            vend, _, owner, kind, payload = heapq.heappop(self.heap)
            self.t = t_cpu
            self.v = vend
            self.running -= 1
            if owner[0] == "actor":
                i = owner[1]
                if kind == "gen" and c.system_batch_s > 0:
                    self.ingest((*payload, i))  # the actor's send blocks until the ingest acks (stored)
                    continue
                if kind == "gen":
                    self.stored(payload)
                elif kind == "estep":
                    self._stream_step_done(i)
                self.actor_try(i)
            elif owner[0] == "ingest":
                self.ingest_busy = False
                *batch, i = payload              # (groups, version_start[, tokens], the actor waiting or None)
                self.stored(tuple(batch))
                if i is not None:                # a batch actor waited for this ack
                    self.actor_try(i)
                self.ingest()
            else:
                self._learner_done(kind)
        for i in range(c.actors):
            self._busy_actor(i, False)
        body = self.step_ends[WARMUP_STEPS:]
        sps = (len(body) - 1) * c.groups_per_step * c.n / (body[-1] - body[0])
        total = self.t
        trained = c.steps * c.groups_per_step
        return SimResult(samples_per_s=sps, staleness_hist=self.hist, learner_idle=1 - self.learner_busy / total,
                         actor_idle=1 - sum(self.actor_busy) / (c.actors * total),
                         dropped_frac=self.dropped / (trained + self.dropped), aborted=self.aborted_groups,
                         **self._engine_means(),
                         step_end_times=self.step_ends,
                         config=asdict(c))


    def _engine_means(self) -> dict:
        steps, seconds, leased, rows = self.engine_log
        return {"engine_step_ms": 1e3 * seconds / steps, "leased_inflight": leased / steps,
                "running": rows / steps, "trained_share": self.trained_tokens / rows} if steps else {}


def simulate(c: SimConfig) -> SimResult:
    return _Sim(c).run()


# ---- calibration from measured runs ------------------------------------------------------------

def _metrics(run_dir) -> list[dict]:
    return M.read_metrics(Path(run_dir) / "metrics.jsonl")  # runs written with the old names too


def _config(run_dir) -> dict:
    import yaml

    return yaml.safe_load((Path(run_dir) / "config.yaml").read_text())


def _fit_line(xs, ys) -> tuple[float, float]:
    """Least-squares y = a + b x; with no spread in x, the whole cost is proportional (a = 0)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx < 1e-9 * max(len(xs), 1):
        return 0.0, my / mx
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if b < 0:  # noise can tilt it; a negative per-step cost means nothing
        return 0.0, my / mx
    return my - b * mx, b


def _steady(ms: list[dict], run=None) -> list[dict]:
    """Steps between the first and the last: start-up and the final evaluation are not steady state."""
    if len(ms) < 6:
        raise ValueError((f"{run}: " if run is not None else "") + f"{len(ms)} steps: calibration needs at least 6")
    return ms[1:-1]


def calibrate(sync_run, s0_runs=()) -> dict:
    """Simulator inputs (SimConfig fields) from measured runs.

    `sync_run`: an `experiments.sync` run dir, one process alone on the machine: generation cost per
    generate call and per decode step (fitted over its batches), and the learner's cost per sample.

    `s0_runs`: `cluster.start buffer.max_staleness=0` run dirs (with their `cpu.jsonl`, see
    cluster/cpu.py), at most one per learner count. Their steps alternate, so each process's CPU per
    step is its work, undisturbed by overlap: the learner ranks' CPU per step beyond the per-sample
    cost is their fixed cost per step (with more than one rank, the excess over one rank is the
    communication cost); the actors' CPU beyond generation is charged per version (weight receive
    and apply, idle polls: it does not grow with batches); ingest and Redis CPU per batch; the
    launcher's and Ray's CPU a constant load; the learner's turn (step time minus its `perf/wait_s`)
    beyond its CPU is latency that takes no core. The machine's core count comes from cpu.jsonl.

    Returns {"base": fields shared by all, "by_learners": {R: fields measured with R ranks}}.
    """

    base, gen_fit = _calibrate_sync(sync_run)
    by_learners: dict[int, dict] = {}
    one_rank_fixed = None
    for run in sorted(s0_runs, key=lambda r: _config(r)["cluster"]["learners"]):
        R = _config(run)["cluster"]["learners"]
        if R in by_learners:
            raise ValueError(f"{run}: a second s=0 run with {R} learners")
        fields, rank_work = _calibrate_s0(run, base, gen_fit)
        if one_rank_fixed is None:
            one_rank_fixed = max(rank_work, 0.0)
        fields["train_step_s"] = one_rank_fixed
        fields["learner_comm_s"] = max(rank_work - one_rank_fixed, 0.0) if R > 1 else 0.0
        by_learners[R] = fields
    return {"base": base, "by_learners": by_learners}


def _calibrate_sync(sync_run) -> tuple[dict, tuple[float, float, float]]:
    """The fields one synchronous run measures, and its fit (per call, per decode step, samples per step)."""
    ms = _steady(_metrics(sync_run), sync_run)
    cfg = _config(sync_run)
    batches = [b for m in ms for b in m[M.GEN_BATCHES]]
    a, b = _fit_line([x[1] for x in batches], [x[0] for x in batches])
    samples = statistics.median(m[M.SAMPLES] for m in ms)
    base = {"gen_batch_s": a, "gen_step_s": b, "gen_step_row_s": 0.0,
            "len_mean": statistics.fmean(x[1] for x in batches), "len_sigma": 0.0,
            "max_tokens": cfg["actors"]["max_tokens"], "train_sample_s": statistics.median(m[M.TRAIN_S] for m in ms) / samples,
            "load_s": statistics.median(m[M.WS_PUBLISH_S] for m in ms),
            "groups_per_step": cfg["learner"]["groups_per_step"], "n": cfg["actors"]["n"],
            "groups_per_batch": cfg["actors"]["groups_per_batch"]}
    return base, (a, b, samples)


def _calibrate_s0(run, base: dict, gen_fit: tuple[float, float, float]) -> tuple[dict, float]:
    """The fields one s=0 run measures (see calibrate), and its learner ranks' work per step beyond the
    per-sample cost and the publication."""
    a, b, samples = gen_fit
    c0 = _config(run)
    if c0["buffer"]["max_staleness"] != 0:
        raise ValueError(f"{run}: calibration needs max_staleness=0 runs (steps alternate)")
    R, A = c0["cluster"]["learners"], c0["cluster"]["actors"]
    m0 = _steady(_metrics(run), run)
    lines = cpu_log.read(run)
    used, wall = cpu_log.used_between(lines, m0[0][M.TIME], m0[-1][M.TIME])
    steps = wall / statistics.fmean(q[M.TIME] - p[M.TIME] for p, q in zip(m0, m0[1:]))
    per_step = {role: c / steps for role, c in used.items()}
    ranks = [per_step.get(f"learner-{r}", 0.0) for r in range(R)]
    actors = [per_step.get(f"actor-{i}", 0.0) for i in range(A)]
    batches_per_step = math.ceil(base["groups_per_step"] / base["groups_per_batch"])
    publish = statistics.median(m.get(M.WS_PUBLISH_S, 0.0) for m in m0)
    rank_work = statistics.fmean(ranks) - base["train_sample_s"] * samples / R - publish
    latency = statistics.median(q[M.TIME] - p[M.TIME] - q[M.WAIT_S] for p, q in zip(m0, m0[1:])) - ranks[0]
    fields = {"cores": lines[-1]["cores"], "publish_s": publish,
              "load_s": max(statistics.fmean(actors) - (a + b * base["len_mean"]) * batches_per_step / A, 0.0),
              "actor_batch_overhead_s": 0.0,
              "system_batch_s": (per_step.get("ingest", 0.0) + per_step.get("redis", 0.0)) / batches_per_step,
              "background_cores": sum(used.get(k, 0.0) for k in ("launcher", "other")) / wall,
              "learner_latency_s": max(latency, 0.0)}
    return fields, rank_work


ENGINE_FITS = ("line", "curve")   # the engine step in the leased sequences: engine_line, or engine_curve


def calibrate_gpu(s0_runs, async_runs=(), engine_fit: str = "line") -> dict:
    """SimConfig fields for streaming vLLM actors beside the learner on one GPU, from lockstep runs of
    `cluster.start` (max_staleness=0, actors.engine=vllm): each step there generates its groups from idle
    weights-current engines and ends when the longest sample ends, so the learner's wait is a line in the
    step's longest response (per engine step, and per step: the new weights reaching the actors, prefill,
    ingest); the publication's end-to-end time is the lag of the weights behind the version; the learner's
    turn (its step less its wait and publication) and its publication are taken as they are; response lengths
    are log-normal with the runs' mean and a sigma that gives their ratio of longest to mean response per step.
    The engine's step is a line in the leased sequences in flight (engine_line), fitted to the actors'
    heartbeats of every calibration run: lockstep runs hold ~50, an async run (`async_runs`, s >= 1) more,
    with the learner training beside it; the async runs also give the learner's slow-down (its step there
    against lockstep's). With `engine_fit="curve"` the step is engine_curve instead (gen_step_curve: piecewise
    linear through the heartbeats, monotone), which bends where runs in the mid-range show it does. A run used
    here predicts nothing (validate, validate_loo)."""
    if engine_fit not in ENGINE_FITS:
        raise ValueError(f"engine_fit must be one of {ENGINE_FITS}, not {engine_fit!r}")
    pts, train, publish, lag, ms = [], [], [], [], []
    for run in s0_runs:
        cfg = _config(run)
        if cfg["buffer"]["max_staleness"] != 0 or cfg["actors"]["engine"] != "vllm":
            raise ValueError(f"{run}: GPU calibration needs max_staleness=0 runs with actors.engine=vllm")
        steps = _metrics(run)
        ms += _steady(steps, run)
        train += [b[M.TIME] - a[M.TIME] - b[M.WAIT_S] - b.get(M.PUBLISH_S, 0.0) for a, b in zip(steps, steps[1:])][1:-1]
    for m in ms:
        pts.append((m[M.RESPONSE_LEN_MAX], m[M.WAIT_S]))
        publish.append(m.get(M.PUBLISH_S, 0.0))
        lag.append(m.get(M.WS_PUBLISH_S, 0.0))
    a, b = _fit_line([x for x, _ in pts], [y for _, y in pts])
    lag_s = statistics.median(lag)
    step_s, seq_s = engine_line([*s0_runs, *async_runs], b)
    load_s = min(actor_loop_s([*s0_runs, *async_runs]), max(a - lag_s - b, 0.0))
    fields = {"actor_mode": "stream", "inflight_seqs": cfg["actors"]["max_inflight_seqs"], "cores": math.inf,
            # the step's fixed part is the weights' lag, the actor's swap, the new prompts' prefill (about one more
            # engine step: it rides on a decode step) and the group's way to the learner, which takes no engine time
            "gen_step_s": step_s, "gen_step_seq_s": seq_s, "gen_batch_s": min(b, max(a - lag_s, 0.0)),
            "delivery_s": max(a - lag_s - b - load_s, 0.0), "gen_step_row_s": 0.0, "weights_lag_s": lag_s,
            "load_s": load_s,
            "train_step_s": statistics.median(train), "train_sample_s": 0.0, "publish_s": statistics.median(publish),
            "groups_per_step": cfg["learner"]["groups_per_step"], "n": cfg["actors"]["n"],
            "groups_per_batch": cfg["actors"]["groups_per_batch"], "max_tokens": cfg["actors"]["max_tokens"],
            **_length_fields([*s0_runs, *async_runs], ms, cfg["learner"]["groups_per_step"], cfg["actors"]["n"],
                             cfg["actors"]["max_tokens"])}
    if engine_fit == "curve":
        fields["gen_step_curve"] = engine_curve([*s0_runs, *async_runs], b)
    if async_runs:
        lockstep = statistics.median(m[M.TRAIN_S] for m in ms)
        overlapped = statistics.median(m[M.TRAIN_S] for run in async_runs for m in _steady(_metrics(run), run))
        fields["learner_contention"] = max(overlapped / lockstep - 1, 0.0)
        if seq_s == 0:   # runs from before the heartbeat's counters: what sharing costs the engine, as a factor
            fields["actor_contention"] = _fit_actor_contention(fields, [measured(run) for run in async_runs])
    return fields


def _length_fields(runs, ms: list[dict], groups: int, n: int, cap: int) -> dict:
    """len_mean, len_sigma (the lockstep steps `ms`) and len_group_share: how much of the spread is a prompt's,
    from the runs that lost no group (their engines generated only what was trained), through the tokens per
    leased sequence-step their heartbeats measured (none: independent samples)."""
    lossless = [(m, measured_slot_use(r)) for r, m in zip(runs, map(measured, runs)) if m["dropped_frac"] == 0]
    lossless = [(m, u) for m, u in lossless if u and m["length_schedule"]]
    share = 0.0
    if lossless:
        share = group_share(tuple(w for m, _u in lossless for w in m["length_schedule"]),
                            statistics.fmean(u for _m, u in lossless), groups, n, cap)
    return {**response_workload(ms, groups, n, cap, share), "len_group_share": share}


def _fit_actor_contention(fields: dict, runs: list[dict], top: float = 4.0) -> float:
    """The engines' slow-down under a training learner that makes the simulated samples/s of `runs` (measured
    dicts) average their measured ones; 0 or `top` when even those bounds miss (runs without heartbeats only:
    with them the engine line replaces this factor)."""
    target = statistics.fmean(m["samples_per_s"] for m in runs)

    def rate(k: float) -> float:
        return statistics.fmean(_predict({"base": {**fields, "actor_contention": k}, "by_learners": {}}, m).samples_per_s
                                for m in runs)

    lo, hi = 0.0, top
    if rate(lo) <= target:
        return lo
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) > target else (lo, mid)
    return (lo + hi) / 2


def actor_loop_s(runs) -> float:
    """Seconds per weight version that the actors' loops spend outside engine steps (their heartbeats' busy time
    less their engine steps' time, over the versions they swapped in): the swap into the engine and the groups
    sent per version, which stall the engine (0 without heartbeats)."""
    members = [m for run in runs if (Path(run) / "status.json").exists()
               for m in json.loads((Path(run) / "status.json").read_text()).get("members", {}).values()
               if m.get("engine_steps") and "busy_s" in m]
    versions = sum(m.get("version", 0) for m in members)
    return sum(m["busy_s"] - m["step_s"] for m in members) / versions if versions else 0.0


MIN_LEASED_SPREAD = 20   # sequences: heartbeats closer together than this cannot tell a slope from noise


def engine_line(runs, lockstep_step_s: float) -> tuple[float, float]:
    """(fixed, per leased sequence) seconds of an engine step: the line through the actors' heartbeats of
    `runs` (mean step against mean leased sequences in flight). Without heartbeats that spread over
    MIN_LEASED_SPREAD sequences, the step is the lockstep fit's per-step cost, whatever is in flight."""
    pts = [(e["leased_inflight"], e["step_ms"] / 1e3) for run in runs for e in heartbeats(run).values()]
    if len(pts) < 2 or max(x for x, _ in pts) - min(x for x, _ in pts) < MIN_LEASED_SPREAD:
        return lockstep_step_s, 0.0
    return _fit_line([x for x, _ in pts], [y for _, y in pts])


def engine_curve(runs, lockstep_step_s: float) -> tuple:
    """gen_step_curve: knots (leased, seconds) of a non-decreasing engine step through the actors' heartbeats of
    `runs` (mean step against mean leased sequences; monotone_knots); without heartbeats, the lockstep step, flat."""
    pts = [(e["leased_inflight"], e["step_ms"] / 1e3) for run in runs for e in heartbeats(run).values()]
    return monotone_knots(pts) if pts else ((0.0, lockstep_step_s),)


def monotone_knots(points, min_spread: float = MIN_LEASED_SPREAD) -> tuple:
    """Knots of a non-decreasing curve through (x, y) points: sorted by x, adjacent points pooled into their mean
    (x, y) while a later one lies below an earlier one (pool-adjacent-violators: the least-squares monotone fit) or
    closer than `min_spread` in x (their difference is noise, not a slope)."""
    blocks: list[list[float]] = []   # [sum x, sum y, points]
    for x, y in sorted(points):
        blocks.append([x, y, 1])
        while len(blocks) > 1:
            (xa, ya, na), (xb, yb, nb) = blocks[-2], blocks[-1]
            if ya / na <= yb / nb and xb / nb - xa / na >= min_spread:
                break
            blocks[-2:] = [[xa + xb, ya + yb, na + nb]]
    return tuple((sx / k, sy / k) for sx, sy, k in blocks)


def heartbeats(run_dir) -> dict[str, dict]:
    """Per actor of a run: its engine's mean step (ms) and leased sequences in flight, from the launcher's
    last status (cluster.status.engine_steps); {} for runs without status.json or from before the counters."""
    path = Path(run_dir) / "status.json"
    return engine_steps(json.loads(path.read_text())) if path.exists() else {}


def response_workload(ms: list[dict], groups: int, n: int, cap: int, share: float = 0.0) -> dict:
    """len_mean and len_sigma of log-normal lengths with the steps' mean response and their mean ratio of
    longest to mean response over a step's groups x n samples: what the policy generated (the workload)."""
    mean, ratio = length_stats(ms)
    return {"len_mean": mean, "len_sigma": _sigma_for_ratio(ratio, groups, n, mean, cap, share)}


def length_stats(ms: list[dict]) -> tuple[float, float]:
    """The steps' mean response length and their mean ratio of longest to mean response."""
    return (statistics.fmean(m[M.RESPONSE_LEN_MEAN] for m in ms),
            statistics.fmean(m[M.RESPONSE_LEN_MAX] / max(m[M.RESPONSE_LEN_MEAN], 1e-9) for m in ms))


LEN_DRAWS = 200   # simulated steps behind each estimate of a length statistic (its error ~1%)


@functools.lru_cache(maxsize=8)
def _normals(groups: int, n: int):
    """Fixed standard normals for LEN_DRAWS steps of `groups` groups of n: one per group, one per sample (every
    estimate draws the same ones, so bisections over sigma and share are smooth)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.standard_normal((LEN_DRAWS, groups, 1)), rng.standard_normal((LEN_DRAWS, groups, n))


def _step_lengths(groups: int, n: int, mean: float, sigma: float, cap: int, share: float):
    """LEN_DRAWS steps of lengths as response_lengths draws them (array: step, group, sample)."""
    import numpy as np

    zg, zi = _normals(groups, n)
    z = math.sqrt(share) * zg + math.sqrt(1 - share) * zi
    return np.clip(np.rint(np.exp(math.log(mean) - sigma * sigma / 2 + sigma * z)), 1, cap)


@functools.lru_cache(maxsize=4096)   # a validation solves every window of every run, for each share probed
def _sigma_for_ratio(ratio: float, groups: int, n: int, mean: float, cap: int, share: float = 0.0) -> float:
    """The log-normal sigma whose steps of groups x n samples have, on average, `ratio` = longest / mean response
    (bisection: the ratio grows with sigma)."""
    def got(sigma: float) -> float:
        x = _step_lengths(groups, n, mean, sigma, cap, share).reshape(LEN_DRAWS, -1)
        return float((x.max(axis=1) / x.mean(axis=1)).mean())

    lo, hi = 0.0, 3.0
    for _ in range(25):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if got(mid) < ratio else (lo, mid)
    return (lo + hi) / 2


def slot_use(schedule, groups: int, n: int, cap: int, share: float) -> float:
    """Tokens generated per leased sequence-step for lengths that follow `schedule` ((mean, ratio) per window,
    equal samples in each): a group holds n slots until its longest sample ends, so this is the windows' mean
    length over their mean longest-of-a-group."""
    tokens = slots = 0.0
    for mean, ratio in schedule:
        x = _step_lengths(groups, n, round(mean, 1), _sigma_for_ratio(round(ratio, 2), groups, n, round(mean, 1),
                                                                        cap, share), cap, share)
        tokens += float(x.mean())
        slots += float(x.max(axis=2).mean())
    return tokens / slots


MAX_GROUP_SHARE = 0.95   # a group's samples are never one draw: each is sampled on its own


def group_share(schedule, measured_use: float, groups: int, n: int, cap: int) -> float:
    """The len_group_share at which lengths following `schedule` use the leased slots as measured (slot_use;
    more share, less idle): 0 when even independent samples use them no worse, MAX_GROUP_SHARE at most."""
    if slot_use(schedule, groups, n, cap, 0.0) >= measured_use:
        return 0.0
    lo, hi = 0.0, MAX_GROUP_SHARE
    for _ in range(12):
        mid = round((lo + hi) / 2, 4)
        lo, hi = (mid, hi) if slot_use(schedule, groups, n, cap, mid) < measured_use else (lo, mid)
    return round((lo + hi) / 2, 4)


def measured_slot_use(run_dir) -> float | None:
    """A run's tokens trained per leased sequence-step of its engines (the actors' heartbeats), None without them:
    in a run that drops nothing, every generated token is trained."""
    path = Path(run_dir) / "status.json"
    members = json.loads(path.read_text()).get("members", {}) if path.exists() else {}
    leased = sum(m.get("leased_seqs", 0) for m in members.values())
    tokens = sum(m[M.SAMPLES] * m[M.RESPONSE_LEN_MEAN] for m in _metrics(run_dir))
    return tokens / leased if leased else None


def calibration_for(calib: dict, learners: int) -> dict:
    """SimConfig fields for a system with `learners` ranks: those measured with that many, else with
    the nearest count below (or the fewest): say which in the validation rows."""
    by = calib["by_learners"]
    if not by:
        return dict(calib["base"])
    below = [r for r in by if r <= learners]
    return {**calib["base"], **by[max(below) if below else min(by)]}


def measured(run_dir) -> dict:
    """What a run measured: steady-state samples/s (same rule as the sweep) and staleness fractions."""

    ms = _metrics(run_dir)
    cfg = _config(run_dir)
    hist = [0] * (cfg["buffer"]["max_staleness"] + 1)
    for m in ms[1:]:
        for k, x in enumerate(m[M.STALENESS_HIST]):
            hist[k] += x
    t = sum(hist) or 1
    return {"actors": cfg["cluster"]["actors"], "learners": cfg["cluster"]["learners"],
            "max_staleness": cfg["buffer"]["max_staleness"], "samples_per_s": run_throughput(ms),
            "staleness": [h / t for h in hist], "steps": len(ms), "dropped_frac": dropped_frac(ms, cfg["actors"]["n"]),
            "engine": _mean_heartbeat(run_dir), "trained_share": trained_share(run_dir, ms),
            # the rules the run had: configs from before these keys ran AReaL's cap and no abort in flight
            "admission": cfg["buffer"].get("admission", "learner"),
            "abort_stale": cfg["actors"].get("abort_stale", False),
            "inflight_seqs": cfg["actors"].get("max_inflight_seqs", 0),
            "inflight_count": cfg["actors"].get("inflight_count", "leased"),
            # its lengths per LEN_WINDOW steps (the GPU calibration's workload: they change as the policy learns;
            # the sigmas are solved only when a prediction needs them)
            "length_schedule": [length_stats(ms[w:w + LEN_WINDOW]) for w in range(0, len(ms), LEN_WINDOW)]
            if M.RESPONSE_LEN_MAX in ms[-1] else None}


def dropped_frac(ms: list[dict], n: int) -> float:
    """Groups dropped as stale (by the learner, plus aborted in flight by the actors: a running total) over
    groups trained (samples / n) plus dropped, as experiments.staleness counts them."""
    dropped = sum(m.get(M.DROPPED_STALE, 0) for m in ms) + ms[-1].get(M.ABORTED_STALE, 0)
    trained = sum(m[M.SAMPLES] for m in ms) / n
    return dropped / max(trained + dropped, 1)


def _mean_heartbeat(run_dir) -> dict:
    """The actors' engine step (ms), leased sequences in flight and, where counted, the sequences the engine ran,
    averaged over actors ({} without them)."""
    beats = list(heartbeats(run_dir).values())
    keys = ("step_ms", "leased_inflight") + (("running",) if beats and all("running" in b for b in beats) else ())
    return {k: statistics.fmean(b[k] for b in beats) for k in keys} if beats else {}


def length_spread(runs) -> list[float]:
    """Per LEN_WINDOW steps of training, the mean ratio of longest to mean response over the `runs` that lost no
    group (no staleness drop, no abort): what the engine generated at that point of training. A run with drops
    trains without its longest groups (aborted or dropped as too stale), so its own ratio is too small."""
    scheds = [m["length_schedule"] for m in map(measured, runs) if m["dropped_frac"] == 0 and m["length_schedule"]]
    return [statistics.fmean(sc[w][1] for sc in scheds if w < len(sc)) for w in range(max(map(len, scheds), default=0))]


def _predict(calib: dict, m: dict) -> SimResult:
    fields = calibration_for(calib, m["learners"])
    if fields.get("actor_mode") == "stream":   # GPU calibration: costs from the s=0 runs, the run's own lengths
        G, n, cap = fields["groups_per_step"], fields["n"], fields["max_tokens"]
        own = [rw for _mw, rw in m["length_schedule"]]
        if m["max_staleness"] == 0:   # lockstep: every step waits for its longest sample, and nothing was dropped,
            spread = own              # so the run's own longest-to-mean ratio is its workload, measured exactly
        else:   # async: its own is short of what it generated (drops take the longest); the lossless runs' tails,
            # widened by what async policies generate beyond them (fit_tail_factor)
            spread = [1 + (x - 1) * calib.get("tail_factor", 1.0) for x in calib.get("len_ratios") or own]
        fields.update(len_window=LEN_WINDOW,   # (the schedule replaces len_mean and len_sigma)
                      len_schedule=tuple((mw, _sigma_for_ratio(round(spread[min(w, len(spread) - 1)], 2), G, n,
                                                               round(mw, 1), cap, fields.get("len_group_share", 0.0)))
                                         for w, (mw, _rw) in enumerate(m["length_schedule"])))
    return simulate(SimConfig(**{**fields, "actors": m["actors"], "learners": m["learners"], "mode": "async",
                                 "max_staleness": m["max_staleness"], "steps": max(m["steps"], WARMUP_STEPS + 2),
                                 "admission": m["admission"], "abort_stale": m["abort_stale"],
                                 **({"inflight_seqs": m["inflight_seqs"], "inflight_count": m["inflight_count"]}
                                    if fields.get("actor_mode") == "stream" else {})}))


def fit_tail_factor(calib: dict, runs) -> float:
    """How much heavier than the lossless runs' (`len_ratios`) async runs' generated tails are: the factor on the
    longest-to-mean ratio's excess over 1 at which the simulated trained share of generated tokens of `runs` (the
    async ones that measured it: their rows and their trained tokens) matches theirs on average. A run with drops
    trains without its longest groups, so what it generated is seen only in what it wasted. 1 where no run
    measured it."""
    got = [(m, m["trained_share"]) for m in map(measured, runs)
           if m["max_staleness"] > 0 and m["trained_share"] is not None and m["length_schedule"]]
    if not got:
        return 1.0

    def gap(f: float) -> float:   # simulated minus measured share: falls as the tails widen
        return statistics.fmean(_predict({**calib, "tail_factor": f}, m).trained_share - share for m, share in got)

    lo, hi = TAIL_FACTOR_RANGE
    if gap(lo) <= 0:   # each gap is a simulation of every run: no bound is tried twice
        return lo
    if gap(hi) >= 0:
        return hi
    for _ in range(TAIL_FIT_ITERS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def validate(calib: dict, runs: list) -> list[dict]:
    """Predicted vs measured samples/s and staleness distribution, one row per measured run."""
    rows = []
    for rd in runs:
        m = measured(rd)
        p = _predict(calib, m)
        rows.append({"run": str(rd), "actors": m["actors"], "learners": m["learners"], "s": m["max_staleness"],
                     "measured": m["samples_per_s"], "predicted": p.samples_per_s,
                     "error": p.samples_per_s / m["samples_per_s"] - 1,
                     "measured_staleness": m["staleness"], "predicted_staleness": p.staleness_fractions(),
                     "measured_dropped": m["dropped_frac"], "predicted_dropped": p.dropped_frac,
                     "measured_engine": m["engine"], "measured_trained_share": m["trained_share"],
                     "predicted_trained_share": p.trained_share,
                     "predicted_engine": {"step_ms": p.engine_step_ms, "leased_inflight": p.leased_inflight,
                                          "running": p.running}})
    return rows


def setting(run) -> int:
    """A run's setting for leave-one-setting-out: its staleness bound (the corrections at one bound are one setting)."""
    return _config(run)["buffer"]["max_staleness"]


def loo_calibration(i: int, runs: list, engine_fit: str = "curve") -> tuple[dict, list, str]:
    """The GPU calibration that predicts runs[i] from every given run at another bound (none of its own bound: not
    another seed, not another correction), its runs, and a note. Only lockstep runs measure the lockstep costs (the
    group's way to the learner, delivery_s, is hidden wherever actors run ahead), so an s=0 run takes them from the
    other s=0 runs (they join its calibration, though they share its setting): the note says so. An async run's
    generated tails are fitted on the other async runs' waste (fit_tail_factor)."""
    bounds = [setting(r) for r in runs]
    others = [r for r, b in zip(runs, bounds) if b != bounds[i]]
    note = ""
    if bounds[i] == 0:
        others += [r for j, (r, b) in enumerate(zip(runs, bounds)) if b == 0 and j != i]
        note = "with the other s=0 run: only lockstep runs measure the lockstep costs"
    s0 = [r for r in others if setting(r) == 0]
    if not s0:
        raise ValueError(f"{runs[i]}: no other s=0 run to take the lockstep costs from")
    calib = {"base": calibrate_gpu(s0, [r for r in others if setting(r) != 0], engine_fit), "by_learners": {},
             "len_ratios": length_spread(others)}
    # an async prediction's tails (a lockstep one trains all it generates: the lossless runs' ratio is its own)
    calib["tail_factor"] = fit_tail_factor(calib, [r for r in others if setting(r) != 0]) if bounds[i] else 1.0
    return calib, others, note


def lone_lockstep(runs: list) -> int | None:
    """The index of the only s=0 run among several (one device session's sweep with one lockstep seed): it
    calibrates the async predictions, and nothing can predict it (loo_calibration), so it is left unpredicted."""
    lockstep = [i for i, r in enumerate(runs) if setting(r) == 0]
    return lockstep[0] if len(lockstep) == 1 and len(runs) > 1 else None


def validate_loo(runs: list, engine_fit: str = "curve", fields: dict | None = None) -> list[dict]:
    """Leave one setting out: each run predicted from a calibration on the runs of every other bound (loo_calibration;
    `fields` override the calibrated ones), its row naming them; a lone s=0 run (lone_lockstep) only calibrates."""
    rows, lone = [], lone_lockstep(runs)
    for i, rd in enumerate(runs):
        if i == lone:
            continue
        calib, others, note = loo_calibration(i, runs, engine_fit)
        calib["base"].update(fields or {})
        row = validate(calib, [rd])[0]
        row.update(calibrated_on=[Path(r).name for r in others], note=note,
                   calibration={**calib["base"], "tail_factor": calib["tail_factor"]})
        rows.append(row)
    return rows


STALENESS_SHOWN = 0.005   # histogram bins printed: up to the last one holding this fraction on either side
STALENESS_BINS_SHOWN = 12  # longer histograms are printed as their mean (a table cell stays readable)


def _row_line(r: dict) -> str:
    """One validation row as a markdown table line (staleness histograms cut after their last real bin)."""
    ms, ps = r["measured_staleness"], r["predicted_staleness"]
    last = max((k for k, (x, y) in enumerate(zip(ms, ps)) if max(x, y) >= STALENESS_SHOWN), default=0)
    def fm(xs):  # a long histogram (s=1000) as its mean
        return " ".join(f"{x:.2f}" for x in xs[:last + 1]) if last < STALENESS_BINS_SHOWN else \
            f"mean {sum(k * x for k, x in enumerate(xs)):.1f}"
    me, pe = r.get("measured_engine") or {}, r.get("predicted_engine") or {}
    eng = (f"{me['step_ms']:.1f} / {pe['step_ms']:.1f} ms, {me['leased_inflight']:.0f} / {pe['leased_inflight']:.0f}"
           + (f" ({me['running']:.0f} / {pe['running']:.0f} running)" if "running" in me and "running" in pe else "")
           if me and not math.isnan(pe.get("step_ms", math.nan)) else "-")
    mt, pt = r.get("measured_trained_share"), r.get("predicted_trained_share", math.nan)
    share = f"{mt:.2f} / {pt:.2f}" if mt is not None and not math.isnan(pt) else "-"
    return (f"| {Path(r['run']).name} | {r['actors']}/{r['learners']} | {r['s']} | {r['measured']:.0f} | "
            f"{r['predicted']:.0f} | {100 * r['error']:+.1f}% | {100 * r['measured_dropped']:.0f}% / "
            f"{100 * r['predicted_dropped']:.0f}% | {eng} | {share} | {fm(ms)} | {fm(ps)} |")


def _rounded(fields: dict) -> str:
    return json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in fields.items()})


def _report_validation(rows: list[dict], out, plot_name: str, calib: dict | None = None) -> None:
    """The validation table on stdout (a leave-one-setting-out row also names its calibration runs, and its
    calibration is printed above it); rows, calibration and plot under `out`."""
    for r in rows:
        if "calibrated_on" in r:
            print(f"{Path(r['run']).name}: calibrated on {' '.join(r['calibrated_on'])}"
                  + (f" ({r['note']})" if r["note"] else "") + ": " + _rounded(r["calibration"]))
    print("| run | actors/learners | s | measured samples/s | simulated | error | groups dropped measured / "
          "simulated | engine step, leased seqs measured / simulated | trained share of generated tokens measured / "
          "simulated | staleness measured | simulated |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(_row_line(r))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "validation.json").write_text(json.dumps({"calibration": calib, "rows": rows}, indent=1))
        plot_validation(rows, Path(out) / plot_name)


def plot_validation(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 1 + len(rows), figsize=(3.6 * (1 + len(rows)), 3.4))
    ax = axes[0]
    lim = max(max(r["measured"], r["predicted"]) for r in rows) * 1.15
    ax.plot([0, lim], [0, lim], color="gray", lw=1)
    ax.fill_between([0, lim], [0, lim * 0.85], [0, lim * 1.15], color="gray", alpha=0.15, label="±15%")
    for r in rows:
        ax.scatter(r["measured"], r["predicted"], zorder=3)
        ax.annotate(f"{r['actors']}/{r['learners']} s={r['s']}", (r["measured"], r["predicted"]), fontsize=7,
                    xytext=(3, -9), textcoords="offset points")
    ax.set_xlim(0, lim)
    ax.set_ylim(0, lim)
    ax.set_xlabel("measured samples/s")
    ax.set_ylabel("simulated samples/s")
    ax.set_title("throughput", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    for ax, r in zip(axes[1:], rows):
        ms, ps = r["measured_staleness"], r["predicted_staleness"]
        k = np.arange(1 + max((j for j, (x, y) in enumerate(zip(ms, ps)) if max(x, y) >= STALENESS_SHOWN), default=0))
        ax.bar(k - 0.2, ms[:len(k)], 0.4, label="measured")
        ax.bar(k + 0.2, ps[:len(k)], 0.4, label="simulated")
        ax.set_title(f"staleness, {Path(r['run']).name} ({r['actors']}/{r['learners']}, s={r['s']})", fontsize=9)
        if len(k) <= STALENESS_BINS_SHOWN:
            ax.set_xticks(k)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- CLI ---------------------------------------------------------------------------------------

def _table(calib: dict, overrides: dict, actors: list[int], learners: list[int], stale: list[int],
           modes: list[str]) -> list[dict]:
    rows = []
    combos = [(a, m, l, s) for a in actors for l in learners for m in modes for s in (stale if m == "async" else [0])]
    for i, (a, mode, lrn, s) in enumerate(combos):
        sys.stderr.write(f"\r\033[Ksimulating {i + 1}/{len(combos)}: {a} actors, {lrn} learners, {mode} s={s}")
        sys.stderr.flush()
        c = SimConfig(**{**calibration_for(calib, lrn), **overrides, "actors": a, "learners": lrn, "mode": mode,
                         "max_staleness": s})
        r = simulate(c)
        rows.append({"actors": a, "learners": lrn, "mode": mode, "s": s, "samples_per_s": r.samples_per_s,
                     "learner_idle": r.learner_idle, "actor_idle": r.actor_idle, "dropped": r.dropped_frac,
                     "staleness": r.staleness_fractions()})
    sys.stderr.write("\r\033[K")
    return rows


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for kv in pairs:
        k, _, v = kv.partition("=")
        if k not in SimConfig.__dataclass_fields__:
            raise SystemExit(f"--set {kv}: SimConfig has no field {k!r}")
        kind = type(getattr(SimConfig(), k))
        if kind is bool and v.lower() not in ("true", "false"):
            raise SystemExit(f"--set {kv}: {k} is true or false")
        try:
            out[k] = v.lower() == "true" if kind is bool else kind(v)
        except ValueError:
            raise SystemExit(f"--set {kv}: {k} expects a {kind.__name__}") from None
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.simulate", description=__doc__.split("\n\n")[1])
    p.add_argument("--actors", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--learners", type=int, nargs="+", default=[8])
    p.add_argument("--max-staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--cores", type=float, help="shared CPU cores (inf: one GPU per process; default: inf, or the "
                                               "calibration runs' machine when validating)")
    p.add_argument("--sync-run", help="experiments.sync run dir to calibrate generation/training costs from")
    p.add_argument("--s0-run", nargs="*", default=[],
                   help="cluster.start max_staleness=0 run dirs (one per learner count) to calibrate the system's costs")
    p.add_argument("--gpu-s0-run", nargs="*", default=[],
                   help="GPU: cluster.start max_staleness=0 runs with vLLM actors to calibrate from (calibrate_gpu)")
    p.add_argument("--gpu-async-run", nargs="*", default=[],
                   help="GPU: runs at s >= 1 that calibrate what sharing the GPU costs (predicted by nothing)")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override SimConfig fields")
    p.add_argument("--validate", nargs="*", metavar="RUN", help="measured run dirs to predict and compare")
    p.add_argument("--validate-loo", nargs="+", metavar="RUN",
                   help="GPU: leave one setting out: predict each run from the given runs at other bounds (validate_loo)")
    p.add_argument("--engine-fit", choices=ENGINE_FITS, default=None,
                   help="GPU: the engine step in leased sequences, a line or a monotone piecewise-linear curve "
                        "(default: line for --gpu-s0-run, curve for --validate-loo)")
    p.add_argument("--out", help="write results (JSON, and the validation plot) here")
    return p


def _check_args(p, a) -> None:
    """Refuse what SimConfig would reject with a traceback, or what would be silently ignored."""
    for flag, values, low in (("--actors", a.actors, 1), ("--learners", a.learners, 1),
                              ("--max-staleness", a.max_staleness, 0), ("--steps", [a.steps], 1)):
        if any(v < low for v in values):
            p.error(f"{flag}: every value must be >= {low}, got {values}")
    if a.cores is not None and not a.cores > 0:
        p.error(f"--cores: must be > 0 (inf: one GPU per process), got {a.cores}")
    if a.s0_run and not a.sync_run:
        p.error("--s0-run calibrates together with --sync-run; give both")
    if a.gpu_async_run and not a.gpu_s0_run:
        p.error("--gpu-async-run calibrates together with --gpu-s0-run; give both")
    for run in [a.sync_run or "", *a.s0_run, *a.gpu_s0_run, *a.gpu_async_run, *(a.validate or []),
                *(a.validate_loo or [])]:
        if run and not (Path(run) / "metrics.jsonl").is_file():
            p.error(f"{run}: not a run directory (no metrics.jsonl)")


def main(argv=None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    _check_args(p, a)
    try:
        return _main(p, a)
    except ValueError as e:   # a run too short to calibrate from, of the wrong kind: named, not a traceback
        p.error(str(e))


def _main(p, a) -> int:
    if a.validate_loo:
        rows = validate_loo(a.validate_loo, a.engine_fit or "curve",
                            {**_overrides(a.set), **({"cores": a.cores} if a.cores else {})})
        if (lone := lone_lockstep(a.validate_loo)) is not None:
            print(f"{a.validate_loo[lone]}: not predicted: the only s=0 run (the async predictions take their "
                  "lockstep costs from it; a second s=0 run would predict it)")
        _report_validation(rows, a.out, "simulator_validation_loo.png")
        return 0
    if a.gpu_s0_run:
        calib = {"base": calibrate_gpu(a.gpu_s0_run, a.gpu_async_run, a.engine_fit or "line"), "by_learners": {},
                 "len_ratios": length_spread([*a.gpu_s0_run, *a.gpu_async_run])}
        calib["tail_factor"] = fit_tail_factor(calib, a.gpu_async_run)
    else:
        calib = calibrate(a.sync_run, a.s0_run) if a.sync_run else {"base": {}, "by_learners": {}}
    overrides = _overrides(a.set)
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    if a.validate is not None:
        if not (a.sync_run and a.s0_run) and not a.gpu_s0_run:
            p.error("--validate needs --sync-run and --s0-run (or --gpu-s0-run) to calibrate from")
        for fields in calib["by_learners"].values() or [calib["base"]]:
            fields.update(overrides, **({"cores": a.cores} if a.cores else {}))
        rows = validate(calib, a.validate)
        for r, fields in sorted(calib["by_learners"].items()) or [(1, {})]:
            print(f"calibration ({r} learner{'s' * (r > 1)}): " + _rounded({**calib["base"], **fields}))
        _report_validation(rows, out, "simulator_validation.png", calib)
        return 0
    overrides = {"cores": a.cores or math.inf, "steps": a.steps, **overrides}
    rows = _table(calib, overrides, a.actors, a.learners, a.max_staleness, a.modes)
    print("| actors | learners | mode | s | samples/s | learner idle | actor idle | dropped | staleness 0,1,.. |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['actors']} | {r['learners']} | {r['mode']} | {r['s']} | {r['samples_per_s']:.0f} | "
              f"{100 * r['learner_idle']:.0f}% | {100 * r['actor_idle']:.0f}% | {100 * r['dropped']:.1f}% | "
              + " ".join(f"{x:.2f}" for x in r["staleness"]) + " |")
    if out:
        (out / "simulation.json").write_text(json.dumps({"calibration": calib, "overrides": overrides, "rows": rows},
                                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
