"""The books every chaos test balances: what was issued is trained, dropped (counted) or
still waiting in the buffer; nothing is in flight at the end; no group is trained twice."""
from __future__ import annotations

import json
from pathlib import Path

from buffer.store import CONSUMER_GROUP
from learner import metric_names as M
from runbase.keys import Keys


def metrics_lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def counted_steps(run_dir: Path) -> list[dict]:
    """Metrics lines of the steps that count. Each learner incarnation starts with a line carrying
    `val/reward_initial`; a resumed one supersedes the crashed one's lines from its start step on.
    A skipped step's line (`train/skipped`: nothing applied, the step number tried again) never counts."""
    counted: list[dict] = []
    lines = [m for m in metrics_lines(run_dir) if not m.get(M.SKIPPED)]
    for i, m in enumerate(lines):
        if M.VAL_REWARD_INITIAL in m and i > 0:
            counted = [c for c in counted if c[M.STEP] < m[M.STEP]]
        counted.append(m)
    return counted


def dead_lettered(r, k: Keys) -> int:
    """Dead-letter entries that stand for an issued group: the ingest marks whether a rejected message
    released a lease (`lease` 0: a resend of a rejected group, or a message no lease was issued for);
    the learner's entries for the groups of a skipped step (`skipped_*` reasons) carry no such mark."""
    return sum(1 for _id, f in r.xrange(k.deadletter)
               if f.get(b"reason", b"").startswith(b"skipped_") or f.get(b"lease", b"1") != b"0")


def check_ledger(r, run_id: str, run_dir: Path, *, steps: int) -> dict:
    """Asserts the books balance; returns them for further assertions."""
    k = Keys(run_id)
    lines = counted_steps(run_dir)
    assert [m[M.STEP] for m in lines] == list(range(steps)), "every step counts exactly once"
    trained = [g for m in lines for g in m[M.GROUPS_TRAINED]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    rejected = {a.decode(): int(n) for a, n in r.hgetall(k.rejected).items()}
    books = {
        "issued": int(r.get(k.group_seq) or 0),                      # every group id ever leased
        "trained": len(trained),
        "dropped": sum(n for a, n in rejected.items() if a.startswith("dropped_")),  # counted, never silent
        "returned": rejected.get("lease_reclaimed", 0),              # leases of dead actors, prompt re-queued
        "deadletter": dead_lettered(r, k),                           # rejected groups (their lease released)
        "waiting": r.xlen(k.traj),                                    # stored, not yet trained when the run ended
        "pending": r.xpending(k.traj, CONSUMER_GROUP)["pending"],    # read by a learner, not acked
        "leased": r.hlen(k.leases),                                   # with an actor, not yet stored
        # groups of skipped steps (a non-finite update): dead-lettered (in "deadletter"), never trained
        "skipped": sum(n for a, n in rejected.items() if a.startswith("skipped_")),
    }
    skipped_lines = [m for m in metrics_lines(run_dir) if m.get(M.SKIPPED)]
    assert books["skipped"] == sum(m[M.DEAD_LETTERED] for m in skipped_lines), f"skipped steps' groups: {books}"
    assert books["pending"] == 0 and books["leased"] == 0, f"something still in flight: {books}"
    accounted = books["trained"] + books["dropped"] + books["returned"] + books["deadletter"] + books["waiting"]
    assert books["issued"] == accounted, f"issued != trained + dropped + returned + dead-lettered + waiting: {books}"
    return books
