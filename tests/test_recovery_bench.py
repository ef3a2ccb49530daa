"""benchmarks/recovery_bench.py end to end on the tiny model: it kills a worker, checks every
stream against its undisturbed run and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_benchmark


def test_quick_run_writes_equal_streams_and_ratios(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "recovery.json"
    proc = run_benchmark(
        "benchmarks/recovery_bench.py",
        "--model",
        str(tiny_model_dir),
        "--quick",
        "--out",
        str(out),
        "--results-dir",
        str(tmp_path),
        timeout=300,
    )
    result = json.loads(out.read_text())
    assert result["streams_equal"] is True
    assert result["requests_recovered"] >= 1
    assert result["one_killed"]["killed_after_s"] is not None
    assert result["ratio_killed_vs_two_groups"] > 0 and result["ratio_killed_vs_survivor_alone"] > 0
    assert "killed / two groups" in proc.stdout
    assert (tmp_path / f"recovery-{result['date']}" / "scheduler.log").exists()
