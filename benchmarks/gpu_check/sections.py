"""The sections, in the order they run: measurements first, the kernel tests last.

Estimates are seconds on one H200, cold (an empty Triton cache: every kernel variant a
section launches compiles first, a few seconds each) and warm (compiled by an earlier run on
the same machine). They are what the budget is planned with: each run records every
section's real seconds beside its estimate, and these follow the cold H200 run of 2026-12-04
(decode 7 s, prefill 4, families 71, throughput 23, memory 29, tensor parallel 68, kernel
tests 287) with a margin; the warm ones are guesses until a warm run.
"""

from __future__ import annotations

from gpu_check.runner import Section

SECTIONS = [
    Section("versions", "torch, Triton, CUDA and the device; kernels.versions' check", 2, 1, "versions:run"),
    Section(
        "decode",
        "decode attention bandwidth against copy bandwidth: 64x4k, 256x1k, 8x32k, eager and CUDA graph",
        15,
        8,
        "decode:run",
    ),
    Section(
        "prefill_mixed",
        "prefill attention TFLOP/s (4x2k, 1x8k) and a mixed step of a 2k chunk beside 63 decodes",
        15,
        8,
        "prefill:run",
    ),
    Section(
        "parity_smollm2",
        "SmolLM2 against transformers: fp32 greedy + logits, bf16 margins at divergences",
        60,
        30,
        "parity:smollm2",
    ),
    Section(
        "parity_families",
        "a tiny random model per family against transformers, fp32 and bf16",
        90,
        45,
        "parity:families",
    ),
    Section(
        "throughput",
        "the benchmark workload on a random Llama-3.2-1B shape: tokens/s and TTFT, graphs on and off",
        40,
        25,
        "serving:throughput",
    ),
    Section(
        "memory_peak",
        "the device's peak use after capture and the heaviest step, against --gpu-memory-utilization 0.5",
        40,
        25,
        "serving:memory_peak",
    ),
    Section(
        "tensor_parallel",
        "llmserve up --tp 2 (gloo, one GPU) streams what --tp 1 streams",
        90,
        60,
        "tensor_parallel:run",
    ),
    Section(
        "kernel_tests",
        "the kernel tests on CUDA (--full-kernels) with what is left of the budget",
        60,
        60,
        "kernel_tests:run",
        takes_rest=True,
    ),
]
NAMES = [s.name for s in SECTIONS]
