"""python -m cluster.status [--run-dir D] [--json] [--watch]: who is alive, versions, staleness, rates.

Reads the job's Redis (found through D/job.json, default: the newest run under runs/).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import redis

from buffer.store import CONSUMER_GROUP
from cluster.scale import ended_run, reach_job, say_ended
from learner import metric_names as M

HEARTBEAT_TIMEOUT_S = 10.0  # an actor silent this long is shown as not alive
WATCH_EVERY_S = 2.0         # refresh period of --watch
# status's "learner" fields (its own JSON format, kept) -> the metrics line's names they show
LEARNER_FIELDS = {"step": M.STEP, "version": M.VERSION, "samples_per_s": M.SAMPLES_PER_S,
                  "tokens_per_s": M.TOKENS_PER_S, "wait_s": M.WAIT_S, "reward_mean": M.REWARD_MEAN,
                  "val_reward": M.VAL_REWARD}


def production(status: dict, n: int) -> dict[str, float]:
    """Samples acked per second of holding leases, per actor (members with `busy_s`: not the evaluator), from
    a job's status.json (`members`: the launcher's last reading of the heartbeats)."""
    out = {}
    for who, m in sorted(status.get("members", {}).items()):
        if m.get("busy_s"):
            out[who] = m["groups"] * n / m["busy_s"]
    return out


def engine_steps(status: dict) -> dict[str, dict]:
    """Per actor: its engine's mean step in milliseconds and the leased sequences in flight at a step, on average
    (samples that ended early count until their group returns: an upper bound on the rows stepped), and where
    the heartbeat has them the sequences its scheduler ran and kept waiting after a step (mean), and the most
    KV cache in use (waiting with the KV cache near 1: preempted or refused for memory, not for a slot)."""
    out = {}
    for who, m in sorted(status.get("members", {}).items()):
        if m.get("engine_steps"):
            out[who] = {"step_ms": 1e3 * m["step_s"] / m["engine_steps"],
                        "leased_inflight": m["leased_seqs"] / m["engine_steps"]}
            if k := m.get("occupied_steps"):  # the engine's own scheduler (vLLM in process)
                out[who].update(running=m["running_seqs"] / k, waiting=m["waiting_seqs"] / k,
                                kv_usage_max=m["kv_usage_max"])
            if m.get("prompt_tokens"):   # vLLM: the share of finished requests' prompt tokens the prefix cache held
                out[who]["prefix_cached"] = round(m.get("prefix_cached_tokens", 0) / m["prompt_tokens"], 4)
            if prof := m.get("step_profile"):  # bin's lowest leased count -> [steps, mean step in ms]
                out[who]["step_ms_by_leased"] = {int(lo): [n, 1e3 * s / n] for lo, (n, s) in prof.items() if n}
    return out


def episodes(status: dict) -> dict[str, dict]:
    """Per actor running an environment: its episodes' turns, environment steps and the seconds they spent in the
    environment (tools), with the reasons its episodes ended, from a job's status.json heartbeats."""
    out = {}
    for who, m in sorted(status.get("members", {}).items()):
        if m.get("episode_turns"):
            steps = m.get("env_steps", 0)
            out[who] = {"turns": m["episode_turns"], "env_steps": steps, "env_s": m.get("env_s", 0.0),
                        "env_ms_per_step": round(1e3 * m.get("env_s", 0.0) / steps, 3) if steps else None,
                        "reasons": m.get("episode_reasons", {}), "resumed": m.get("episodes_resumed", 0)}
    return out


