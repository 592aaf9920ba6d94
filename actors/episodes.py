"""Multi-turn episodes through the streaming engine, for the rollout actor (env.name set).

`EpisodeEngine` wraps an engine and keeps the rollout loop's view of it: `start` a leased group (its n
episodes reset, their first turns submitted), `step` (the engine steps; finished turns go to a thread pool
where the environment answers them; each episode's next turn is submitted the moment its answer is back,
so tool calls of some episodes overlap the decoding of others), and groups come back once all n of their
episodes have ended. `in_flight` counts the episodes of groups not yet returned (admission counts episodes),
`abort` drops groups with their turns in flight and their tool calls pending (a pending result is dropped
when it lands). With a journal (actors/journal.py) each finished turn is kept in Redis, and a group re-queued
from a dead actor's lease resumes its episodes from there. Weights are swapped by the loop between two steps, so an update lands between turns or
between engine steps, and each turn records the versions it spans.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging

from actors.journal import unpack
from envs.episode import ChatRenderer, EpisodeState, after_turn, start_episode
from envs.tools import ToolRunner

log = logging.getLogger(__name__)

TOOL_POLL_S = 0.005   # how long a step with no sequence in the engine waits for a tool result: short, so the
                      # loop goes back to leasing, weights and heartbeats; long enough not to spin a core


@dataclasses.dataclass
class _Group:
    record: dict
    params: object
    episodes: list[EpisodeState]
    version_start: int        # the engine's weights when the group was leased: the staleness floor of its samples
    ended: int = 0


class EpisodeEngine:
    """The rollout loop's engine when episodes are multi-turn (see the module docstring)."""

    def __init__(self, engine, episodes_cfg, *, max_tokens: int, journal=None):
        self.inner = engine
        self.journal = journal   # actors/journal.py EpisodeJournal: each finished turn kept in Redis (None: not)
        self.cfg = episodes_cfg
        self.max_tokens = max_tokens
        self.renderer = ChatRenderer(engine.tokenizer)
        self.runner = ToolRunner(threads=episodes_cfg.workers)   # one per environment step that may be calling
        self.pool = cf.ThreadPoolExecutor(max_workers=episodes_cfg.workers, thread_name_prefix="env-step")
        self.groups: dict[str, _Group] = {}
        self.pending: dict[cf.Future, tuple[str, int]] = {}   # an environment step in the pool -> (gid, episode)
        self.turns = self.env_steps = 0
        self.env_s = 0.0
        self.reasons: dict[str, int] = {}
        self.resumed = self.turns_resumed = 0   # episodes continued from another actor's journal, their turns kept
        self.ready: list = []   # groups whose every episode had ended in a resumed journal

    # ---- what the rollout loop reads of any engine
    def __getattr__(self, name):   # tokenizer, vocab_size, version, checksum, load_weights, occupancy, generate
        return getattr(self.inner, name)

    def start(self, gid: str, record: dict, params) -> list[int]:
        """Start a leased group: n episodes reset from `record` (or resumed from the journal of the group it
        was re-queued from, `resume_gid`), their next turns submitted; its prompt ids."""
        old = record.pop("resume_gid", None)
        saved = self.journal.adopt(old, gid) if old and self.journal else {}
        eps = [self._resume(saved[i], record) if i in saved else
               start_episode(self.cfg.make(self.runner), record, self.renderer, self.max_tokens)
               for i in range(params.n)]
        if any(e.prompt_ids != eps[0].prompt_ids for e in eps):
            raise ValueError(f"environment {self.cfg.name} started the episodes of prompt "
                             f"{record.get('prompt_id')!r} differently: a group shares one prompt")
        g = self.groups[gid] = _Group(record, dataclasses.replace(params, n=1), eps, self.inner.version)
        try:
            for i, ep in enumerate(eps):
                if ep.done:
                    self._ended(gid, g, ep)
                else:
                    self._submit(gid, i)
        except Exception:   # PromptRefused (too long for the engine): the same for every episode of the prompt
            self.abort_group(gid)
            raise
        return eps[0].prompt_ids

    def _resume(self, data: bytes, record: dict) -> EpisodeState:
        ep = unpack(data, self.cfg.make(self.runner), record, self.max_tokens)
        self.resumed += 1
        self.turns_resumed += len(ep.turns)
        return ep

    def abort_group(self, gid: str) -> None:
        for e in self.groups.pop(gid).episodes:
            e.env.close()

    def _submit(self, gid: str, i: int) -> None:
        g = self.groups[gid]
        ep = g.episodes[i]
        self.inner.submit((gid, i), ep.next_ids(), dataclasses.replace(g.params, max_tokens=min(g.params.max_tokens,
                                                                                                 ep.room)))

    def step(self) -> list:
        """One engine step (or a short wait on tool calls when the engine holds nothing); the groups whose
        episodes have all ended, as (gid, [EpisodeState] * n)."""
        if self.inner.in_flight():
            for (gid, i), (comp,) in self.inner.step():
                if gid in self.groups:   # else its group was aborted since
                    self.turns += 1
                    fut = self.pool.submit(after_turn, self.groups[gid].episodes[i], comp, self.renderer,
                                           self.inner.tokenizer.eos_token_id)
                    self.pending[fut] = (gid, i)
        elif self.pending:
            cf.wait(list(self.pending), timeout=TOOL_POLL_S, return_when=cf.FIRST_COMPLETED)
        return self._collect()

    def _collect(self) -> list:
        for fut in [f for f in self.pending if f.done()]:
            gid, i = self.pending.pop(fut)
            g = self.groups.get(gid)
            if g is None:
                continue
            ep = g.episodes[i]
            if (err := fut.exception()) is not None:   # the environment itself raised: this episode ends, no others
                log.warning("environment %s raised on prompt %s: %r", self.cfg.name, g.record.get("prompt_id"), err)
                ep.end("env_error", f"{type(err).__name__}: {err}"[:200])
            self.env_steps += 1
            if self.journal is not None:
                self.journal.save(gid, i, ep)
            if ep.done:
                self._ended(gid, g, ep)
            else:
                self._submit(gid, i)
        done, self.ready = self.ready, []
        return done

    def _ended(self, gid: str, g: _Group, ep: EpisodeState) -> None:
        """Count an ended episode; its group goes to `ready` with its last one."""
        self.env_s += ep.env_s
        self.reasons[ep.reason] = self.reasons.get(ep.reason, 0) + 1
        g.ended += 1
        if g.ended == len(g.episodes):
            del self.groups[gid]
            for e in g.episodes:
                e.env.close()
            if self.journal is not None:
                self.journal.drop(gid)
            self.ready.append((gid, g.episodes))

    def abort(self, started_before: int | None = None) -> list:
        """Drop every group, or those leased under weights older than `started_before`; their gids."""
        gids = [gid for gid, g in self.groups.items() if started_before is None or g.version_start < started_before]
        if not gids:
            return []
        if started_before is None:
            self.inner.abort()
        # else their turns still in the engine run to their end and are dropped as they come back: an engine
        # aborts by the version a request started under, and a later turn of an old group started under a newer one
        for gid in gids:
            self.abort_group(gid)
            if started_before is not None and self.journal is not None:   # never resumed: it cannot be trained
                self.journal.drop(gid)
        return gids

    def in_flight(self) -> int:
        """Episodes of the groups not yet returned (all n of a group until its last one ends)."""
        return sum(len(g.episodes) for g in self.groups.values()) + sum(len(eps) for _gid, eps in self.ready)

    def decoding(self) -> int:
        """Episodes not yet ended: those generating and those waiting on their environment."""
        return sum(len(g.episodes) - g.ended for g in self.groups.values())

    def stats(self) -> dict:
        """The heartbeat's episode fields."""
        inner = self.inner.stats() if hasattr(self.inner, "stats") else {}   # the engine's own (prefix cache)
        return {**inner, "episode_turns": self.turns, "env_steps": self.env_steps, "env_s": round(self.env_s, 3),
                "episode_reasons": dict(self.reasons), "episodes_resumed": self.resumed,
                "turns_resumed": self.turns_resumed}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.runner.close()
