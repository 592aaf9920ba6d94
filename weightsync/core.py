"""Abstract bases of the weight plane: learner rank 0 publishes, every actor subscribes."""
from __future__ import annotations

import abc
import contextlib
import json
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass

import torch

from weightsync.flat import layout, plan_buckets

log = logging.getLogger(__name__)

CHECKSUMS_KEPT = 100   # newest versions whose checksum stays in `<run>:checksums` (and status.json), beside
                       # version 0: one entry a version grew both without end (2M a week at 0.3 s a step)


@dataclass
class WeightVersion:
    """A complete set of weights received by an actor, ready to swap in."""
    version: int
    checksum: str
    state_dict: dict[str, torch.Tensor]


class WeightPublisher(abc.ABC):
    """One publication attempt = begin(), send() per bucket in plan order, finish().

    Bucket i is handed over while the caller gathers bucket i+1; finish() returns the version's
    checksum once every member holds it, or None if the attempt failed (retry: members that
    went silent are left out of the next one)."""

    r: object
    """The run's Redis client: layout, announcements, checksums and membership go through it."""
    keys: object
    """The run's Redis keys (runbase.keys.Keys)."""
    layout: list[list] | None = None
    """The tensor layout every version has (weightsync.flat.layout), fixed by the first one published."""
    version_bytes: int = 0
    """Bytes of one version as it travels (every tensor in the layout, in its wire dtype)."""
    version: int
    """The version of the attempt begun last."""
    members: list[str]
    """The members the current attempt sends to, sorted (one epoch's membership)."""
    epoch: int
    """The membership epoch: raised whenever the members of an attempt differ from the previous one's."""
    error: BaseException | None
    """Why the current attempt failed (None while it goes well): finish() then returns None."""
    t0: float
    """time.monotonic() at the current attempt's begin()."""
    stats: dict[str, float]
    """The last attempt's publish_s, acks_s (its finish(): the members' side), members, epoch and bytes (the
    learner's metrics line)."""

    @abc.abstractmethod
    def begin(self, version: int, lay: list[list], buckets: list[dict], members: list[str] | None = None) -> None:
        """Start an attempt to `members` (default: every live member; weightsync/join.py names joiners)."""

    def live_members(self) -> list[str]:
        return live_members(self.r, self.keys)

    def _check_layout(self, lay: list[list]) -> None:
        """The first version fixes the layout (subscribers read it once from Redis)."""
        if self.layout is None:
            self.layout = lay
            self.version_bytes = sum(math.prod(shape) * torch.empty(0, dtype=getattr(torch, dt)).element_size()
                                     for _, dt, shape, _ in lay)
            self.r.hset(self.keys.ws, "layout", json.dumps(lay))
        elif lay != self.layout:
            raise ValueError("model layout changed between versions; weight sync needs a fixed layout")

    def _conclude(self, csum: str, finish_t0: float) -> str | None:
        """End of an attempt (its finish() began at `finish_t0`): stats, and the checksum recorded in Redis only if
        every member has it."""
        now = time.monotonic()
        self.stats = {"publish_s": now - self.t0, "acks_s": now - finish_t0, "members": len(self.members),
                      "epoch": self.epoch, "bytes": self.version_bytes}
        if self.error is not None:
            return None
        self.r.hset(self.keys.checksums, self.version, csum)
        trim_checksums(self.r, self.keys.checksums, self.version)
        return csum

    def _announce(self, version: int, epoch: int, members: list[str], buckets: list[dict], backend: str) -> None:
        # Before any member can hold it: the ingest's bound on versions. Only ever raised (ZADD GT):
        # a joining actor may be sent an older version than one already begun.
        self.r.zadd(self.keys.ws_begun, {"v": version}, gt=True)
        self.r.xadd(self.keys.ws_announce, {"v": version, "epoch": epoch, "backend": backend,
                                            "ranks": json.dumps({a: i + 1 for i, a in enumerate(members)}),
                                            "buckets": json.dumps([[b["dtype"], b["start"], b["end"]] for b in buckets])},
                    maxlen=ANNOUNCE_MAXLEN, approximate=True)

    @abc.abstractmethod
    def send(self, bucket: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> None: ...

    @abc.abstractmethod
    def finish(self) -> str | None: ...

    def publish(self, version: int, state_dict: dict[str, torch.Tensor], bucket_bytes: int = 2**30,
                keep=None) -> str | None:
        """A whole, already gathered state dict in one attempt (tests, benchmarks); `keep`: a
        weightsync.join.LastVersion that keeps it for members joining later, as the learner's does."""

        lay = layout(state_dict)
        buckets = plan_buckets(lay, bucket_bytes)
        self.begin(version, lay, buckets)
        if keep is not None:
            keep.begin(version, lay, buckets)
        for b in buckets:
            named = [(n, state_dict[n]) for n in b["names"]]
            self.send(flat := flatten(named), named)
            if keep is not None:
                keep.put(b, flat)
        if keep is not None:
            keep.complete()
        return self.finish()

    def close(self) -> None:
        pass


ANNOUNCE_MAXLEN = 1000   # announcements kept (only the newest matters to anyone)
HEARTBEAT_S = 0.5        # how often a subscriber says it is alive and listening
# The GIL's switch interval (process-wide) while a subscriber receives a version. At each blocking point of a receive
# (a Redis round trip, a copy's sync, a collective) its thread waits for the GIL behind the actor's engine loop, a
# busy Python thread, up to the interval: at Python's default 5 ms a round trip took ~7 ms, 20 of them 131-152 ms
# against 12-14 ms at 0.5 ms (2-core VM); a version's fixed cost of tens of ms was mostly these waits.
RECEIVE_SWITCH_S = 5e-4
MEMBER_STALE_S = 3.0     # silent this long: left out of the next epoch (6 missed heartbeats)


class WeightSubscriber(abc.ABC):
    """An actor's side: a receiver thread (`_receive_loop`, per backend) and a heartbeat thread.

    Complete, checksum-verified versions are handed over through `_deliver`; the actor takes
    them between batches with `take()`. A receiver failure is raised by the next `take()`.
    """

    def __init__(self, r, keys, *, actor_id: str, timeout_s: float):
        self.r, self.keys, self.actor_id, self.timeout_s = r, keys, actor_id, timeout_s
        self._lock = threading.Lock()
        self._pending: WeightVersion | None = None
        self._event, self._stop, self._leaving = threading.Event(), threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.received = 0          # versions fully received (the actor sees mid-batch arrivals by it)
        self.held = 0              # the version delivered last (0: the base model the actor starts on)
        self.failed_attempts = 0   # publication attempts that broke off (a member died)
        self.receive_s_sum = 0.0   # over versions received: from taking up a version's first message to its delivery
        self.phase_s: dict[str, float] = {}   # the same time by phase of a receive (a backend names its phases)
        self._version_phase_s: dict[str, float] = {}   # the version arriving now's (its log line)
        self._switch: float | None = None   # the GIL's switch interval before a receive shortened it
        self._since: float | None = None    # when the version arriving now was taken up

    def _start(self) -> None:
        # an earlier process of this id (restarted, resumed job) left the version it held: not ours, and
        # we are not listening yet (the receive loop marks us once it is; weightsync/join.py)
        self.r.hdel(self.keys.ws_held, self.actor_id)
        threading.Thread(target=self._heartbeat, name=f"ws-beat-{self.actor_id}", daemon=True).start()
        self._thread = threading.Thread(target=self._guarded, name=f"ws-recv-{self.actor_id}", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        failing = False
        while not self._stop.is_set() and not self._leaving.is_set():
            try:
                self.r.hset(self.keys.ws_members, self.actor_id, time.time())
                failing = False
            except Exception as e:  # Redis gone: the actor's own loop fails loudly; say it once here
                if not failing:
                    log.warning("weight-sync heartbeat of %s failed: %s", self.actor_id, e)
                failing = True
            self._stop.wait(HEARTBEAT_S)

    def _guarded(self) -> None:
        try:
            self._receive_loop()
        except BaseException as e:  # surfaced to the actor's loop by take()
            self.error = e
            self._event.set()

    @abc.abstractmethod
    def _receive_loop(self) -> None: ...

    def _receiving(self) -> None:
        """A version is arriving: the GIL comes to this thread within RECEIVE_SWITCH_S at each blocking point."""
        if self._since is None:
            self._since = time.monotonic()
        if self._switch is None and RECEIVE_SWITCH_S < sys.getswitchinterval():
            self._switch = sys.getswitchinterval()
            sys.setswitchinterval(RECEIVE_SWITCH_S)

    def _received(self) -> None:
        """The version is in (or the attempt over): the engine loop keeps the GIL as long as before."""
        self._since = None
        if (before := self._switch) is not None:
            sys.setswitchinterval(before)
            self._switch = None

    def _timed(self, phase: str, t0: float) -> float:
        """Add the time since `t0` to `phase`; returns now (the next phase's start)."""
        now = time.monotonic()
        self._add(phase, now - t0)
        return now

    def _add(self, phase: str, seconds: float) -> None:
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds
        self._version_phase_s[phase] = self._version_phase_s.get(phase, 0.0) + seconds

    def _mark(self, version: int) -> None:
        """Tell the learner's join server which version we hold or are receiving (weightsync/join.py)."""
        self.r.hset(self.keys.ws_held, self.actor_id, version)

    def _deliver(self, version: int, checksum: str, state_dict: dict) -> None:
        self.held = version
        self._mark(version)
        with self._lock:
            self._pending = WeightVersion(version=version, checksum=checksum, state_dict=state_dict)
            self.received += 1
            took = time.monotonic() - self._since if self._since is not None else None
            if took is not None:   # _since is set by _receiving, which every backend calls before delivering
                self.receive_s_sum += took
        if took is not None:
            phases = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in self._version_phase_s.items())
            log.info("%s received version %d in %.1f ms%s", self.actor_id, version, 1e3 * took,
                     f" ({phases})" if phases else "")
        self._version_phase_s = {}
        self._event.set()

    def take(self) -> WeightVersion | None:
        """The newest fully received version not yet taken, or None. Never a partial one."""
        if self.error is not None:
            raise RuntimeError(f"weight subscriber of {self.actor_id} failed: {self.error}") from self.error
        with self._lock:
            p, self._pending = self._pending, None
            self._event.clear()
        return p

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def leave(self, timeout: float = 2 * MEMBER_STALE_S + 5) -> None:
        """Stop being a member, still serving any publication that already counts on us."""
        self._leaving.set()
        self.r.hdel(self.keys.ws_members, self.actor_id)
        self._thread.join(timeout)

    def close(self) -> None:
        self._stop.set()


def flatten(named: list[tuple[str, torch.Tensor]], *, copy: bool = False) -> torch.Tensor:
    """One bucket as one flat tensor. A bucket of a single tensor (one larger than the bucket size)
    is sent as a view of it, not a copy: peak extra memory stays about two buckets, whatever the
    largest tensor (the embedding and the LM head of a 7B model are 1 GiB each). `copy`: always a
    copy (the learner trains on while an overlapped publication is still being read)."""
    if len(named) == 1 and named[0][1].is_contiguous() and not copy:
        return named[0][1].detach().reshape(-1)
    return torch.cat([t.detach().reshape(-1) for _, t in named])



@contextlib.contextmanager
def short_switch():
    """The GIL's switch interval at RECEIVE_SWITCH_S for a block (a publisher's wait for acks on a thread beside the
    learner's next step, which keeps the GIL between kernel launches): each reply is taken up within it."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, RECEIVE_SWITCH_S))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def live_members(r, keys) -> list[str]:
    """Actors whose weight subscriber was heard from within MEMBER_STALE_S, sorted."""
    now = time.time()
    return sorted(a.decode() for a, ts in r.hgetall(keys.ws_members).items() if now - float(ts) < MEMBER_STALE_S)


def trim_checksums(r, key: str, newest: int) -> int:
    """Drop the checksums of versions older than the newest CHECKSUMS_KEPT, keeping version 0's (the
    weights a run started from); the number dropped."""
    old = [f for f in r.hkeys(key) if 0 < int(f) <= newest - CHECKSUMS_KEPT]
    return r.hdel(key, *old) if old else 0
