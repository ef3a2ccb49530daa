"""One command for a machine with a GPU: measurements first, kernel tests last, in one budget.

    make gpu-check                                               # = the next line, in .venv
    python benchmarks/gpu_check.py --budget-s 480 --out result.json
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --dry-run  # any machine: the plan and every set-up

Sections, in order (gpu_check/sections.py, with their estimates):
  versions         torch, Triton, CUDA, the device; kernels.versions' minimum-version check
  decode           decode attention as % of the measured copy bandwidth: 64x4k, 256x1k, 8x32k
                   (32 query / 8 KV heads of 128, bf16), eager and from a CUDA graph
  prefill_mixed    prefill attention TFLOP/s (4x2k, 1x8k) against the bf16 matmul peak, and a
                   mixed step (a 2k chunk after 4k of context beside 63 decodes at 4k) through
                   the worker's TritonPagedAttention
  parity_smollm2   SmolLM2 (--model-dir) against transformers on CUDA: fp32 greedy tokens and
                   logits; bf16 greedy, with the reference's margin at each divergence
  parity_families  the same for one tiny random model per supported family
  throughput       the benchmark workload on a random Llama-3.2-1B shape: tokens/s and time to
                   first token, CUDA graphs on and off
  memory_peak      the device's peak use after graph capture and the heaviest step, against
                   --gpu-memory-utilization 0.5
  tensor_parallel  llmserve up --tp 2 over gloo on one GPU against --tp 1, greedy
  kernel_tests     pytest --full-kernels on CUDA, with whatever budget is left

Budget: a section starts only if its estimate (cold: no compiled kernels on disk; warm:
some) fits in what is left of --budget-s, else it is recorded as skipped with the reason; one
still running when the budget ends is stopped. A section that raises is recorded as failed
and the rest still run. The JSON (--out) is rewritten after every section; the run ends with
one table of every section's status, seconds and key numbers. Exit status: 0 when nothing
failed (skips are not failures), 1 when a section failed, 2 on a usage error or without CUDA
(outside --dry-run and --smoke).
"""

import time

# The budget counts from here, before torch and the engine are imported: the window they fit
# in does too.
STARTED = time.monotonic()
