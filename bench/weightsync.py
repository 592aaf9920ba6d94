"""Weight publication vs the raw broadcast of the same bytes, in the same run (gloo, CPU).

    python -m bench.weightsync [--shape tiny|0.5b|1.5b|7b] [--dtype bfloat16] [--actors 2] [--bucket-mb 256]
                               [--reps 3] [--backend gloo|cuda_ipc|nccl] [--busy-actor [--receive-switch-s S]]

Per publication: from the learner's call to every actor holding the new version (checksum
verified, loaded into its own model), split into transfer (publisher side, buckets + trailer
broadcast) and apply (actor side, verify + load); beside a plain gloo broadcast of the same
bytes between the same processes (gloo, nccl: the publisher on GPU 0, actors on GPUs 1..), or a
device-to-device copy of them (cuda_ipc). Also the publisher's peak extra memory (RSS) during a
publication, to compare with the bucket size.

--busy-actor keeps a Python thread busy in each actor process, as an engine's step loop keeps an actor's: the
receiving thread then waits for the GIL at each of its blocking points (weightsync.core.RECEIVE_SWITCH_S bounds the
wait while a version arrives; --receive-switch-s sets it, 0.005 being Python's default: no shortening).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time

from cluster.redis_local import LocalRedis
from data.shapes import QWEN2_SHAPES
from runbase.keys import Keys, connect
from weightsync.backends import publisher, subscriber


def model_for(shape: str, dtype: str, device: str = "cpu"):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**{**QWEN2_SHAPES[shape], "tie_word_embeddings": False})
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))


def busy_loop() -> None:
    """A Python thread that never blocks (an engine's step loop between its kernels, as the GIL sees it)."""
    x = 0
    while True:
        for i in range(1000):
            x += i


def actor(redis_url: str, run_id: str, actor_id: str, shape: str, dtype: str, reps: int, raw_sizes: dict,
          backend: str, gpu: int = 0, busy: bool = False, switch_s: float | None = None) -> None:
    if backend == "nccl":  # before torch touches CUDA: this actor sees only its GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    import torch
    import torch.distributed as dist

    from weightsync import core   # here, as torch: it imports torch, after CUDA_VISIBLE_DEVICES is set above

    if switch_s is not None:
        core.RECEIVE_SWITCH_S = switch_s
    if busy:
        threading.Thread(target=busy_loop, daemon=True).start()

    torch.set_num_threads(1)
    r = connect(redis_url)
    model = model_for(shape, dtype, "cpu" if backend == "gloo" else "cuda")
    sub = subscriber(backend, r, Keys(run_id), member_id=actor_id, timeout_s=60 if backend == "cuda_ipc" else 600,
                     device=None if backend == "gloo" else "cuda")
    for _ in range(reps):
        while (v := sub.take()) is None:
            sub.wait(1)
        t0 = time.time()
        model.load_state_dict(v.state_dict)
        if backend != "gloo":
            torch.cuda.synchronize()
        r.hset(f"{run_id}:bench:applied:{v.version}", actor_id, json.dumps([time.time(), time.time() - t0]))
    if backend == "cuda_ipc":
        r.set(f"{run_id}:bench:done:{actor_id}", 1)
        os._exit(0)
    # the raw limit: the same bytes, plain broadcast, same processes
    host, port = r.hget(f"{run_id}:ws", "addr").decode().rsplit(":", 1)
    store = dist.TCPStore(host, int(port), None, is_master=False)
    while (rank := r.hget(f"{run_id}:bench:raw_ranks", actor_id)) is None:
        time.sleep(0.01)
    rank = int(rank)
    pg = raw_group(backend, dist.PrefixStore("raw", store), rank, int(r.get(f"{run_id}:bench:raw_world")))
    dev = "cuda" if backend == "nccl" else "cpu"
    bufs = {dt: torch.empty(n, dtype=getattr(torch, dt), device=dev) for dt, n in raw_sizes.items()}
    for _ in range(reps + 1):  # one warm-up (communicator set-up), as the publisher does
        for dt in sorted(bufs):
            pg.broadcast(bufs[dt], 0).wait()
        if dev == "cuda":
            torch.cuda.synchronize()
    r.set(f"{run_id}:bench:done:{actor_id}", 1)
    os._exit(0)  # gloo teardown under live groups aborts at exit on this torch


def raw_group(backend: str, store, rank: int, world: int):
    import torch.distributed as dist

    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world)


def peak_rss_during(fn):
    import psutil

    proc, peak, stop = psutil.Process(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)
    base = proc.memory_info().rss
    t = threading.Thread(target=sample)
    t.start()
    try:
        out = fn()
    finally:
        stop.set()
        t.join()
    return out, peak[0] - base


def parse_args(argv=None) -> argparse.Namespace:
    """The command line of `python -m bench.weightsync`."""
    p = argparse.ArgumentParser(prog="python -m bench.weightsync")
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--backend", choices=["gloo", "cuda_ipc", "nccl"], default="gloo")
    p.add_argument("--busy-actor", action="store_true", help="a busy Python thread in each actor (an engine loop)")
    p.add_argument("--receive-switch-s", type=float, default=None,
                   help="the actors' GIL switch interval while a version arrives (default: weightsync's own)")
    p.add_argument("--json")
    return p.parse_args(argv)


