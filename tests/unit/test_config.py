"""cluster/config.py: the root config, overrides, aliases, cross-section checks."""
from __future__ import annotations

import pytest
import yaml

from cluster.config import DEFAULT_YAML, load_config
from runbase.configload import ConfigError

pytestmark = pytest.mark.unit


def test_load_default_matches_yaml():
    cfg = load_config()
    raw = yaml.safe_load(DEFAULT_YAML.read_text())
    for section, values in raw.items():
        for key, value in values.items():
            got = getattr(getattr(cfg, section), key)
            if (section, key) == ("actors", "engine"):   # `auto`, resolved as the config loads (hf: CPU actors)
                assert got != "auto" and got, (section, key)
                continue
            assert got == pytest.approx(value) if isinstance(value, float) else got == value, (section, key)


def test_overrides_and_alias():
    cfg = load_config(overrides=["learner.lr=1e-5", "max_staleness=0"])
    assert isinstance(cfg.learner.lr, float) and cfg.learner.lr == pytest.approx(1e-5)
    assert cfg.buffer.max_staleness == 0
    assert load_config().buffer.max_staleness != 0


@pytest.mark.parametrize("overrides,key", [
    (["learner.lrr=1"], "learner.lrr"),
    (["cluster.learners=3"], "learner.groups_per_step"),
    (["weightsync.sync_every=3", "max_staleness=1"], "buffer.max_staleness"),
    (["actors.n=abc"], "actors.n"),
    (["actors.n=1"], "actors.n"),                            # GRPO's baseline is the group's mean
    (["trainer.val_samples=0"], "trainer.val_samples"),      # not trainer.val_every
    (["actors.n=0", "algorithm.adv_estimator=reinforce_pp"], "actors.n"),
    (["buffer.min_reward=20"], "buffer.min_reward"),
    (["buffer.max_reward=.inf"], "buffer.max_reward"),
    (["trainer.val_every_s=-5"], "trainer.val_every_s"),
    (["trainer.val_every_s=.nan"], "trainer.val_every_s"),
    (["learner.grad_clip=-1"], "learner.grad_clip"),        # would flip every gradient
    (["critic.grad_clip=-1"], "critic.grad_clip"),
    (["learner.weight_decay=-1"], "learner.weight_decay"),
    (["critic.weight_decay=-0.1"], "critic.weight_decay"),
    (["buffer.max_response_tokens=0"], "buffer.max_response_tokens"),
    (["buffer.max_response_tokens=7"], "buffer.max_response_tokens"),  # below actors.max_tokens (8)
    (["buffer.deadletter_maxlen=-1"], "buffer.deadletter_maxlen"),
    (["task.num_val_prompts=0"], "task.num_val_prompts"),
    (["cluster.num_cpus=-1"], "cluster.num_cpus"),
    (["cluster.actor_silent_s=0"], "cluster.actor_silent_s"),  # every live actor would be killed at once
    (["cluster.redis_url=notaurl"], "cluster.redis_url"),
    (["cluster.redis_url=redis://127.0.0.1:99999/0"], "cluster.redis_url"),   # redis-py: a bare ValueError later
    (["cluster.run_id=../../x"], "cluster.run_id"),          # would leave runs/
    (["cluster.run_id=a/b"], "cluster.run_id"),
    ([f"cluster.run_id={'a' * 101}"], "cluster.run_id"),     # a file name too long once it names runs/<run_id>
    (["learner.lr=.nan"], "learner.lr"),                     # every float: no NaN or inf reaches a process
    (["learner.lr=.inf"], "learner.lr"),
    (["actors.temperature=.inf"], "actors.temperature"),
    (["weightsync.timeout_s=.nan"], "weightsync.timeout_s"),
    (["weightsync.timeout_s=1e-6"], "weightsync.timeout_s"),   # a 0 ms store timeout failed the learner at start
    # what vLLM refuses only once each actor starts (restarted until the job died, naming none of our keys)
    (["actors.engine=vllm", "actors.temperature=5"], "actors.temperature"),
    (["actors.engine=vllm", "actors.stop=['']"], "actors.stop"),
    (["actors.engine=vllm", "actors.stop=['a','a']"], "actors.stop"),
    (["actors.stop=['a']"], "actors.stop"),                   # the HF engine would ignore it
    (["actors.max_model_len=-5"], "actors.max_model_len"),
    (["actors.max_model_len=8"], "actors.max_model_len"),     # no room for a prompt beside max_tokens 8
    (["actors.cpu_kvcache_gib=0"], "actors.cpu_kvcache_gib"),
    (["trainer.val_gpu_memory_utilization=0"], "trainer.val_gpu_memory_utilization"),
    (["trainer.val_gpu_memory_utilization=1.5"], "trainer.val_gpu_memory_utilization"),
    (["learner.lora.rank=-1"], "learner.lora.rank"),
    (["learner.lora.alpha=0"], "learner.lora.alpha"),
    (["learner.lora.dropout=1"], "learner.lora.dropout"),
    (["learner.lora.target_modules=[]"], "learner.lora.target_modules"),
    (["learner.lora.target_modules=linear"], "learner.lora.target_modules"),  # a name is a list's: [linear]
    # vLLM has no LoRA layer on the built-in Qwen2's output head: refused for actors and the evaluator alike
    (["learner.lora.rank=8", "actors.engine=vllm", "learner.lora.target_modules=[q_proj,lm_head]"],
     "learner.lora.target_modules"),
    (["learner.lora.rank=8", "trainer.val_engine=vllm", "learner.lora.target_modules=[lm_head]"],
     "learner.lora.target_modules"),
    (["actors.vllm_max_loras=0"], "actors.vllm_max_loras"),
    (["actors.vllm_max_loras=9"], "actors.vllm_max_loras"),
])
def test_config_errors_name_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert e.value.key == key
    assert key in str(e.value)


