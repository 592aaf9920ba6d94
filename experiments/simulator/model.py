"""The simulator's model of the system: the admission rule and the engines' step as pure functions, and the
discrete-event loop (`simulate`) over rollout actors, the ingest and the learner ranks."""
from __future__ import annotations

import bisect
import heapq
import math
import random
from dataclasses import asdict

from buffer.staleness import admissible, admission_cap, lease_version
from experiments.simulator.config import WARMUP_STEPS, SimConfig, SimResult


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

def group_lengths(c: SimConfig, group: int) -> tuple[float, float]:
    """(mean, sigma) of the lengths of the group with `group` groups to be trained before it (admitted so far
    less those dropped: len_schedule, else fixed). Groups are trained in about the order they are admitted,
    so it is trained at step group // G: the step whose measured lengths the schedule holds (by lease
    version it would be s steps off, and with half the groups dropped, twice as far)."""
    if not c.len_schedule:
        return c.len_mean, c.len_sigma
    return c.len_schedule[min(group // c.groups_per_step // c.len_window, len(c.len_schedule) - 1)]


class _Clock:
    """Processor sharing with a virtual clock: every running job advances at the same rate min(1, cores /
    running), so job j ends when the virtual time reaches its start virtual time plus its work, and one heap
    ordered by that end orders all completions. Timers are waits that take no core."""

    def __init__(self, cores: float):
        self.cores = cores               # the cores the simulated processes share (inf: one device each)
        self.t = 0.0
        self.v = 0.0                     # virtual time: work done by any one running job so far
        self.heap: list = []             # (virtual end, seq, owner, kind, payload)
        self.seq = 0
        self.running = 0
        self.timers: list = []           # (real end, seq, owner, kind, payload): waits that take no core

    def rate(self) -> float:
        return 1.0 if self.running == 0 else min(1.0, self.cores / self.running)

    def start_timer(self, owner, kind, seconds, payload=None):
        heapq.heappush(self.timers, (self.t + seconds, self.seq, owner, kind, payload))
        self.seq += 1

    def start_job(self, owner, kind, work, payload=None):
        heapq.heappush(self.heap, (self.v + max(work, 0.0), self.seq, owner, kind, payload))
        self.seq += 1
        self.running += 1

    def next_event(self) -> tuple[bool, object, str, object]:
        """The clock moved to the next timer or job end: (it is a timer, owner, kind, payload)."""
        if not self.heap and not self.timers:
            raise RuntimeError("simulated system deadlocked (no job running, learner waiting)")
        t_cpu = self.t + (self.heap[0][0] - self.v) / self.rate() if self.heap else math.inf
        if self.timers and self.timers[0][0] <= t_cpu:
            t_end, _, owner, kind, payload = heapq.heappop(self.timers)
            self.v += (t_end - self.t) * self.rate() if self.heap else 0.0
            self.t = t_end
            return True, owner, kind, payload
        vend, _, owner, kind, payload = heapq.heappop(self.heap)
        self.t = t_cpu
        self.v = vend
        self.running -= 1
        return False, owner, kind, payload


class _Engines:
    """The streaming actors' engines (actor_mode=stream): per actor the engine steps taken, the samples still
    decoding (rows), and heaps of the engine step at which each in-flight sample and each in-flight group ends
    (with its version_start); what the engines stepped, for the heartbeat's means."""

    def __init__(self, c: SimConfig):
        self.c = c
        self.estep = [0] * c.actors
        self.rows = [0] * c.actors
        self.sample_ends: list[list[int]] = [[] for _ in range(c.actors)]
        self.group_ends: list[list] = [[] for _ in range(c.actors)]
        self.group_tokens: dict[int, int] = {}   # tokens of each group in flight, by its seq
        self.finished_groups = [0] * c.actors  # sent at the last step: their decode/score/encode CPU
        self.aborted: set[int] = set()            # group seqs aborted in flight (their sample ends are skipped)
        self.aborted_groups = 0
        self.log = [0, 0.0, 0, 0]                 # engine steps, their seconds, leased and running sequences

    def counted(self, i: int) -> int:
        """What actors.inflight_count counts: engine.in_flight(), whole groups until sent; engine.decoding(),
        the rows still decoding."""
        return self.rows[i] if self.c.inflight_count == "running" else len(self.group_ends[i]) * self.c.n

    def add_group(self, i: int, lengths: list[int], seq: int, version: int) -> None:
        """A leased group's samples enter actor i's engine (their prefill rides on its next step)."""
        for n_tokens in lengths:
            heapq.heappush(self.sample_ends[i], (self.estep[i] + n_tokens, seq))
        self.group_tokens[seq] = sum(lengths)
        heapq.heappush(self.group_ends[i], (self.estep[i] + max(lengths), seq, version))
        self.rows[i] += self.c.n

    def step_work(self, i: int, work: float, slow: float) -> float:
        """Actor i's next engine step: its seconds (beyond `work`, the loop's own, all times `slow`), logged."""
        leased = len(self.group_ends[i]) * self.c.n
        work = (work + engine_step_s(self.c, self.rows[i], leased)) * slow
        self.log[0] += 1
        self.log[1] += work
        self.log[2] += leased
        self.log[3] += self.rows[i]
        return work

    def step_done(self, i: int):
        """An engine step of actor i ended: samples at their last token leave the batch; yields each group that
        ended, as the buffer takes it: (1, version_start, tokens)."""
        self.estep[i] += 1
        ends = self.sample_ends[i]
        while ends and ends[0][0] <= self.estep[i]:
            _end, g = heapq.heappop(ends)
            self.rows[i] -= g not in self.aborted  # an aborted group's rows left when it was aborted
        groups = self.group_ends[i]
        while groups and groups[0][0] <= self.estep[i]:
            _end, seq, ver = heapq.heappop(groups)
            self.finished_groups[i] += 1
            yield (1, ver, self.group_tokens.pop(seq))

    def abort_stale(self, i: int, below: int) -> int:
        """Actor i's groups in flight started under weights older than `below` leave its engine now; how many."""
        doomed = {g for _end, g, ver in self.group_ends[i] if ver < below}
        if not doomed:
            return 0
        self.group_ends[i] = [e for e in self.group_ends[i] if e[1] not in doomed]
        heapq.heapify(self.group_ends[i])
        self.rows[i] -= sum(1 for end, g in self.sample_ends[i] if g in doomed and end > self.estep[i])
        self.aborted |= doomed
        for g in doomed:
            del self.group_tokens[g]
        self.aborted_groups += len(doomed)
        return len(doomed)

    def means(self, trained_tokens: int) -> dict:
        steps, seconds, leased, rows = self.log
        return {"engine_step_ms": 1e3 * seconds / steps, "leased_inflight": leased / steps,
                "running": rows / steps, "trained_share": trained_tokens / rows} if steps else {}


class _Ingest:
    """The one ingest process: it stores batches one at a time, in the order they come; the learner sees a
    batch once it is stored."""

    def __init__(self, clock: _Clock, seconds: float):
        self.clock, self.seconds = clock, seconds
        self.queue: list = []      # batches waiting for the ingest process
        self.busy = False

    def put(self, batch=None) -> None:
        """Queue `batch` (if any) and start storing the next one when the process is free."""
        if batch is not None:
            self.queue.append(batch)
        if not self.busy and self.queue:
            self.busy = True
            self.clock.start_job(("ingest", 0), "store", self.seconds, self.queue.pop(0))


class _Sim(_Clock):
    """The system on the processor-shared clock: actors (batch, or streaming through _Engines), the ingest
    and the learner ranks."""

    def __init__(self, c: SimConfig):
        super().__init__(c.cores - c.background_cores)
        self.c = c
        self.rng = random.Random(c.seed)
        self.version = 0                 # the learner version admission sees (set after publication)
        self.weights_version = 0         # the newest weights actors can swap in (weights_lag_s after it)
        self.started = 0                 # groups admitted (the admission counter)
        self.dropped = 0
        self.buffer: list[tuple[int, int]] = []  # (version_start, tokens; 0 for batches) of finished groups, FIFO
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
        self.ingest = _Ingest(self, c.system_batch_s)
        self.engines = _Engines(c)

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
            self.rng, c.n, *group_lengths(c, self.started - self.dropped), c.max_tokens, c.len_group_share)]
        self.started += k
        steps = max(lengths)
        work = c.gen_batch_s + steps * (c.gen_step_s + c.gen_step_row_s * k * c.n) + c.actor_batch_overhead_s
        self._busy_actor(i, True)
        self.start_job(("actor", i), "gen", work, (k, self.actor_ver[i]))

    def _stream_turn(self, i: int) -> None:
        """One turn of the streaming actor's loop: swap weights, lease while there is room, take an engine
        step; with nothing in flight and no lease granted it waits to be woken (publication, drops)."""
        c, e = self.c, self.engines
        if self.actor_ver[i] < self.weights_version:   # between two engine steps, sequences in flight continue
            self.actor_ver[i] = self.weights_version
            if c.load_s > 0:
                self._busy_actor(i, True)
                self.start_job(("actor", i), "load", c.load_s)
                return
        if c.abort_stale:
            self._abort_stale(i)
        room = (c.inflight_target - e.counted(i)) // c.n
        work = c.actor_batch_overhead_s * e.finished_groups[i]
        e.finished_groups[i] = 0
        k = lease_rule(self.version, c.s, c.groups_per_step, self.actor_ver[i], self.started, self.dropped,
                       min(room, c.groups_per_batch), c.admission) if room > 0 else 0
        if k > 0:
            for j in range(k):
                lengths = response_lengths(self.rng, c.n, *group_lengths(c, self.started - self.dropped + j),
                                           c.max_tokens, c.len_group_share)
                e.add_group(i, lengths, self.seq, self.actor_ver[i])
                self.seq += 1
            self.started += k
            work += c.gen_batch_s * k / c.groups_per_batch   # the new prompts' prefill rides on this step
        if e.rows[i] == 0:
            self._busy_actor(i, False)
            self.blocked.add(i)
            return
        self._busy_actor(i, True)
        slow = 1 + c.actor_contention if self.learner_state == "train" else 1.0
        self.start_job(("actor", i), "estep", e.step_work(i, work, slow))

    def _stream_step_done(self, i: int) -> None:
        """An engine step ended: finished groups are sent."""
        for group in self.engines.step_done(i):
            if self.c.delivery_s > 0:
                self.start_timer(("delivery", 0), "deliver", self.c.delivery_s, group)
            else:
                self._deliver(group)

    def _deliver(self, group) -> None:
        """A streamed group reaches the buffer (through the one ingest process when it has a cost)."""
        if self.c.system_batch_s > 0:
            self.ingest.put((*group, None))  # the sender waits for the ack, the actor does not
        else:
            self.stored(group)

    def _abort_stale(self, i: int) -> None:
        """actors.abort_stale: groups in flight started more than s versions before the actor's weights
        would be dropped on arrival; they leave the engine now and count as drops (slots freed)."""
        if doomed := self.engines.abort_stale(i, self.actor_ver[i] - self.c.s):
            self.dropped += doomed
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
        generating = any(self.engines.rows) if c.actor_mode == "stream" else \
            any(t is not None for t in self.actor_since)
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

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> SimResult:
        for i in range(self.c.actors):
            self.actor_try(i)
        while self.step < self.c.steps:
            timer, owner, kind, payload = self.next_event()
            if timer:
                self._timer_done(kind, payload)
            elif owner[0] == "actor":
                self._actor_done(owner[1], kind, payload)
            elif owner[0] == "ingest":
                self.ingest.busy = False
                *batch, i = payload              # (groups, version_start[, tokens], the actor waiting or None)
                self.stored(tuple(batch))
                if i is not None:                # a batch actor waited for this ack
                    self.actor_try(i)
                self.ingest.put()
            else:
                self._learner_done(kind)
        return self._result()

    def _timer_done(self, kind: str, payload) -> None:
        if kind == "weights":   # a version's weights reached the actors
            self.weights_version = max(self.weights_version, payload)
            self.wake_actors()
        elif kind == "deliver":  # a streamed group's send, ack and buffer write took their time
            self._deliver(payload)
        else:                   # the learner's non-CPU wait before training
            self.learner_train()

    def _actor_done(self, i: int, kind: str, payload) -> None:
        if kind == "gen" and self.c.system_batch_s > 0:
            self.ingest.put((*payload, i))  # the actor's send blocks until the ingest acks (stored)
            return
        if kind == "gen":
            self.stored(payload)
        elif kind == "estep":
            self._stream_step_done(i)
        self.actor_try(i)

    def _result(self) -> SimResult:
        c = self.c
        for i in range(c.actors):
            self._busy_actor(i, False)
        body = self.step_ends[WARMUP_STEPS:]
        sps = (len(body) - 1) * c.groups_per_step * c.n / (body[-1] - body[0])
        total = self.t
        trained = c.steps * c.groups_per_step
        return SimResult(samples_per_s=sps, staleness_hist=self.hist, learner_idle=1 - self.learner_busy / total,
                         actor_idle=1 - sum(self.actor_busy) / (c.actors * total),
                         dropped_frac=self.dropped / (trained + self.dropped), aborted=self.engines.aborted_groups,
                         **self.engines.means(self.trained_tokens),
                         step_end_times=self.step_ends,
                         config=asdict(c))


def simulate(c: SimConfig) -> SimResult:
    return _Sim(c).run()