def start_actors(args, redis_url: str, run_id: str, ids: list, sizes: dict, n_gpus: int) -> list:
    """One actor process per id, spread over GPUs 1.. when there are several."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=actor, args=(redis_url, run_id, a, args.shape, args.dtype, args.reps, sizes,
                                                 args.backend, 1 + i % max(1, n_gpus - 1), args.busy_actor,
                                                 args.receive_switch_s))
             for i, a in enumerate(ids)]
    for pr in procs:
        pr.start()
    return procs


def publish_rows(args, pub, model, r, run_id: str, device: str) -> list:
    """Publish --reps new versions; per version, its total, transfer and apply seconds and extra memory."""
    import torch

    rows = []
    for v in range(1, args.reps + 1):
        with torch.no_grad():
            next(model.parameters()).add_(1)
        t0 = time.time()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        csum, extra = peak_rss_during(lambda: pub.publish(v, model.state_dict(), int(args.bucket_mb * 2**20)))
        if device == "cuda":  # the extra memory that matters is the GPU's
            extra = torch.cuda.max_memory_allocated() - before
        transfer = time.time() - t0
        assert csum is not None
        key = f"{run_id}:bench:applied:{v}"
        while r.hlen(key) < args.actors:
            time.sleep(0.001)
        applied = [json.loads(x) for x in r.hvals(key)]
        rows.append({"total_s": max(a[0] for a in applied) - t0, "transfer_s": transfer,
                     "apply_s": max(a[1] for a in applied), "extra_rss_mb": extra / 2**20})
        if device == "cuda":  # what the publisher still holds once every actor has the version (0 expected)
            rows[-1]["held_after_mb"] = (torch.cuda.memory_allocated() - before) / 2**20
    return rows


def raw_copy_seconds(sizes: dict, reps: int) -> list:
    """Seconds of `reps` device-to-device copies of buffers of the published sizes (cuda_ipc's raw limit)."""
    import torch

    raw = []
    src = {dt: torch.empty(n, dtype=getattr(torch, dt), device="cuda") for dt, n in sizes.items()}
    dst = {dt: torch.empty_like(t) for dt, t in src.items()}
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.time()
        for dt in src:
            dst[dt].copy_(src[dt])
        torch.cuda.synchronize()
        raw.append(time.time() - t0)
    return raw[1:]


def raw_broadcast_seconds(args, pub, r, run_id: str, ids: list, sizes: dict, device: str) -> list:
    """Seconds of `--reps` plain broadcasts of the published sizes from the publisher to the actor processes."""
    import torch
    import torch.distributed as dist

    raw = []
    r.set(f"{run_id}:bench:raw_world", args.actors + 1)
    r.hset(f"{run_id}:bench:raw_ranks", mapping={a: i + 1 for i, a in enumerate(ids)})
    pg = raw_group(args.backend, dist.PrefixStore("raw", pub.store), 0, args.actors + 1)
    bufs = {dt: torch.empty(n, dtype=getattr(torch, dt), device=device) for dt, n in sizes.items()}
    for _ in range(args.reps + 1):
        t0 = time.time()
        for dt in sorted(bufs):
            pg.broadcast(bufs[dt], 0).wait()
        if device == "cuda":
            torch.cuda.synchronize()
        raw.append(time.time() - t0)
    return raw[1:]  # the first one sets the communicator up


def report(args, rows: list, raw: list, nbytes: int, device: str) -> None:
    """Print the best publication beside the raw limit, and write --json."""
    best = min(rows, key=lambda x: x["total_s"])
    raw_s = min(raw)
    print(f"\nshape {args.shape} {args.dtype}: {nbytes / 2**20:.0f} MiB, {args.actors} actors, {args.backend}, "
          f"bucket {args.bucket_mb:.0f} MiB, best of {args.reps}")
    raw_name = "raw device copy" if args.backend == "cuda_ipc" else f"raw {args.backend} broadcast"
    print(f"| total (call -> all actors serving) | transfer | apply | {raw_name} | transfer vs raw | peak extra RSS |")
    print("|---|---|---|---|---|---|")
    print(f"| {best['total_s']:.3f} s | {best['transfer_s']:.3f} s | {best['apply_s']:.3f} s | {raw_s:.3f} s | "
          f"{raw_s / best['transfer_s']:.2f} | {max(x['extra_rss_mb'] for x in rows):.0f} MiB |")
    if device == "cuda":
        held = ", ".join(f"{x['held_after_mb']:.0f}" for x in rows)
        print(f"GPU memory the publisher still held after each version: {held} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "bytes": nbytes, "rows": rows, "raw_s": raw}, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.backend == "gloo" else "cuda"
    import torch

    from weightsync.flat import buffer_sizes, layout  # lazy: imports torch

    torch.set_num_threads(1)
    redis = LocalRedis(f"/tmp/bench-ws-redis-{os.getpid()}")
    run_id = f"bench{os.getpid()}"
    r = connect(redis.url)
    try:
        model = model_for(args.shape, args.dtype, device)
        sd = model.state_dict()
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        sizes = buffer_sizes(layout(sd))
        pub = publisher(args.backend, r, Keys(run_id), timeout_s=60 if args.backend == "cuda_ipc" else 600,
                        device="cuda:0" if args.backend == "nccl" else None)
        ids = [f"a{i}" for i in range(args.actors)]
        n_gpus = torch.cuda.device_count() if device == "cuda" else 0
        procs = start_actors(args, redis.url, run_id, ids, sizes, n_gpus)
        while pub.live_members() != ids:
            time.sleep(0.1)
        rows = publish_rows(args, pub, model, r, run_id, device)
        if args.backend == "cuda_ipc":  # the raw limit: a device copy of the same bytes
            raw = raw_copy_seconds(sizes, args.reps)
        else:
            raw = raw_broadcast_seconds(args, pub, r, run_id, ids, sizes, device)
        for pr in procs:
            pr.join(120)
        report(args, rows, raw, nbytes, device)
    finally:
        redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
