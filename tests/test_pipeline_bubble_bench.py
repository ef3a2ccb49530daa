"""benchmarks/pipeline_bubble.py end to end on the tiny model: stand-in stages joined by real
point-to-point sends stream every token in each mode; micro-batches leave the stages less
idle than one plan at a time, and the auto split gives the slow stage fewer layers."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_benchmark


def test_quick_run_shows_micro_batches_fill_the_pipeline(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bubble.json"
    # Stand-in layers of 2 ms: sleeps well above the scheduler's own work, busy machine or not.
    args = ["--model", str(tiny_model_dir), "--layers", "6", "--layer-ms", "2", "--num-seqs", "24"]
    args += ["--max-tokens", "24", "--out", str(out), "--results-dir", str(tmp_path)]
    run_benchmark("benchmarks/pipeline_bubble.py", *args, timeout=300)
    one, n, n_plus_one, slow_even, slow_auto = json.loads(out.read_text())["modes"]
    assert [m["micro_batches"] for m in (one, n, n_plus_one, slow_even, slow_auto)] == [1, 2, 3, 3, 3]
    for mode in (one, n, n_plus_one, slow_even, slow_auto):
        assert len(mode["stages"]) == 2 and all(s["steps"] > 0 for s in mode["stages"])
    # One plan at a time: each of two stages computes at most about half the time.
    assert min(s["idle_share"] for s in one["stages"]) > 0.4
    assert n_plus_one["max_idle_share"] < one["max_idle_share"] - 0.15
    assert [s["layers"] for s in slow_even["stages"]] == [3, 3]
    assert slow_auto["stages"][1]["cost"] == 2.0 and slow_auto["stages"][1]["layers"] < 3
    assert slow_auto["compute_spread"] < slow_even["compute_spread"]
