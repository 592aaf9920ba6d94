"""learner.lora: the learner trains a PEFT adapter on a frozen base (one plain rank, and FSDP2 over 2 gloo ranks),
publishes the adapter alone, the HF engine serves the base with it and proves by its checksum which adapter it
holds, and an export merges it into a plain transformers folder."""
from __future__ import annotations

import pytest
import torch

from data.tasks import TaskConfig
from data.tiny_model import random_tiny_model, resolve_model_path
from engines.hf_engine import HFEngine
from engines.lora import adapter_state_dict, apply_lora, initial_adapter, published_state
from learner.config import LearnerConfig, LoraConfig
from test_fsdp import make_rows, spawn_ranks
from weightsync.flat import checksum

LORA = LoraConfig(rank=4, alpha=8.0)   # every linear layer of the tiny model but the head: 2 layers x 7 x (A, B)
# the learner's path with an adapter on the head too (its logprob head adds the adapter's term chunk by chunk)
HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
LORA_HEAD = LoraConfig(rank=4, alpha=8.0, target_modules=HEAD)
ADAPTER_TENSORS = 28 + 2
STEPS = 2   # B starts at zero, so A has no gradient in the first step: after two every adapter tensor has moved
VERSION = STEPS + 1


def lora_proc(rank: int, world: int, port: int, out: str, plain: bool, redis_url: str, run_id: str,
              wire: str) -> None:
    """One learner rank: a LoRA policy as build_policy makes it, STEPS steps, then the learner's own publication of
    version STEPS + 1 (to no member: what it sends and the checksum it records are the point)."""
    import torch.distributed as dist

    from learner.batching import split_rows
    from learner.model import full_state_dict
    from learner.phases import PhaseReport
    from learner.publish import Publication
    from learner.step import train_step
    from learner.train import build_policy
    from runbase.keys import Keys, connect
    from weightsync.config import WeightSyncConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    lc = LearnerConfig(lr=1e-2, micro_batch_size_per_gpu=3, plain_one_rank=plain, lora=LORA_HEAD)
    cpu = torch.device("cpu")
    model, opt = build_policy(lc, "", cpu, model=random_tiny_model(seed=0))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    for step in range(STEPS):
        rows = make_rows(8, seed=step)
        train_step(model, opt, split_rows(rows, world)[rank], rows, lc, temperature=1.0, world=world, pad_id=0,
                   device=cpu)
    full = full_state_dict(model)
    resumed = checkpoint_round_trip(lc, model, opt, f"{out}.run", rank)
    r, keys = (connect(redis_url), Keys(run_id)) if rank == 0 else (None, None)
    pub = Publication(WeightSyncConfig(backend="gloo", dtype=wire), model=model, rank=rank, world=world, group=None,
                      device=cpu, report=PhaseReport(None, None, 0), r=r, keys=keys)
    pub.publish(VERSION)
    if rank == 0:
        torch.save({"sd": full, "resumed": resumed, "trainable": trainable, "adam_state": len(opt.state),
                    "bytes": pub.publisher.stats["bytes"], "checksum": r.hget(keys.checksums, VERSION).decode()}, out)
    pub.close()
    dist.barrier()


def checkpoint_round_trip(lc, model, opt, run_dir: str, rank: int) -> dict:
    """The learner's DCP checkpoint of `model` and `opt` (collective), resumed into a fresh policy: its full
    weights (rank 0) and AdamW state, and the step it resumed at."""
    from learner.checkpoint import Checkpointer
    from learner.config import TrainerConfig
    from learner.model import full_state_dict
    from learner.train import build_policy

    def checkpointer(m, o):
        return Checkpointer(TrainerConfig(), model=m, opt=o, ppo=None, rank=rank, group=None, run_dir=run_dir,
                            batches=None)

    checkpointer(model, opt).save(STEPS)
    fresh, fresh_opt = build_policy(lc, "", torch.device("cpu"), model=random_tiny_model(seed=1))
    step = checkpointer(fresh, fresh_opt).resume()
    moments = [float(s["exp_avg_sq"].full_tensor().sum() if hasattr(s["exp_avg_sq"], "full_tensor")
                     else s["exp_avg_sq"].sum()) for s in fresh_opt.state.values()]
    return {"step": step, "sd": full_state_dict(fresh), "adam_state": len(fresh_opt.state), "moments": moments}


def run_learner(tmp_path, world: int, plain: bool, wire: str, redis_url: str, run_id: str) -> dict:
    out = str(tmp_path / f"lora-{world}-{plain}.pt")
    spawn_ranks(lora_proc, world, out, plain, redis_url, f"{run_id}-{world}", wire)
    return torch.load(out)


