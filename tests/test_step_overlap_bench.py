"""benchmarks/step_overlap.py end to end on the tiny model: both modes run against the stand-in
worker and every stream gets all its tokens (the stand-in's deferred inputs come from its own
last step, so a step planned ahead that referred to the wrong tokens would fail it)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_benchmark


def test_quick_run_measures_the_idle_gap_of_both_modes(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "overlap.json"
    proc = run_benchmark(
        "benchmarks/step_overlap.py",
        "--model",
        str(tiny_model_dir),
        "--num-seqs",
        "8",
        "--step-ms",
        "5",
        "--max-tokens",
        "24",
        "--out",
        str(out),
        "--results-dir",
        str(tmp_path),
        timeout=300,
    )
    result = json.loads(out.read_text())
    ahead, sync = result["modes"]
    assert ahead["plan_ahead"] and not sync["plan_ahead"]
    for mode in (ahead, sync):
        assert mode["steps_at_full_batch"] > 0 and mode["step_ms"]["mean"] >= 5.0
        assert mode["idle_ms"]["mean"] >= 0 and mode["scheduler_cpu_ms_per_step"] > 0
    assert "idle/step" in proc.stdout