def collect(r, keys) -> dict:
    now = time.time()
    metrics = json.loads(r.get(keys.metrics) or "{}")
    actors = {}
    for a, raw in sorted(r.hgetall(keys.members).items()):
        m = json.loads(raw)
        m["heartbeat_age_s"] = round(now - m.pop("heartbeat"), 2)
        m["alive"] = m["heartbeat_age_s"] < HEARTBEAT_TIMEOUT_S
        actors[a.decode()] = m
    try:
        pending = r.xpending(keys.traj, CONSUMER_GROUP)["pending"]
    except Exception:  # no consumer group yet: the learner has not started reading
        pending = 0
    return {
        "actors": actors,
        "learner": {k: metrics.get(name) for k, name in LEARNER_FIELDS.items()},
        "buffer": {"backlog": r.xlen(keys.traj), "pending": pending,
                   "rejected": {k.decode(): int(v) for k, v in r.hgetall(keys.rejected).items()},
                   "deadletter": r.xlen(keys.deadletter), "prompts_queued": r.llen(keys.prompts),
                   "leases": r.hlen(keys.leases),
                   # peers the ingest dropped before any message (a frame over buffer.max_message_bytes)
                   "peers_dropped": int(r.hget(keys.ingest, "peers_dropped") or 0)},
        "staleness_hist": metrics.get(M.STALENESS_HIST),
        "weights": {"version": int(r.get(keys.version) or 0), "members": sorted(
            a.decode() for a in r.hkeys(keys.ws_members)), "epoch": metrics.get(M.WS_EPOCH)},
    }


def render(s: dict) -> str:
    L = s["learner"]
    out = [f"learner  step {L['step']}  version {L['version']}  {L['samples_per_s'] or 0:.1f} samples/s  "
           f"reward {L['reward_mean'] or 0:.3f}  waiting for data {L['wait_s'] or 0:.3f}s/step",
           f"buffer   backlog {s['buffer']['backlog']}  pending {s['buffer']['pending']}  "
           f"queued prompts {s['buffer']['prompts_queued']}  leases {s['buffer']['leases']}  "
           f"dead-letter {s['buffer']['deadletter']}  rejected/dropped {s['buffer']['rejected']}  "
           f"peers dropped {s['buffer']['peers_dropped']}",
           f"staleness histogram (0..s) {s['staleness_hist']}",
           f"weights  version {s['weights']['version']}  epoch {s['weights']['epoch']}  members {s['weights']['members']}",
           f"{'actor':<10}{'alive':<7}{'engine':<8}{'version':<9}{'checksum':<18}{'groups':<8}{'heartbeat':<10}host"]
    for a, m in s["actors"].items():
        out.append(f"{a:<10}{'yes' if m['alive'] else 'NO':<7}{m['engine']:<8}{m['version']:<9}{m['checksum']:<18}"
                   f"{m['groups']:<8}{m['heartbeat_age_s']:<10}{m['host']}")
    return "\n".join(out)


EXIT_ENDED_BADLY = 3   # an ended run that did not finish its steps (0: it did; 2: no run to report on)


def final_state(status: dict, run_dir: str) -> str:
    """An ended run's last state from its status.json: how it ended, the version its learner reached (its steps),
    the held-out reward first and last, and each actor's last version and groups."""
    out = [say_ended(status, run_dir), f"version {status.get('version', 0)} (steps trained)"]
    if val := status.get("val_reward"):
        first, last = min(val, key=int), max(val, key=int)
        out.append(f"held-out reward {val[first]:.4f} at version {first} -> {val[last]:.4f} at version {last}")
    for actor, m in sorted(status.get("members", {}).items()):
        out.append(f"{actor}: version {m.get('version')}, {m.get('groups', '?')} groups")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.status", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", help="the job's run directory (default: newest under runs/)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--watch", action="store_true", help=f"refresh every {WATCH_EVERY_S:.0f}s until Ctrl-C")
    args = p.parse_args(argv)

    if (ended := ended_run(args.run_dir)) is not None:   # the job is gone: its final state, from status.json
        print(json.dumps(ended, indent=1) if args.json else final_state(ended, args.run_dir or "(newest run)"))
        return 0 if ended["ended"]["how"] == "finished" else EXIT_ENDED_BADLY
    job, r, keys = reach_job(args.run_dir)
    try:
        while True:
            try:
                s = collect(r, keys)
                ended = r.exists(keys.ended)
            except redis.RedisError:   # --watch outlived the job: its local Redis stopped with it
                ended = True
            if ended:
                print(f"run {job['run_id']} ended; its final state is in its run directory's status.json", flush=True)
                return 0
            text = json.dumps(s, indent=1) if args.json else render(s)
            print(("\033[2J\033[H" if args.watch and sys.stdout.isatty() else "") + text, flush=True)
            if not args.watch:
                return 0
            time.sleep(WATCH_EVERY_S)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:   # `status --json | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit's flush
        return 0


if __name__ == "__main__":
    sys.exit(main())
