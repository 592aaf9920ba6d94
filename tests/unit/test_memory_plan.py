"""cluster/memory.py: every process's share of a GPU estimated from the model and the config, and a job that
cannot fit one card refused at start-up naming the shares, on real model shapes (meta tensors: no memory)."""
from __future__ import annotations

import pytest
import torch

from cluster.config import load_config
from cluster.memory import GIB, MemoryPlanError, check, lora_numel, model_dims, model_numel, plan

pytestmark = pytest.mark.unit

H100 = 81559 * 2**20  # nvidia-smi's memory.total of the lent H100 80GB HBM3


def shape(name: str) -> tuple[int, dict]:
    from data.shapes import QWEN2_SHAPES, model_config
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(name))
    s = QWEN2_SHAPES[name]
    return sum(p.numel() for p in model.parameters()), {
        "hidden": s["hidden_size"], "intermediate": s["intermediate_size"], "layers": s["num_hidden_layers"],
        "vocab": s["vocab_size"], "heads": s["num_attention_heads"], "kv_heads": s["num_key_value_heads"]}


GPU_JOB = ["actors.engine=vllm", "actors.device=cuda", "learner.device=cuda", "actors.dtype=bfloat16",
           "learner.param_dtype=bfloat16", "cluster.actors=1", "actors.max_tokens=4096", "buffer.max_response_tokens=4096",
           "learner.use_dynamic_bsz=true", "learner.max_tokens_per_micro_batch=16384",
           "actors.kv_cache_memory_bytes=10737418240"]


def shares(name: str, *overrides: str) -> dict:
    numel, dims = shape(name)
    cfg = load_config(overrides=[*GPU_JOB, *overrides])
    return plan(cfg, numel, dims, n_gpus=1, total=H100, backend="cuda_ipc")


def test_a_7b_learner_with_its_full_fp32_state_beside_an_engine_is_refused_naming_every_share():
    gpus = shares("7b", "trainer.val_engine=vllm")
    with pytest.raises(MemoryPlanError) as e:
        check(gpus, H100)
    msg = str(e.value)
    for what in ("GPU 0", "learner-0", "actor-0", "evaluator", "optimizer state", "kv cache", "received weights",
                 "learner.param_offload=true", "learner.master_dtype=bfloat16"):
        assert what in msg, (what, msg)
    learner = next(s for s in gpus[0] if s.who == "learner-0")
    numel, _ = shape("7b")
    assert learner.parts["optimizer state"] == 8 * numel and learner.parts["weights"] == 4 * numel


def test_a_7b_learner_offloaded_with_bf16_masters_fits_beside_its_engine():
    gpus = shares("7b", "learner.param_offload=true", "learner.master_dtype=bfloat16", "learner.plain_compute=autocast",
                  "learner.activation_checkpointing=true", "learner.max_tokens_per_micro_batch=16384",
                  "actors.kv_cache_memory_bytes=8589934592")
    lines = check(gpus, H100)
    assert len(lines) == 1 and "learner-0" in lines[0] and "gathered layers (offload)" in lines[0]
    used = sum(s.total for s in gpus[0])
    assert 30 * GIB < used < 0.95 * H100  # the engine's weights and the bf16 copy it receives alone are 28 GiB


def test_a_15b_job_with_the_learners_hf_evaluation_and_fp32_weight_buffers_costs_more_than_without():
    """The 1.5B job: the learner's own HF evaluation engine (a copy in the engines' bf16) and fp32 weight buffers
    in each subscriber are shares the plan shows; bf16 publication halves the buffers."""
    numel, _ = shape("1.5b")
    fp32 = {s.who: s for s in shares("1.5b", "weightsync.dtype=float32")[0]}
    bf16 = {s.who: s for s in shares("1.5b", "trainer.val_engine=vllm")[0]}
    assert fp32["learner-0"].parts["evaluation engine"] == 2 * numel and "evaluation engine" not in bf16["learner-0"].parts
    assert fp32["actor-0"].parts["received weights"] == 4 * numel == 2 * bf16["actor-0"].parts["received weights"]
    check(shares("1.5b", "trainer.val_engine=vllm", "learner.activation_checkpointing=true",
                 "actors.kv_cache_memory_bytes=8589934592"), H100)  # fits one H100 with 8 GiB of KV per engine


@pytest.mark.parametrize("targets", ["all-linear", "[q_proj,v_proj,lm_head]"])
def test_the_lora_adapters_size_is_peft_s(targets):
    """lora_numel from the config's dimensions equals the parameters PEFT puts on the real 1.5b shape (meta)."""
    from data.shapes import model_config
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from engines.lora import adapter_state_dict, peft_config

    cfg = load_config(overrides=["learner.lora.rank=16", f"learner.lora.target_modules={targets}"])
    with torch.device("meta"):
        peft = get_peft_model(AutoModelForCausalLM.from_config(model_config("1.5b")), peft_config(cfg.learner.lora))
    assert lora_numel(cfg.learner.lora, shape("1.5b")[1]) == sum(t.numel() for t in adapter_state_dict(peft).values())


def test_a_7b_lora_learner_in_bf16_fits_beside_its_engine_without_offload():
    """A rank-32 adapter on a bf16 7B base: gradients and AdamW state for the adapter alone, the adapter alone
    published and received; the learner and one vLLM engine fit one H100 with nothing offloaded."""
    numel, dims = shape("7b")
    gpus = shares("7b", "learner.lora.rank=32", "learner.master_dtype=bfloat16", "learner.plain_compute=autocast",
                  "learner.activation_checkpointing=true", "actors.kv_cache_memory_bytes=8589934592")
    lines = check(gpus, H100)
    learner, actor = (next(s for s in gpus[0] if s.who == who) for who in ("learner-0", "actor-0"))
    adapter = lora_numel(load_config(overrides=["learner.lora.rank=32"]).learner.lora, dims)
    assert 0 < adapter < numel / 50
    assert learner.parts["optimizer state"] == 4 * adapter and learner.parts["gradients"] == 2 * adapter
    assert learner.parts["weights"] == 2 * (numel + adapter) and "gathered layers (offload)" not in learner.parts
    assert actor.parts["received weights"] == 2 * adapter and actor.parts["LoRA slots"] == 2 * 2 * adapter
    assert len(lines) == 1 and "learner-0" in lines[0]
    full = shares("7b", "learner.master_dtype=bfloat16", "learner.plain_compute=autocast",
                  "learner.activation_checkpointing=true", "actors.kv_cache_memory_bytes=8589934592")
    with pytest.raises(MemoryPlanError):   # the same job training every weight does not fit
        check(full, H100)
    four = shares("7b", "learner.lora.rank=32", "learner.master_dtype=bfloat16", "learner.plain_compute=autocast",
                  "learner.activation_checkpointing=true", "actors.kv_cache_memory_bytes=8589934592",
                  "actors.vllm_max_loras=4")   # each adapter slot vLLM runs side by side is counted
    assert next(s for s in four[0] if s.who == "actor-0").parts["LoRA slots"] == 4 * 2 * adapter


def test_model_numel_reads_the_safetensors_headers(tmp_path):
    from data.shapes import save_random_model

    out = save_random_model("tiny", tmp_path / "m", dtype="float32")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model_numel(out) == sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())
    assert model_dims(out)["layers"] == 2
    with pytest.raises(ValueError, match="safetensors"):
        model_numel(tmp_path)
