"""python -m cluster.start [--config F] [--actors N] [--learners M] [--run-dir D]
                          [--redis-url U] [--address RAY] [section.key=value ...]

Runs the whole system: local Redis (unless --redis-url), Ray, the ingest, M learner ranks
and N rollout actors; shows a live progress line; exits 0 after trainer.total_steps.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from cluster.config import load_config
from cluster.console import outlive_readers
from cluster.launch import Job, JobError
from cluster.proc import setup_logging
from cluster.rundir import record_end
from runbase.configload import ConfigError


class _OneLineParser(argparse.ArgumentParser):
    """A command-line mistake in one line (`error: ...`, exit 2), not the usage block before it."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (python -m cluster.start --help lists them)\n")


def parse_args(argv=None):
    p = _OneLineParser(prog="python -m cluster.start", description=__doc__.split("\n\n")[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file merged over configs/default.yaml")
    p.add_argument("--actors", type=int, help="rollout actors (cluster.actors)")
    p.add_argument("--learners", type=int, help="learner ranks (cluster.learners)")
    p.add_argument("--run-dir", help="output directory (cluster.run_dir)")
    p.add_argument("--redis-url", help="use this Redis instead of starting one (cluster.redis_url)")
    p.add_argument("--address", help="existing Ray cluster address (cluster.address)")
    p.add_argument("--resume", action="store_true", help="continue the job in --run-dir from its last checkpoint")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=1e-5 max_staleness=0")
    args = p.parse_intermixed_args(argv)
    flags = {"actors": "cluster.actors", "learners": "cluster.learners", "run_dir": "cluster.run_dir",
             "redis_url": "cluster.redis_url", "address": "cluster.address"}
    extra = [f"{key}={getattr(args, name)}" for name, key in flags.items() if getattr(args, name) is not None]
    if args.resume:
        if not args.run_dir:
            p.error("--resume needs --run-dir (the directory of the job to continue)")
        extra.append("cluster.resume=true")
    return args.config, extra + args.overrides


_TERMINATED: list[int] = []  # set by SIGTERM or SIGHUP: the exit code then says which signal stopped the job


def _terminated(signum, _frame):
    """SIGTERM (and SIGHUP) stops the job exactly as Ctrl-C does (a KeyboardInterrupt: libraries that catch and
    re-raise one keep it one); the signal itself is noted for the exit code."""
    _TERMINATED.append(signum)
    raise KeyboardInterrupt()


def main(argv=None) -> int:
    config_file, overrides = parse_args(argv)
    try:
        cfg = load_config(config_file, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    outlive_readers()   # a reader of our output that goes away (`| head`, a closed terminal) does not end the job
    # SIGTERM (e.g. from a scheduler) stops the job like Ctrl-C does. Ctrl-C works even when the
    # launcher was started with SIGINT ignored (a background job of a non-interactive shell).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)
    # A terminal that closes (ssh dropped) sends SIGHUP: stop cleanly too (its default action kills the launcher at
    # once, leaving no status.json). One ignored (nohup) stays ignored: that job was asked to outlive its terminal.
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, _terminated)
    try:
        job = Job(cfg)
    except JobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging("launcher", str(job.run_dir))
    a = cfg.actors
    print(f"run {job.run_id}: outputs in {job.run_dir} ({a.engine} engine on {a.device}, actors.engine)", flush=True)
    end = ("failed", "the launcher stopped unexpectedly", 1)   # (how, why, exit code): status.json's `ended`
    try:
        job.start()
        summary = job.monitor()
        print(f"done: {json.dumps(summary)}", flush=True)
        if summary["val_reward_start"] is not None:   # none with trainer.val_before_train=false
            print(f"held-out reward: {summary['val_reward_start']:.4f} at step {summary['start_step']} -> "
                  f"{summary['val_reward_end']:.4f} after {summary['steps']} steps", flush=True)
        end = ("finished", f"trainer.total_steps={summary['steps']} reached", 0)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process", file=sys.stderr)
        sig = _TERMINATED[0] if _TERMINATED else signal.SIGINT
        end = ("interrupted", f"stopped by {signal.Signals(sig).name}", 128 + sig)  # as a shell reports a signal
    except JobError as e:
        print(f"\nerror: {e}; stopping every process", file=sys.stderr)
        end = ("failed", str(e), 1)
    finally:
        job.close()
        try:
            record_end(job.run_dir, *end)
        except OSError as e:   # the operator commands then say less about this run; the job itself is done
            print(f"warning: could not record the run's end in {job.run_dir}/status.json: {e}", file=sys.stderr)
    return end[2]


if __name__ == "__main__":
    sys.exit(main())
