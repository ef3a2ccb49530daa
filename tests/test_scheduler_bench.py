"""benchmarks/scheduler_bench.py end to end, small: it runs, finishes every request, leaks no block."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_benchmark

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "scheduler_bench.py"
PHASES = ("total", "schedule", "build_plan", "encode", "decode", "update")


def _assert_step_stats(stats: dict, steps: int) -> None:
    assert stats["steps"] == steps
    for phase in PHASES:
        s = stats[f"{phase}_us"]
        assert 0 < s["p50"] <= s["max"] and 0 < s["mean"] <= s["max"] and s["p99"] <= s["max"], phase
    for name in ("num_seqs_mean", "num_tokens_mean", "plan_bytes_mean", "result_bytes_mean"):
        assert stats[name] > 0, name


def test_quick_run_reports_and_leaves_every_block_free(tmp_path: Path) -> None:
    out = tmp_path / "scheduler_bench.json"
    proc = run_benchmark(str(SCRIPT), "--quick", "--requests", "200", "--out", str(out), timeout=120)
    assert "target <1 ms/step: " in proc.stdout
    result = json.loads(out.read_text())

    assert result["benchmark"] == "scheduler" and result["valid"] is True
    assert result["date"] and result["machine"]["cpu_count"] >= 1 and result["machine"]["python"]
    assert result["config"]["requests"] == 200 and result["config"]["max_running"] == 256
    assert isinstance(result["target_met"], bool) and result["target_us"] == 1000.0

    mixed = result["mixed"]
    assert mixed["finished_requests"] == 200 and mixed["all_finished"]
    assert mixed["output_tokens"] == mixed["expected_output_tokens"] > 0
    assert mixed["token_errors"] == []
    steps = mixed["all_steps"]["steps"]
    assert steps > 0
    _assert_step_stats(mixed["all_steps"], steps)
    # 200 requests never fill 256 slots: no step is a steady-state one.
    assert mixed["steady_steps"]["steps"] == 0

    pure = result["pure_decode"]
    _assert_step_stats(pure, result["config"]["decode_steps"])
    assert pure["num_seqs_mean"] == pure["num_tokens_mean"] == 256
    # "256 running sequences of 1-4k tokens", through the last timed step.
    assert 1000 <= pure["context_tokens_min"] <= pure["context_tokens_max"] <= 4000

    for run in (mixed, pure):
        check = run["integrity"]
        assert check["ok"] and check["error"] is None and check["all_free"], check
        assert check["free_blocks"] == check["num_blocks"] > 0
        assert check["host_free_blocks"] == check["host_blocks"]
