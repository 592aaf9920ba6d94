"""A 2-rank FSDP2 step equals a 1-rank step on the same batch (real processes, gloo)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ranks
from learner.config import LearnerConfig
from learner import metric_names as M
from runbase.net import free_port


def make_rows(n: int, seed: int = 0):
    from learner.batching import Row

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        p, t = int(rng.integers(3, 9)), int(rng.integers(1, 7))
        rows.append(Row(prompt_ids=rng.integers(0, 250, p).astype(np.int32),
                        response_ids=rng.integers(0, 250, t).astype(np.int32),
                        behavior_logprobs=(-rng.random(t) * 3).astype(np.float32),
                        advantage=float(rng.normal()), reward=0.0, staleness=0, group_id=f"g{i // 4}"))
    return rows


def rank_proc(rank: int, world: int, port: int, out: str, loss_norm: str, chunk: int, compile: str = "off") -> None:
    import torch.distributed as dist

    from data.tiny_model import random_tiny_model
    from learner.batching import split_rows
    from learner.model import full_state_dict, shard
    from learner.step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = shard(random_tiny_model(seed=0), torch.device("cpu"), compile=compile)
    lc = LearnerConfig(lr=1e-2, micro_batch_size_per_gpu=3, loss_norm=loss_norm, logprob_chunk_tokens=chunk,
                       compile=compile)
    compiled = [getattr(layer, "_compiled_call_impl", None) is not None for layer in model.model.layers]
    opt = torch.optim.AdamW(model.parameters(), lr=lc.lr)
    rows = make_rows(8)
    stats = train_step(model, opt, split_rows(rows, world)[rank], rows, lc, temperature=1.0, world=world,
                       pad_id=0, device=torch.device("cpu"))
    sd = full_state_dict(model)
    if rank == 0:
        torch.save({"sd": sd, "stats": stats, "compiled": compiled}, out)
    dist.barrier()  # no destroy_process_group: gloo teardown can abort at exit on this torch


def spawn_ranks(target, world: int, out: str, *extra) -> None:
    """target(rank, world, port, out, *extra) in `world` processes (tests/integration/ranks.py) on a free loopback
    port; each exits 0."""
    port = free_port()  # below the ephemeral range: the spawned ranks bind it seconds later
    ctx = ranks.context()
    procs = [ctx.Process(target=target, args=(rank, world, port, out, *extra)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0


def run_world(world: int, tmp_path, loss_norm: str, chunk: int = 2048, compile: str = "off"):
    out = str(tmp_path / f"world{world}-{compile}.pt")
    spawn_ranks(rank_proc, world, out, loss_norm, chunk, compile)
    return torch.load(out)


@pytest.mark.parametrize("loss_norm", ["token_mean", "seq_mean_token_mean"])
def test_two_rank_step_equals_one_rank_step(tmp_path, loss_norm):
    from data.tiny_model import random_tiny_model

    # 1 rank on the plain logits path, 2 ranks on the chunked response-only head (3 tokens a chunk)
    one, two = run_world(1, tmp_path, loss_norm, chunk=0), run_world(2, tmp_path, loss_norm, chunk=3)
    init = random_tiny_model(seed=0).state_dict()
    assert one["sd"].keys() == two["sd"].keys()
    moved = 0
    for name in one["sd"]:
        # atol: 1% of one AdamW step (lr 1e-2): its first update is lr * g / |g|, so gradients at float
        # noise level (1e-9) move by up to 2e-5 with another summation order; a wrong gradient moves by lr
        torch.testing.assert_close(two["sd"][name], one["sd"][name], rtol=1e-4, atol=1e-4, msg=name)
        moved += not torch.equal(one["sd"][name], init[name])
    assert moved == len(init)  # the step really updated every tensor
    for k in (M.LOSS, M.CLIP_FRAC, M.MISMATCH_ABS):
        assert two["stats"][k] == pytest.approx(one["stats"][k], rel=1e-4, abs=1e-6)
    assert two["stats"][M.GRAD_NORM] == pytest.approx(one["stats"][M.GRAD_NORM], rel=1e-4)


def test_compiled_layers_step_equals_eager(tmp_path):
    """learner.compile: each decoder layer compiled in place under FSDP2 (2 ranks; aot_eager, the
    backend that traces and partitions forward/backward as inductor does, without generating kernels)
    trains exactly as the eager 1-rank step, and the state dict keeps its names."""
    eager, compiled = run_world(1, tmp_path, "token_mean"), run_world(2, tmp_path, "token_mean", compile="aot_eager")
    assert compiled["compiled"] and all(compiled["compiled"]) and not any(eager["compiled"])
    assert compiled["sd"].keys() == eager["sd"].keys()
    for name in eager["sd"]:
        torch.testing.assert_close(compiled["sd"][name], eager["sd"][name], rtol=1e-4, atol=1e-4, msg=name)
    assert compiled["stats"][M.LOSS] == pytest.approx(eager["stats"][M.LOSS], rel=1e-4, abs=1e-6)


def gather_proc(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch import nn

    from learner.model import gather_full

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # rows that do not divide by the world: 5 over 3 ranks is 2+2+1, 1 row leaves two ranks empty
    model = nn.Sequential(nn.Linear(4, 5), nn.Embedding(1, 3), nn.Linear(5, 7, bias=False), nn.LayerNorm(7))
    fully_shard(model)
    sd = model.state_dict()
    names = list(sd)
    batched = gather_full([sd[n] for n in names], torch.device("cpu"))
    single = [sd[n].full_tensor() for n in names]
    if rank == 0:
        torch.save({n: (b, s) for n, b, s in zip(names, batched, single)}, out)
    dist.barrier()


def test_one_all_gather_per_bucket_equals_full_tensor(tmp_path):
    """The publication's bucketed gather (learner.model.gather_full) gives every parameter exactly as
    DTensor.full_tensor does, for uneven shards and ranks holding nothing."""
    out = str(tmp_path / "gather.pt")
    spawn_ranks(gather_proc, 3, out)
    got = torch.load(out)
    assert len(got) == 6
    for name, (batched, single) in got.items():
        assert torch.equal(batched, single), name


def skip_proc(rank: int, world: int, port: int, out: str) -> None:
    import math

    import torch.distributed as dist

    from data.tiny_model import random_tiny_model
    from learner.batching import split_rows
    from learner.model import full_state_dict, shard
    from learner.step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    lc = LearnerConfig(lr=1e-2, micro_batch_size_per_gpu=3)
    cpu = torch.device("cpu")

    def policy():
        model = shard(random_tiny_model(seed=0), cpu)
        return model, torch.optim.AdamW(model.parameters(), lr=lc.lr)

    def step(model, opt, rows):
        return train_step(model, opt, split_rows(rows, world)[rank], rows, lc, temperature=1.0, world=world,
                          pad_id=0, device=cpu)

    model, opt = policy()
    poisoned = make_rows(8)
    # one infinite advantage (what a reward of 1e308 makes of a group's normalisation), on the last rank
    # only: the other ranks' own losses are finite, and they must skip the step all the same
    split_rows(poisoned, world)[-1][0].advantage = math.inf
    skipped = step(model, opt, poisoned)
    after_skip, adam_state = full_state_dict(model), len(opt.state)
    applied = step(model, opt, make_rows(8, seed=1))
    fresh_model, fresh_opt = policy()
    fresh = step(fresh_model, fresh_opt, make_rows(8, seed=1))
    sd, fresh_sd = full_state_dict(model), full_state_dict(fresh_model)
    torch.save({"skipped": skipped, "after_skip": after_skip, "adam_state": adam_state, "applied": applied,
                "fresh": fresh, "sd": sd, "fresh_sd": fresh_sd}, f"{out}.rank{rank}")
    dist.barrier()


def test_a_non_finite_step_is_skipped_on_every_rank(tmp_path):
    """A real 2-rank step on a batch whose loss is infinite on one rank only is skipped on
    both (weights and AdamW state untouched, no NaN anywhere); the next batch then trains exactly as it
    would have without the skipped one."""
    from data.tiny_model import random_tiny_model

    out = str(tmp_path / "skip")
    spawn_ranks(skip_proc, 2, out)
    for rank in range(2):
        got = torch.load(f"{out}.rank{rank}")
        assert got["skipped"] == {M.SKIPPED: 1, M.SKIP_REASON: "non-finite loss"}, rank
        assert got["adam_state"] == 0, f"the skipped step fed rank {rank}'s optimizer"
        assert M.SKIPPED not in got["applied"] and got["applied"][M.LOSS] == got["fresh"][M.LOSS], rank
    got, init = torch.load(f"{out}.rank0"), random_tiny_model(seed=0).state_dict()  # full weights: rank 0's
    assert got["after_skip"].keys() == init.keys()
    for name in init:
        assert torch.equal(got["after_skip"][name], init[name]), name
        assert torch.equal(got["sd"][name], got["fresh_sd"][name]), name
        assert not torch.equal(got["sd"][name], init[name]), name


def zero_signal_proc(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from data.tiny_model import random_tiny_model
    from learner.batching import split_rows
    from learner.model import full_state_dict, shard
    from learner.step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    lc = LearnerConfig(lr=1e-2, micro_batch_size_per_gpu=3)
    cpu = torch.device("cpu")
    model = shard(random_tiny_model(seed=0), cpu)
    opt = torch.optim.AdamW(model.parameters(), lr=lc.lr)

    def step(rows):
        return train_step(model, opt, split_rows(rows, world)[rank], rows, lc, temperature=1.0, world=world,
                          pad_id=0, device=cpu)

    step(make_rows(8))   # a step with a signal: AdamW has momentum and second moments from here on
    before = full_state_dict(model)

    def moments():
        return [st[k].to_local().clone() if hasattr(st[k], "to_local") else st[k].clone()
                for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]

    kept = moments()
    flat = make_rows(8, seed=1)
    for row in flat:
        row.advantage = 0.0   # every group's rewards alike
    stats = step(flat)
    after = full_state_dict(model)
    torch.save({"stats": stats, "moved": [n for n in before if not torch.equal(before[n], after[n])],
                "moments_kept": all(torch.equal(a, b) for a, b in zip(kept, moments())),
                "steps": [int(st["step"]) for st in opt.state.values()]}, f"{out}.rank{rank}")
    dist.barrier()


def test_a_step_without_signal_moves_nothing_on_every_rank(tmp_path):
    """A real 2-rank step on groups whose advantages are all zero has a zero gradient: its metrics line says so
    (gradient norm 0), and neither the weights nor AdamW's state move (no coasting on the last step's momentum, no
    decay of the second moments that would blow up the next real step)."""
    out = str(tmp_path / "zero")
    spawn_ranks(zero_signal_proc, 2, out)
    for rank in range(2):
        got = torch.load(f"{out}.rank{rank}")
        assert got["stats"][M.GRAD_NORM] == 0.0 and M.SKIPPED not in got["stats"], rank
        assert got["moved"] == [], f"rank {rank}: a step without signal moved {got['moved'][:3]}"
        assert set(got["steps"]) == {1}, f"rank {rank}: AdamW counted the step without signal: {got['steps']}"
        assert got["moments_kept"], f"rank {rank}: AdamW's moments moved on a step without signal"
