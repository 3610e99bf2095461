# Two commands do all the set-up on a fresh machine:
#   make demo   # compare sync / recompute / loglinear on the embedded tiny preset (MLflow + Prefect, local)
#   make test   # the test suite (fast tier; slow and GPU tiers: make test-slow, make test-gpu)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch must be installed first: a bare torch requirement pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# DeepSpeed (the 'distributed' extra) is installed after the CPU torch so its trainer-rank tests run here too.
EXTRAS ?= dev,distributed

export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

# vLLM on CPU lives in its own venv (infra/install_vllm_cpu.sh); `make test` never needs it.
VLLM_VENV ?= .venv-vllm

.PHONY: setup demo test test-slow test-gpu test-vllm setup-vllm bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/python -m flows.compare_variants

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

$(VLLM_VENV)/vllm-env.sh: pyproject.toml infra/install_vllm_cpu.sh
	bash infra/install_vllm_cpu.sh $(VLLM_VENV)

setup-vllm: $(VLLM_VENV)/vllm-env.sh

# The vLLM engine against the trainer (tests/test_vllm_engine.py); on CUDA with the gpu extra
# installed, plain `pytest -m vllm` in that environment does the same.
test-vllm: setup-vllm
	. $(VLLM_VENV)/vllm-env.sh && $(VLLM_VENV)/bin/python -m pytest -q -m vllm -s

bench: setup
	$(BIN)/python -m bench.prox_logp
	$(BIN)/python -m bench.grading
	$(BIN)/python -m bench.orchestration_overhead

clean:
	rm -rf runs mlflow.db .prefect mlartifacts .a3po/team
