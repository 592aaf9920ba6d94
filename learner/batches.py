"""The learner's batch source: rank 0 reads each step's groups (the buffer's sampler, or the batches an
earlier run recorded with buffer.replay_dir) and keeps the prompt queue fed; every rank gets its equal
share by scatter; the groups are acked once trained (learner/checkpoint.py says when), or dead-lettered
with a skipped step."""
from __future__ import annotations

import json
import os
import time

import msgpack
import torch
import torch.distributed as dist

from buffer.replay import ReplaySource, record
from buffer.sampler import RedisSampler
from buffer.schema import Limits, decode
from learner.batching import groups_to_rows, split_rows
from learner.config import LearnerView
from learner.phases import PhaseReport


class BatchSource:
    def __init__(self, view: LearnerView, *, rank: int, world: int, group, limits: Limits, run_dir: str,
                 report: PhaseReport, r=None, keys=None, prompts=None):
        """`r`, `keys` and `prompts` (the training prompt stream) on rank 0 only, which reads the batches."""
        self.view, self.rank, self.world, self.group, self.limits = view, rank, world, group, limits
        self.run_dir, self.report, self.r, self.keys, self.prompts = run_dir, report, r, keys, prompts
        self.sampler = self._sampler() if rank == 0 else None

    def _sampler(self):
        v = self.view
        if v.replay_dir:
            return ReplaySource(v.replay_dir, self.limits, groups_per_step=v.learner.groups_per_step,
                                steps=v.trainer.total_steps)
        return RedisSampler(self.r, self.keys, groups_per_step=v.learner.groups_per_step,
                            max_staleness=v.max_staleness, limits=self.limits, should_stop=self._waiting,
                            consumer=f"rank0-{os.getpid()}", deadletter_maxlen=v.deadletter_maxlen)

    def read(self, step: int, *, first: bool = False):
        """(batch, seconds it took): rank 0's next batch from the buffer (recorded with trainer.record_batches;
        a retried step's batch replaces a skipped one's); None on the other ranks (they get their share by
        scatter). `first`: the run's first, marked on the start-up timeline."""
        # waiting for groups is the actors' time (the launcher watches them); reading recorded ones is ours
        self.report.phase("read" if self.view.replay_dir else "wait", step)
        t0 = time.monotonic()
        if self.rank != 0:
            return None, time.monotonic() - t0
        batch = self.sampler.next_batch(step)
        if first:
            self.report.mark("first_batch")
        if self.view.trainer.record_batches:
            record(f"{self.run_dir}/batches", step, batch.payloads)
        return batch, time.monotonic() - t0

    def scatter(self, batch, version: int, flags: tuple[bool, ...]):
        """Rank 0's groups to every rank (as validated msgpack bytes, never pickle); each rank rebuilds the
        same rows deterministically and keeps its equal share. The header also carries rank 0's `flags`
        (decisions every rank must follow, so that all join their collectives). Returns (rows, this rank's
        share, the flags as rank 0 gave them)."""
        if self.rank == 0:
            blob = msgpack.packb(batch.payloads)
            head = torch.tensor([len(blob), *map(int, flags)], dtype=torch.int64)
        else:
            head = torch.zeros(1 + len(flags), dtype=torch.int64)
        dist.broadcast(head, 0, group=self.group)
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(head[0]), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.group)
        groups = [decode(p, self.limits, trusted=True) for p in msgpack.unpackb(buf.numpy().tobytes())]
        rows = groups_to_rows(groups, version, scale_std=self.view.learner.scale_adv_by_std)
        return rows, split_rows(rows, self.world)[self.rank], tuple(bool(x) for x in head[1:])

    def ack(self, entry_ids) -> None:
        """Rank 0: the buffer entries of trained steps are done (deleted from the stream)."""
        self.sampler.ack_ids(entry_ids)

    def skip(self, batch, reason: str, step: int) -> int:
        """Rank 0: a batch whose step was not applied; its groups dead-lettered under `reason` (acked, admission
        slots freed) and prompts queued for the retried step's groups. Returns how many were dead-lettered."""
        n = self.sampler.skip(batch, reason, step)
        self.feed()
        return n

    def feed(self) -> None:
        """Rank 0: keep enough prompts queued for everything admission may let actors start."""
        s, G = self.view.max_staleness, self.view.learner.groups_per_step
        missing = (s + 2) * G - self.r.llen(self.keys.prompts)
        if missing > 0:
            recs = [json.dumps(p.record()) for p in (next(self.prompts) for _ in range(missing))]
            pipe = self.r.pipeline()
            pipe.rpush(self.keys.prompts, *recs)
            pipe.set(self.keys.prompt_cursor, self.prompts.position)
            pipe.execute()

    def _waiting(self) -> bool:
        """Asked by the sampler while it waits for groups: keep the prompt queue fed (groups the ingest
        rejected used up prompts without reaching a batch) and say whether the job is stopping."""
        self.feed()
        return bool(self.r.exists(self.keys.stop))
