"""What a measured run holds, as the simulator's calibration and validation read it: its metrics, config, the
actors' heartbeats in its status.json, and its lengths per window of steps."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from cluster.status import engine_steps
from experiments.sweep.analysis import run_throughput, trained_share
from learner import metric_names as M

LEN_WINDOW = 10    # steps per entry of a measured run's length schedule: lengths move over tens of steps


def run_metrics(run_dir) -> list[dict]:
    return M.read_metrics(Path(run_dir) / "metrics.jsonl")  # runs written with the old names too


def run_config(run_dir) -> dict:
    import yaml

    return yaml.safe_load((Path(run_dir) / "config.yaml").read_text())


def steady(ms: list[dict], run=None) -> list[dict]:
    """Steps between the first and the last: start-up and the final evaluation are not steady state."""
    if len(ms) < 6:
        raise ValueError((f"{run}: " if run is not None else "") + f"{len(ms)} steps: calibration needs at least 6")
    return ms[1:-1]


def measured(run_dir) -> dict:
    """What a run measured: steady-state samples/s (same rule as the sweep) and staleness fractions."""

    ms = run_metrics(run_dir)
    cfg = run_config(run_dir)
    hist = [0] * (cfg["buffer"]["max_staleness"] + 1)
    for m in ms[1:]:
        for k, x in enumerate(m[M.STALENESS_HIST]):
            hist[k] += x
    t = sum(hist) or 1
    return {"actors": cfg["cluster"]["actors"], "learners": cfg["cluster"]["learners"],
            "max_staleness": cfg["buffer"]["max_staleness"], "samples_per_s": run_throughput(ms),
            "staleness": [h / t for h in hist], "steps": len(ms), "dropped_frac": dropped_frac(ms, cfg["actors"]["n"]),
            "engine": mean_heartbeat(run_dir), "trained_share": trained_share(run_dir, ms),
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


def mean_heartbeat(run_dir) -> dict:
    """The actors' engine step (ms), leased sequences in flight and, where counted, the sequences the engine ran,
    averaged over actors ({} without them)."""
    beats = list(heartbeats(run_dir).values())
    keys = ("step_ms", "leased_inflight") + (("running",) if beats and all("running" in b for b in beats) else ())
    return {k: statistics.fmean(b[k] for b in beats) for k in keys} if beats else {}


def heartbeats(run_dir) -> dict[str, dict]:
    """Per actor of a run: its engine's mean step (ms) and leased sequences in flight, from the launcher's
    last status (cluster.status.engine_steps); {} for runs without status.json or from before the counters."""
    path = Path(run_dir) / "status.json"
    return engine_steps(json.loads(path.read_text())) if path.exists() else {}


def length_stats(ms: list[dict]) -> tuple[float, float]:
    """The steps' mean response length and their mean ratio of longest to mean response."""
    return (statistics.fmean(m[M.RESPONSE_LEN_MEAN] for m in ms),
            statistics.fmean(m[M.RESPONSE_LEN_MAX] / max(m[M.RESPONSE_LEN_MEAN], 1e-9) for m in ms))


def length_spread(runs) -> list[float]:
    """Per LEN_WINDOW steps of training, the mean ratio of longest to mean response over the `runs` that lost no
    group (no staleness drop, no abort): what the engine generated at that point of training. A run with drops
    trains without its longest groups (aborted or dropped as too stale), so its own ratio is too small."""
    scheds = [m["length_schedule"] for m in map(measured, runs) if m["dropped_frac"] == 0 and m["length_schedule"]]
    return [statistics.fmean(sc[w][1] for sc in scheds if w < len(sc)) for w in range(max(map(len, scheds), default=0))]


def measured_slot_use(run_dir) -> float | None:
    """A run's tokens trained per leased sequence-step of its engines (the actors' heartbeats), None without them:
    in a run that drops nothing, every generated token is trained."""
    path = Path(run_dir) / "status.json"
    members = json.loads(path.read_text()).get("members", {}) if path.exists() else {}
    leased = sum(m.get("leased_seqs", 0) for m in members.values())
    tokens = sum(m[M.SAMPLES] * m[M.RESPONSE_LEN_MEAN] for m in run_metrics(run_dir))
    return tokens / leased if leased else None


def actor_loop_s(runs) -> float:
    """Seconds per weight version that the actors' loops spend outside engine steps (their heartbeats' busy time
    less their engine steps' time, over the versions they swapped in): the swap into the engine and the groups
    sent per version, which stall the engine (0 without heartbeats)."""
    members = [m for run in runs if (Path(run) / "status.json").exists()
               for m in json.loads((Path(run) / "status.json").read_text()).get("members", {}).values()
               if m.get("engine_steps") and "busy_s" in m]
    versions = sum(m.get("version", 0) for m in members)
    return sum(m["busy_s"] - m["step_s"] for m in members) / versions if versions else 0.0
