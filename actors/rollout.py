"""The rollout actor process: lease prompts, generate, score, send, swap weights.

One loop on one thread owns the engine and streams: it keeps `actors.max_inflight_seqs` sequences in
flight (leased, or still generating: `actors.inflight_count`), leasing prompt groups under the admission
rule whenever a group fits, steps the engine, and hands each group to the sender thread the moment its n
samples end; acks are waited for off the loop. Weights are swapped between two engine steps
(`actors.weight_update`: `inflight` while sequences run, their samples then spanning two versions; or
`drain` first). The HF engine generates a batch per step, so its swaps fall between batches
(version_start == version_end). On drain or stop, what is in flight is aborted and its leases go back to
the queue.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time

from actors.episodes import EpisodeEngine
from actors.groups import build_episode_group, build_group
from actors.journal import EpisodeJournal
from actors.sender import BackgroundSender, ZmqTrajectorySink
from buffer.schema import Group, Limits
from buffer.store import Leaser, abandon_stale, reclaim_leases, reject_group
from data.tasks import token_ids
from engines.backends import build_engine
from engines.core import PromptRefused, SamplingParams
from rewards.scorers import ScoreError, record_scorer
from runbase.keys import Keys, connect, mark_startup
from runbase.stalls import arm_stall_dump, cancel_stall_dump
from weightsync.backends import subscriber

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.01        # wait between admission attempts when the buffer is full or prompts ran out
HEARTBEAT_S = 1.0         # how often the actor writes its status into the run's membership hash
STARTUP_WAIT_S = 60.0     # how long to wait for the ingest address and the weight backend in Redis
STARTUP_POLL_S = 0.05     # how often it looks while waiting: both appear within a second of a normal start
SEND_FLUSH_S = 120.0      # at exit, how long the sender may take to get its last groups acknowledged
GIL_SWITCH_S = 0.001     # the interpreter's switch interval in an actor (Python's default: 5 ms): the weight
                          # subscriber and the sender threads each need the GIL for a moment per message, and
                          # the engine loop, busy in Python, would hold them off up to the interval every time
STEP_BIN_SEQS = 32        # the heartbeat's step-time profile groups steps by leased sequences in bins this wide
REWARD_ERROR = "reward_error"   # a group whose reward function raised (or returned no number): dead-lettered
PROMPT_REFUSED = "prompt_refused"   # the reason a group the engine cannot take is counted and dead-lettered under
CONTROL_POLL_S = 0.05     # how often the loop reads stop/drain: a round trip every engine step (a few ms
                          # on a GPU) would cost a tenth of a small model's decode; 50 ms is nothing at exit


class RolloutWorker:
    def __init__(self, cfg, *, index: int, run_id: str, redis_url: str, model_path: str, gpu: int | None = None):
        if gpu is not None:  # before anything touches CUDA: this process then sees only its GPU, as cuda:0
            os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
        import torch

        torch.set_num_threads(cfg.actors.torch_threads)
        sys.setswitchinterval(GIL_SWITCH_S)
        self.cfg, self.index = cfg, index
        self.actor_id = f"actor-{index}"
        self.keys = Keys(run_id)
        self.r = connect(redis_url)
        self.model_path = model_path
        self.leaser = Leaser(self.r, self.keys, max_staleness=cfg.buffer.max_staleness,
                             groups_per_step=cfg.learner.groups_per_step, actor_id=self.actor_id,
                             admission=cfg.buffer.admission)
        self.groups_sent = 0
        # actor i sends to ingest shard i % k (buffer.ingest_shards), announced as `address:<shard>`
        self.ingest_field = f"address:{index % cfg.buffer.ingest_shards}"
        # Versions applied while sequences were in flight (weight_update=inflight; their samples span
        # two versions), and versions that arrived during a batch and waited for it (drain, HF engine).
        self.updates_in_flight = 0
        self.updates_mid_batch = 0
        self.held = None  # weight_update=drain: a version received, waiting for the engine to drain
        self.busy_s = 0.0  # seconds with at least one leased group in the engine: production = acked / busy_s
        self.aborted_stale = 0  # groups aborted in flight as too stale to be trained (actors.abort_stale)
        self.steps = StepStats()
        self._stale_below = 0   # versions below this were already looked for in flight
        self._go_on, self._next_control = True, 0.0  # _running's cached answer, and when to ask Redis again

    def _ingest_address(self) -> str:
        deadline = time.monotonic() + STARTUP_WAIT_S
        while (addr := self.r.hget(self.keys.ingest, self.ingest_field)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.actor_id}: no ingest address in Redis after {STARTUP_WAIT_S}s")
            time.sleep(STARTUP_POLL_S)
        return addr.decode()

    def _heartbeat(self, engine, weights) -> None:
        self.r.hset(self.keys.members, self.actor_id, json.dumps({
            "version": engine.version, "checksum": engine.checksum, "host": socket.gethostname(),
            "pid": os.getpid(), "engine": self.cfg.actors.engine, "groups": self.groups_sent,
            "updates_mid_batch": self.updates_mid_batch, "updates_in_flight": self.updates_in_flight,
            "busy_s": round(self.busy_s, 3), "aborted_stale": self.aborted_stale, **self.steps.heartbeat(),
            "weights_received": weights.received, "weights_receive_s": round(weights.receive_s_sum, 4),
            "weights_phase_s": {k: round(v, 4) for k, v in dict(weights.phase_s).items()},
            **(engine.stats() if hasattr(engine, "stats") else {}), "heartbeat": time.time()}))

    def run(self) -> int:
        a = self.cfg.actors
        if not self._running():
            # drained (scaled up, then down again) or the job stopped before this process got here: building the
            # engine would take seconds to minutes (and, with vLLM on a GPU, its memory) for nothing, and hold up
            # the job's end by as long (seen: two actors scaled up and down again each built a vLLM engine, 15 s)
            log.info("%s: %s before its engine was built; exiting", self.actor_id,
                     "stopped" if self.r.exists(self.keys.stop) else "drained")
            return 0
        engine = build_engine(a, self.model_path, seed=a.seed + self.index, lora=self.cfg.learner.lora)
        if self.cfg.env.multi_turn:   # every sample an episode: the environment answers each turn
            engine = EpisodeEngine(engine, self.cfg.env, max_tokens=self.cfg.env.episode_tokens(self.cfg.buffer),
                                   journal=EpisodeJournal(self.r, self.keys))
        mark_startup(self.r, self.keys, self.actor_id, "engine")
        limits = Limits(vocab_size=engine.vocab_size, max_response_tokens=self.cfg.buffer.max_response_tokens,
                        max_message_bytes=self.cfg.buffer.max_message_bytes)
        self._ingest_address()  # wait for the first ingest; later ones (restarts) are followed
        sink = ZmqTrajectorySink(lambda: (self.r.hget(self.keys.ingest, self.ingest_field) or b"").decode(), limits,
                                 server_public=lambda: self.r.hget(self.keys.ingest, "curve_public"))
        sender = BackgroundSender(sink)
        weights = self._subscriber()
        reward_fn = record_scorer(self.cfg.data.reward_options())  # keyed by each prompt's data_source
        params = SamplingParams(n=a.n, temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_tokens,
                                eos_logit_bias=a.eos_logit_bias)
        import torch
        torch.manual_seed(a.seed + self.index)
        try:
            self._loop(engine, weights, sender, params, reward_fn)
            # The job is over when the launcher sets stop after the learner returned (its publications
            # are synchronous, so none can count on us any more; closing below needs no quiet period)
            # or as it kills everything (close()). Otherwise we were drained from a running job.
            job_over = self.r.exists(self.keys.stop)
            aborted = engine.abort()  # their leases go back to the queue below, once the sender's acks are in
            if aborted:
                log.info("%s: aborted %d groups in flight", self.actor_id, len(aborted))
            sender.close(SEND_FLUSH_S)
            self.groups_sent = sender.groups_sent
            if job_over:
                try:  # end on the newest weights received (nothing is in flight any more)
                    self._swap(weights, engine)
                except Exception as e:  # the run's result is the learner's; report, do not fail the drain
                    log.warning("%s: the last weight version could not be loaded: %s", self.actor_id, e)
            self._heartbeat(engine, weights)
            n = self.groups_sent * self.cfg.actors.n
            log.info("%s: %d samples acked in %.1f s holding leases: %.1f samples/s of production", self.actor_id,
                     n, self.busy_s, n / max(self.busy_s, 1e-9))
            if not job_over:
                weights.leave()  # serve any publication that still counts on us
            self._return_leases(len(aborted))
            return self.groups_sent
        finally:
            cancel_stall_dump()
            sender.close(0, quiet=True)
            weights.close()
            if hasattr(engine, "close"):   # an EpisodeEngine: its environment threads and tool runner
                engine.close()

    def _loop(self, engine, weights, sender, params, reward_fn) -> None:
        """Until stop or drain: swap weights between steps, lease while there is room, step, send."""
        a, prompts = self.cfg.actors, {}
        target, last_beat, next_lease = a.inflight_target(), 0.0, 0.0
        last, busy, first = time.monotonic(), False, True   # first: no group has finished yet
        while self._running():
            now = time.monotonic()
            self.busy_s += (now - last) * busy  # the last turn counts if it stepped leased sequences
            last, busy = now, False
            sender.check()
            self._swap(weights, engine)
            self._abort_stale(engine, prompts)
            if time.monotonic() - last_beat > HEARTBEAT_S:
                self.groups_sent = sender.groups_sent
                self._heartbeat(engine, weights)
                arm_stall_dump(self.cfg.cluster.actor_stall_s)
                last_beat = time.monotonic()
            counted = engine.decoding() if a.inflight_count == "running" else engine.in_flight()
            room = (target - counted) // a.n
            if room > 0 and self.held is None and time.monotonic() >= next_lease:
                want = min(room, a.groups_per_batch)
                leased = self._lease(engine, params, want, prompts)
                if leased is None and not engine.in_flight():  # our weights are too old to be trained on: wait
                    weights.wait(0.1)
                    continue
                if leased is None or len(leased) < want:  # admission or the queue is short: not every step
                    next_lease = time.monotonic() + IDLE_POLL_S
            if not engine.in_flight():
                time.sleep(IDLE_POLL_S)
                continue
            received, busy = weights.received, True
            finished = self.steps.step(engine)
            self.updates_mid_batch += weights.received > received and a.engine == "hf"
            if finished:
                if first:
                    mark_startup(self.r, self.keys, self.actor_id, "first_group")
                    first = False
                groups = []
                for gid, comps in finished:
                    try:
                        groups.append(self._group(engine, prompts.pop(gid), gid, comps, reward_fn))
                    except ScoreError as e:   # this prompt only: its lease released, the books count it
                        reject_group(self.r, self.keys, reason=REWARD_ERROR, error=str(e), gid=gid,
                                     deadletter_maxlen=self.cfg.buffer.deadletter_maxlen)
                        log.warning("%s: group %s dead-lettered (%s): %s", self.actor_id, gid, REWARD_ERROR, e)
                if groups:
                    sender.put(groups)

    def _running(self) -> bool:
        """Neither stop nor our drain is set; read from Redis at most every CONTROL_POLL_S."""
        now = time.monotonic()
        if now >= self._next_control:
            pipe = self.r.pipeline(transaction=False)
            pipe.exists(self.keys.stop)
            pipe.exists(self.keys.drain(self.actor_id))
            self._go_on = not any(pipe.execute())
            self._next_control = now + CONTROL_POLL_S
        return self._go_on

    def _lease(self, engine, params, want: int, prompts: dict):
        """Lease up to `want` groups and submit them; None when our weights are too old to be trained on."""
        leased = self.leaser.lease(want, engine.version)
        for gid, p in leased or []:
            try:
                if self.cfg.env.multi_turn:   # the environment's first messages, in the chat template
                    ids = engine.start(gid, p, params)
                else:   # dataset prompts arrive tokenized (chat template applied by the learner); the built-in task as text
                    ids = token_ids(p, engine.tokenizer)
                    engine.submit(gid, ids, params)
            except PromptRefused as e:   # this prompt only (too long for actors.max_model_len): never retried
                reject_group(self.r, self.keys, reason=PROMPT_REFUSED, error=str(e), gid=gid,
                             deadletter_maxlen=self.cfg.buffer.deadletter_maxlen)
                log.warning("%s: group %s dead-lettered (%s): %s", self.actor_id, gid, PROMPT_REFUSED, e)
                continue
            prompts[gid] = (p, ids, time.time())
        return leased

    def _swap(self, weights, engine) -> None:
        """The newest weights into the engine, by actors.weight_update: at once between two steps
        (inflight), or once nothing is in flight (drain, and the HF engine, which has nothing in
        flight between its batch steps)."""
        if (new := weights.take()) is not None:
            self.held = new
        if self.held is None:
            return
        busy = engine.in_flight() > 0
        if busy and self.cfg.actors.weight_update == "drain":
            return
        self.updates_in_flight += busy
        new, self.held = self.held, None
        engine.load_weights(new.state_dict, new.version, new.checksum, verified=True)  # the subscriber checked it

    def _abort_stale(self, engine, prompts: dict) -> None:
        """Abort the groups in flight that started more than s versions before the newest weights we hold
        (the learner, which published them, is at least as far on and would drop those groups on arrival):
        their leases are counted as stale drops now, which frees their admission slots for groups that can
        be trained, and their long tails stop taking engine steps."""
        if not self.cfg.actors.abort_stale:
            return
        newest = engine.version if self.held is None else max(engine.version, self.held.version)
        below = newest - self.cfg.buffer.max_staleness
        if below <= self._stale_below:  # only a newer version can make more groups too stale
            return
        self._stale_below = below
        if gids := engine.abort(started_before=below):
            for gid in gids:
                prompts.pop(gid, None)
            self.aborted_stale += abandon_stale(self.r, self.keys, gids)
            log.debug("%s: aborted %d groups in flight started before version %d", self.actor_id, len(gids), below)

    def _subscriber(self):
        return subscribe(self.r, self.keys, self.cfg, self.actor_id)

    def _return_leases(self, aborted: int) -> None:
        """Every lease still in our name goes back to the queue, so a clean exit leaves nothing in flight: those
        of the `aborted` groups, and any we never saw (a lease retried across a Redis restart whose first reply
        was lost), which alone are worth a warning."""
        n = reclaim_leases(self.r, self.keys, self.actor_id)
        if n > aborted:
            log.warning("%s: returned %d leases it never received to the queue", self.actor_id, n - aborted)
        if n:
            log.info("%s: returned %d leases to the queue (%d of groups aborted at exit)", self.actor_id, n,
                     min(n, aborted))

    def _group(self, engine, leased, gid: str, comps, reward_fn) -> Group:
        p, ids, t0 = leased
        if self.cfg.env.multi_turn:   # `comps` are the group's ended episodes, rewarded by their environment
            return build_episode_group(gid, p, ids, comps, actor_id=self.actor_id, created_at=t0)
        return build_group(gid, p, ids, comps, score=reward_fn, tokenizer=engine.tokenizer, actor_id=self.actor_id,
                           created_at=t0)


class StepStats:
    """An actor's engine steps as its heartbeat reports them."""

    def __init__(self):
        # engine steps taken and seconds inside them by occupancy, bin (leased // STEP_BIN_SEQS) -> [steps,
        # seconds] (their sums are the heartbeat's engine_steps and step_s; a run's mean step hides how the step
        # grows with the sequences in flight, convex beside the learner: the simulator's engine curve), and the
        # leased sequences in flight at each step (samples of groups not yet returned: those that ended early
        # count until their group does, so an upper bound on what the engine stepped), for bench.run_summary
        self.profile: dict[int, list] = {}
        self.leased_seqs = 0
        # after each step, what the engine's scheduler holds (vLLM in process): sequences running and waiting
        # (for a slot or for KV cache), summed over the steps it could say, and the most KV cache in use
        self.occupied_steps, self.running_seqs, self.waiting_seqs, self.kv_usage_max = 0, 0, 0, 0.0

    def step(self, engine) -> list:
        """One engine step, counted: its latency and the leased sequences in flight go into the heartbeat."""
        leased = engine.in_flight()
        self.leased_seqs += leased
        t = time.monotonic()
        finished = engine.step()
        binned = self.profile.setdefault(leased // STEP_BIN_SEQS, [0, 0.0])
        binned[0] += 1
        binned[1] += time.monotonic() - t
        if (occ := engine.occupancy()) is not None:
            self.occupied_steps += 1
            self.running_seqs += occ[0]
            self.waiting_seqs += occ[1]
            self.kv_usage_max = max(self.kv_usage_max, occ[2])
        return finished

    def heartbeat(self) -> dict:
        """The heartbeat's fields of the steps so far."""
        steps, step_s = sum(n for n, _ in self.profile.values()), sum(s for _, s in self.profile.values())
        return {"engine_steps": steps, "step_s": round(step_s, 3), "leased_seqs": self.leased_seqs,
                "occupied_steps": self.occupied_steps, "running_seqs": self.running_seqs,
                "waiting_seqs": self.waiting_seqs, "kv_usage_max": round(self.kv_usage_max, 4), "step_profile": {
                    str(b * STEP_BIN_SEQS): [n, round(s, 4)] for b, (n, s) in sorted(self.profile.items())}}


def subscribe(r, keys, cfg, member_id: str):
    """A weight subscriber of the backend the learner announced in Redis (the launcher resolved `auto`)."""
    deadline = time.monotonic() + STARTUP_WAIT_S
    while (backend := r.hget(keys.ws, "backend")) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{member_id}: the learner announced no weight backend in {STARTUP_WAIT_S}s")
        time.sleep(STARTUP_POLL_S)

    return subscriber(backend.decode(), r, keys, member_id=member_id, timeout_s=cfg.weightsync.timeout_s,
                      device=cfg.actors.device)