def test_the_adapter_alone_trains_and_travels_on_one_plain_rank_and_on_two_fsdp_ranks(tmp_path, redis_url, run_id):
    """Only the adapter requires grad, has AdamW state and moves; the base stays bit for bit the model's; 2 FSDP2
    ranks train it as one plain rank does; the learner's publication sends exactly the adapter's tensors (its
    bytes: their elements x the wire dtype's size, far below the model's) and records their checksum."""
    plain = run_learner(tmp_path, 1, True, "float32", redis_url, run_id)
    fsdp = run_learner(tmp_path, 2, False, "bfloat16", redis_url, run_id)
    init_model = apply_lora(random_tiny_model(seed=0), LORA_HEAD)   # the same adapter init on every rank and engine
    init = init_model.state_dict()
    lora_names = sorted(n for n in init if "lora_" in n)
    assert len(lora_names) == ADAPTER_TENSORS and any(n.startswith("base_model.model.lm_head.") for n in lora_names)
    for got, wire in ((plain, torch.float32), (fsdp, torch.bfloat16)):
        assert got["sd"].keys() == init.keys()
        assert got["trainable"] == lora_names and got["adam_state"] == ADAPTER_TENSORS
        for name, t in got["sd"].items():
            assert torch.equal(t, init[name]) != (name in lora_names), name   # the base frozen, every adapter moved
        adapter = published_state(init_model, got["sd"])
        assert len(adapter) == ADAPTER_TENSORS and all(".lora_" in k and "default" not in k for k in adapter)
        size = wire.itemsize
        assert got["bytes"] == sum(t.numel() * size for t in adapter.values())
        assert got["bytes"] * 5 < sum(t.numel() * size for t in init.values())
        assert got["checksum"] == checksum({k: t.to(wire) for k, t in adapter.items()})
        # the existing DCP checkpoint covers a LoRA policy: a fresh one (another base init) resumes it exactly
        resumed = got["resumed"]
        assert (resumed["step"], resumed["adam_state"]) == (STEPS, ADAPTER_TENSORS) and min(resumed["moments"]) > 0
        assert all(torch.equal(resumed["sd"][k], t) for k, t in got["sd"].items())
    for name in lora_names:   # atol: as test_fsdp's 2-rank vs 1-rank step (1% of one AdamW step of lr 1e-2)
        torch.testing.assert_close(fsdp["sd"][name], plain["sd"][name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.fixture(scope="module")
def policy():
    """The learner's LoRA policy on the built-in model (plain one rank) with a stand-in for trained adapters:
    adapter(k) sets every adapter tensor to seeded random values (B non-zero: the adapter changes the output)."""
    from learner.train import build_policy

    path = resolve_model_path("builtin:tiny-reverse", TaskConfig())
    lc = LearnerConfig(plain_one_rank=True, lora=LORA)
    model, _opt = build_policy(lc, path, torch.device("cpu"))

    def adapter(k: int) -> dict:
        gen = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for _name, p in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        return {n: t.detach().clone() for n, t in adapter_state_dict(model).items()}

    return path, model, adapter


def logprobs(model, seqs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=seqs).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None])[..., 0]


def fresh_adapter(path: str, lora=LORA, dtype=torch.float32) -> dict:
    """The adapter of a fresh PEFT model over the base at `path`: as initialised, nothing trained."""
    from transformers import AutoModelForCausalLM

    return adapter_state_dict(apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), lora))


@pytest.mark.parametrize("lora", [LORA, LORA_HEAD], ids=["all-linear", "with-head"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_version_0s_adapter_is_built_from_the_models_configuration_alone(lora, dtype):
    """What the vLLM engine serves as version 0 (no second copy of the base in memory): the very tensors, bit for
    bit, that apply_lora puts on the real model, with or without an adapter on the head, in the engine's dtype."""
    path = resolve_model_path("builtin:tiny-reverse", TaskConfig())
    built, fresh = initial_adapter(path, lora, dtype), fresh_adapter(path, lora, getattr(torch, dtype))
    assert built.keys() == fresh.keys() and len(built) == (ADAPTER_TENSORS if lora is LORA_HEAD else 28)
    for k, t in fresh.items():
        assert built[k].dtype == t.dtype and torch.equal(built[k], t), k
    a = [t for k, t in built.items() if ".lora_A." in k]
    assert all(t.abs().max() > 0 for t in a) and not torch.equal(a[0], a[2])   # A drawn, each its own draw
    assert all(not t.any() for k, t in built.items() if ".lora_B." in k)       # B zero: version 0 is the base


SEQS = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))


