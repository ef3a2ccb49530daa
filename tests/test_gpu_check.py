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


def test_a_failing_section_is_recorded_and_the_rest_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    # Every measurement stands in with a cheap one; the large-cache check raises.
    monkeypatch.setattr(gpu_check, "copy_bandwidth", lambda *a: 1e9)
    monkeypatch.setattr(gpu_check, "matmul_peak", lambda *a: 1e12)
    case = {"batch": 2, "context": 64, "ours_s": 1e-3, "ours_bytes_per_s": 5e8, "sdpa_contiguous_s": 1e-3}
    monkeypatch.setattr(gpu_check, "bench_decode", lambda *a: dict(case))
    prefill = {"seqs": 2, "length": 48, "ours_s": 1e-3, "ours_flops_per_s": 5e11, "sdpa_flops_per_s": 5e11}
    monkeypatch.setattr(gpu_check, "bench_prefill", lambda *a: dict(prefill))

    def broken(*a: object) -> dict[str, object]:
        raise RuntimeError("illegal memory access")

    monkeypatch.setattr(gpu_check, "check_large_cache", broken)
    monkeypatch.setattr(gpu_check, "check_token_limit", lambda *a: {"rms_norm": {"ok": True}})
    monkeypatch.setattr(gpu_check, "make_model", lambda *a: {"num_hidden_layers": 2})
    monkeypatch.setattr(gpu_check, "bench_e2e", lambda *a, **k: {"sequences_identical_between_backends": "4/4"})
    monkeypatch.setattr(gpu_check, "check_tensor_parallel", lambda *a: {"sequences_identical_tp2_vs_tp1": "4/4"})
    out = tmp_path / "r.json"
    assert gpu_check.main(["--smoke", "--out", str(out)]) == 1
    result = json.loads(out.read_text())
    assert result["failed_sections"] == ["large_cache"]
    assert result["large_cache"]["error"] == "RuntimeError: illegal memory access"
    assert "illegal memory access" in result["large_cache"]["traceback"]
    # Sections after it ran and were saved.
    assert result["token_limit"] == {"rms_norm": {"ok": True}}
    assert result["e2e"]["sequences_identical_between_backends"] == "4/4"
    assert result["tensor_parallel"]["sequences_identical_tp2_vs_tp1"] == "4/4"
    assert result["targets"]["decode_64x4k_fraction_of_copy_bandwidth"] == 0.5