def test_one_sample_per_prompt_is_taken_where_the_baseline_is_not_the_group():
    for estimator in ("gae", "reinforce_pp"):
        assert load_config(overrides=["actors.n=1", f"algorithm.adv_estimator={estimator}"]).actors.n == 1


def test_cross_checks_pass_when_consistent():
    cfg = load_config(overrides=["cluster.learners=4", "weightsync.sync_every=3", "max_staleness=2"])
    assert cfg.cluster.learners == 4 and cfg.weightsync.sync_every == 3


def test_start_main_reports_config_error(capsys, monkeypatch):
    import cluster.start as start

    def boom(*a, **k):
        raise AssertionError("must not start a job on a bad config")

    monkeypatch.setattr(start.signal, "signal", boom)
    assert start.main(["learner.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "learner.lrr" in err


def test_learner_speed_knobs_parse_from_overrides_and_refuse_impossible_ones():
    """learner.kernels (a value YAML does not turn into a boolean), varlen needing packed rows, liger needing a GPU."""
    from cluster.config import load_config
    from runbase.configload import ConfigError

    cfg = load_config(overrides=["learner.kernels=none", "learner.plain_one_rank=true", "learner.pack_sequences=true",
                                 "learner.attn_implementation=varlen", "weightsync.overlap=true"])
    assert (cfg.learner.kernels, cfg.learner.plain_one_rank, cfg.weightsync.overlap) == ("none", True, True)
    with pytest.raises(ConfigError, match="attn_implementation"):
        load_config(overrides=["learner.attn_implementation=varlen"])
    assert load_config(overrides=["trainer.profile_steps=[2,4]"]).trainer.profile_steps == [2, 4]
    for bad in ("[3,1]", "[2]", "[-1,2]"):
        with pytest.raises(ConfigError, match="profile_steps"):
            load_config(overrides=[f"trainer.profile_steps={bad}"])
    for kernels in ("liger", "liger_head"):
        with pytest.raises(ConfigError, match="kernels"):
            load_config(overrides=[f"learner.kernels={kernels}", "learner.device=cpu"])


def test_default_reward_range_holds_every_scorer():
    """The ingest rejects rewards outside buffer.[min_reward, max_reward]; every reward actors compute is
    clamped to [0, FULL_SCORE] (rewards/scorers.py compute_score), so the default must contain that."""
    from rewards.scorers import FULL_SCORE, compute_score

    b = load_config().buffer
    assert b.min_reward <= 0.0 and FULL_SCORE <= b.max_reward
    assert compute_score("gsm8k", "#### 42", "42") == FULL_SCORE


def test_yaml_that_does_not_parse_is_a_config_error_naming_file_or_key(tmp_path):
    """A config file or an override value that is not YAML: ConfigError with the parser's complaint and where,
    not the parser's traceback (cluster.start printed one)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("buffer:\n  max_staleness: [1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml'?: not valid YAML: expected ',' or '\]'.* at line 3, column 1"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match=r"buffer.max_staleness'?: value '\[1' is not valid YAML .*line 1, column 3"):
        load_config(None, ["buffer.max_staleness=[1"])


PATH_OVERRIDES = {"model.path": "./model", "critic.model_path": "critic", "buffer.replay_dir": "rec",
                  "data.train_files": "[train.parquet]", "data.val_files": "[./val.parquet]"}


def _dataset(where):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "reverse", "prompt": [{"role": "user", "content": "abcd"}], "ability": "x",
             "reward_model": {"style": "rule", "ground_truth": "dcba"}, "extra_info": None}]
    for name in ("train", "val"):
        pq.write_table(pa.Table.from_pylist(rows), where / f"{name}.parquet")


def test_relative_paths_are_made_absolute_against_the_launchers_directory(tmp_path, monkeypatch):
    """The job's processes run in Ray's directory (on a joined cluster: wherever `ray start` ran), not the
    user's: `data.train_files=[train.parquet]` passed the launcher's check, then the learner failed with
    "train.parquet: file not found" after every process had started (a relative model.path: "Repo id must use
    alphanumeric chars ... './model'"). Every path key is made absolute once, when the config loads."""
    _dataset(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, [f"{k}={v}" for k, v in PATH_OVERRIDES.items()])
    assert cfg.model.path == f"{tmp_path}/model" and cfg.critic.model_path == f"{tmp_path}/critic"
    assert cfg.buffer.replay_dir == f"{tmp_path}/rec"
    assert cfg.data.train_files == [f"{tmp_path}/train.parquet"]
    assert cfg.data.val_files == [f"{tmp_path}/val.parquet"]
    default = load_config()   # the built-in model and the empty keys stay as they are
    assert default.model.path == "builtin:tiny-reverse"
    assert (default.critic.model_path, default.buffer.replay_dir) == ("", "")


def test_a_run_recorded_with_relative_paths_resumes(tmp_path, monkeypatch, caplog):
    """A config.yaml written before paths were made absolute holds them as given: resumed from the same
    directory with the same arguments, it is the same run, not a changed model.path or dataset."""
    from cluster.launch import Job

    _dataset(tmp_path)
    monkeypatch.chdir(tmp_path)
    given = ["model.path=./model", "data.train_files=[train.parquet]", "data.val_files=[val.parquet]"]
    first = Job(load_config(None, ["cluster.run_dir=run", *given]))
    first._lock.close()
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert recorded["model"]["path"] == f"{tmp_path}/model"   # written absolute now
    recorded["model"]["path"] = "./model"                     # as the old version wrote them
    recorded["data"].update(train_files=["train.parquet"], val_files=["val.parquet"])
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(recorded))
    (tmp_path / "run" / "job.json").write_text('{"run_id": "r1", "redis_url": "redis://x"}')
    (tmp_path / "run" / "checkpoints" / "step-00000004").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000004" / "COMPLETE").write_text('{"step": 4}')
    with caplog.at_level("WARNING", logger="cluster"):
        resumed = Job(load_config(None, ["cluster.run_dir=run", "cluster.resume=true", *given]))
    resumed._lock.close()
    # the same run: its id and directory, and no setting changed (a changed model.path or dataset is refused,
    # any other change is said)
    assert (resumed.run_id, resumed.run_dir) == ("r1", tmp_path / "run")
    assert not [r for r in caplog.records if "the config differs" in r.getMessage()]
    rewritten = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert rewritten["model"]["path"] == f"{tmp_path}/model"
    assert rewritten["data"]["train_files"] == [f"{tmp_path}/train.parquet"]


def test_the_learner_reads_its_view_of_the_root_config_and_takes_only_a_resolved_weight_backend():
    from learner.config import LearnerView

    cfg = load_config(overrides=["weightsync.backend=gloo", "actors.temperature=0.7", "actors.max_tokens=12",
                                 "actors.engine=vllm", "actors.stop=[x]", "max_staleness=3", "cluster.learner_stall_s=5"])
    view = LearnerView.of(cfg)
    assert (view.temperature, view.max_tokens, view.stop, view.max_staleness, view.stall_s) == (0.7, 12, ("x",), 3, 5)
    assert view.learner is cfg.learner and view.weightsync.backend == "gloo"
    assert view.weightsync.dtype == cfg.actors.dtype  # the root configuration resolved `auto`
    with pytest.raises(ConfigError, match="weightsync.backend"):  # the launcher (or a builder) resolves auto
        LearnerView.of(load_config())


def test_engine_auto_is_vllm_for_cuda_actors_where_it_is_installed_and_hf_otherwise():
    import importlib.util

    from actors.config import ActorConfig

    assert load_config().actors.engine == "hf"   # the default job: CPU actors
    installed = importlib.util.find_spec("vllm") is not None
    cuda = load_config(overrides=["actors.device=cuda"]).actors
    assert cuda.engine == ("vllm" if installed else "hf")
    for vllm_installed, device, want in [(True, "cuda:1", "vllm"), (False, "cuda", "hf"), (True, "cpu", "hf")]:
        a = ActorConfig(device=device)
        a.resolve_engine(vllm_installed)
        assert a.engine == want, (vllm_installed, device)
    a = ActorConfig(device="cuda", top_p=0.9)   # valid for hf; once auto resolves to vLLM the vLLM check applies
    with pytest.raises(ConfigError, match="top_p"):
        a.resolve_engine(True)
    assert load_config(overrides=["actors.engine=hf", "actors.device=cuda"]).actors.engine == "hf"  # as asked


def test_lora_is_off_by_default_and_served_by_vllm_on_the_decoders_linear_layers():
    """learner.lora.rank 0 (off) leaves every engine choice as it was; with a rank, vLLM actors and the vLLM
    evaluator take `all-linear` and named linear layers, and an adapter on the head is refused with a message that
    names the module and what to set instead."""
    assert load_config().learner.lora.rank == 0
    assert load_config(overrides=["actors.engine=vllm"]).actors.engine == "vllm"
    cfg = load_config(overrides=["learner.lora.rank=8", "learner.lora.target_modules=[q_proj,v_proj]"])
    assert (cfg.learner.lora.rank, cfg.learner.lora.target_modules, cfg.actors.engine) == (8, ["q_proj", "v_proj"], "hf")
    for served in (["actors.engine=vllm"], ["trainer.val_engine=vllm", "learner.lora.target_modules=[q_proj,o_proj]"]):
        assert load_config(overrides=["learner.lora.rank=8", *served]).learner.lora.rank == 8
    with pytest.raises(ConfigError, match=r"\['lm_head'\].*actors.engine=hf"):
        load_config(overrides=["learner.lora.rank=8", "actors.engine=vllm",
                               "learner.lora.target_modules=[v_proj,lm_head]"])