def test_the_hf_engine_serves_the_adapter_and_its_checksum_tells_which_one_it_holds(policy):
    path, model, adapter = policy
    engine = HFEngine(path, lora=LORA)
    # version 0: the adapter every learner rank and engine starts from (a fixed seed), so one checksum everywhere
    assert engine.checksum == checksum(fresh_adapter(path))
    v1, v2 = adapter(1), adapter(2)
    c1, c2 = checksum(v1), checksum(v2)
    engine.load_weights(v1, 1, c1)
    assert (engine.version, engine.checksum) == (1, c1) and len(v1) == ADAPTER_TENSORS - 2   # all-linear: no head
    adapter(1)   # the learner's model holding v1: the engine computes exactly its logprobs, not the base's
    torch.testing.assert_close(logprobs(engine.model, SEQS), logprobs(model, SEQS), rtol=0, atol=1e-5)
    base = HFEngine(path)
    assert (logprobs(base.model, SEQS) - logprobs(engine.model, SEQS)).abs().max() > 1e-2
    # an engine that missed version 2 shows v1's checksum, not the learner's v2: the mismatch is visible
    assert c2 != c1 and engine.checksum != c2
    first = next(iter(v2))
    refused = {"extra": {**v2, "base_model.model.lm_head.weight": torch.zeros(1)},
               "missing": {k: t for k, t in v2.items() if k != first},
               "shape": {**v2, first: v2[first][:1]}}
    for why, sd in refused.items():   # strict: every adapter tensor, of its shape, and nothing else
        with pytest.raises(ValueError):
            engine.load_weights(sd, 2, checksum(sd))
        assert (engine.version, engine.checksum) == (1, c1), why


def test_a_bf16_engine_holds_the_adapter_as_it_travels(policy):
    """weightsync.dtype bfloat16: the adapter travels in bf16, the engine holds those bits (its checksum the
    publication's), and an fp32 adapter sent to it is proven against the checksum it arrived with."""
    path, _model, adapter = policy
    engine = HFEngine(path, dtype="bfloat16", lora=LORA)
    wire = {k: t.to(torch.bfloat16) for k, t in adapter(3).items()}
    engine.load_weights(wire, 1, checksum(wire))
    assert engine.checksum == checksum(wire)
    assert all(t.dtype == torch.bfloat16 for t in engine.held().values())
    with pytest.raises(RuntimeError, match="checksum"):
        engine.load_weights(adapter(4), 2, checksum(wire))


def test_export_merges_the_adapter_into_a_plain_transformers_folder(policy, tmp_path):
    """trainer.export_hf / cluster.export with LoRA: `out` holds the merged model (no PEFT needed to load it),
    whose logprobs are the learner's PEFT model's; PEFT's adapter folder beside it holds the very adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.evaluation import ADAPTER_SUFFIX, export_state_dict

    path, model, adapter = policy
    sd = adapter(5)
    out = str(tmp_path / "policy")
    assert export_state_dict(path, sd, AutoTokenizer.from_pretrained(path), out, lora=LORA) == out
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora_" in n for n in exported.state_dict())
    torch.testing.assert_close(logprobs(exported, SEQS), logprobs(model, SEQS), rtol=0, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(path)
    assert (logprobs(base, SEQS) - logprobs(exported, SEQS)).abs().max() > 1e-2   # the adapter is in it
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), out + ADAPTER_SUFFIX)
    assert checksum(adapter_state_dict(reloaded)) == checksum(sd)
    torch.testing.assert_close(logprobs(reloaded, SEQS), logprobs(model, SEQS), rtol=0, atol=1e-5)


def test_an_adapter_on_the_head_takes_no_dropout_and_no_liger_head():
    """The learner's logprob head adds the head adapter's term itself, recomputing chunks in backward without RNG
    (so no dropout there), and liger's fused head would leave it out: both are refused as the policy is built."""
    from learner.model import apply_liger

    with pytest.raises(ValueError, match="dropout"):
        apply_lora(random_tiny_model(seed=0), LoraConfig(rank=4, dropout=0.1, target_modules=HEAD))
    apply_lora(random_tiny_model(seed=0), LoraConfig(rank=4, dropout=0.1))   # all-linear: no adapter on the head
    with pytest.raises(ValueError, match="liger"):
        apply_liger(apply_lora(random_tiny_model(seed=0), LORA_HEAD))


def test_the_published_adapter_is_peft_s_naming_of_the_live_parameters():
    """published_state works the adapter's names out with PEFT once, then reads them from the model (views of the
    parameters) or from any state dict of the model's keys (a gathered one): the same tensors PEFT would pick."""
    model = apply_lora(random_tiny_model(seed=0), LORA_HEAD)
    first = published_state(model)
    assert first.keys() == adapter_state_dict(model).keys() and len(first) == 2 * 7 * 2 + 2
    name = next(k for k in first if k.endswith("lora_B.weight"))
    with torch.no_grad():
        first[name].add_(1.0)   # a view: the parameter itself moved
    again = published_state(model)
    assert torch.equal(again[name], first[name]) and again[name].abs().min() >= 1.0
    copies = {k: t.detach().clone() for k, t in model.state_dict().items()}
    gathered = published_state(model, copies)
    assert gathered.keys() == first.keys() and all(any(t is c for c in copies.values()) for t in gathered.values())
