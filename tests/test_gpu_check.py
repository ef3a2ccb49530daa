"""benchmarks/gpu_check.py is ready for a GPU machine: it parses, refuses CPU without --smoke,
and its whole measuring path runs end to end on tiny shapes (Triton interpreter here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0")},
    )


def test_help_and_argument_errors() -> None:
    assert run("--help").returncode == 0
    bad = run("--no-such-flag")
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr
    assert run("--iters", "0").returncode == 2


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


@NO_CUDA
def test_refuses_to_benchmark_without_cuda() -> None:
    out = run()
    assert out.returncode == 2 and "needs CUDA" in out.stderr


@NO_CUDA
def test_smoke_run_writes_every_section(tmp_path: Path) -> None:
    out = run("--smoke", "--out", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["copy_bandwidth_bytes_per_s"] > 0 and result["bf16_matmul_peak_flops_per_s"] > 0
    assert result["decode"][0]["ours_s"] > 0 and result["prefill"][0]["ours_s"] > 0
    assert result["e2e"]["sequences_identical_between_backends"] == "4/4"
    assert result["large_cache"]["ok"] and result["large_cache"]["max_abs_err"] >= 0
    assert {name: case["ok"] for name, case in result["token_limit"].items()} == {
        "rms_norm": True,
        "silu_and_mul": True,
        "rotary": True,
    }
    assert result["tensor_parallel"]["sequences_identical_tp2_vs_tp1"] == "4/4"
    assert set(result["targets"]) == {
        "decode_64x4k_fraction_of_copy_bandwidth",
        "decode_target_met",
        "prefill_fraction_of_peak",
        "prefill_target_met",
    }
