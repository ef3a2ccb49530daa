"""benchmarks/structured_output_bench.py end to end, small: both runs at each size decode every
step, the constrained one masks every row and the grammars advance, no block leaks."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_benchmark

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "structured_output_bench.py"
PHASES = ("total", "schedule", "build_plan", "fill_masks", "encode", "decode", "update")


def test_quick_run_reports_the_overhead_and_leaves_every_block_free(tmp_path: Path) -> None:
    out = tmp_path / "structured_output_bench.json"
    proc = run_benchmark(str(SCRIPT), "--quick", "--num-seqs", "8,32", "--out", str(out), timeout=120)
    assert "us per step, mean (wall time)" in proc.stdout and "overhead" in proc.stdout
    result = json.loads(out.read_text())

    assert result["benchmark"] == "structured_output" and result["valid"] is True
    assert result["date"] and result["machine"]["cpu_count"] >= 1 and result["machine"]["python"]
    config = result["config"]
    assert config["num_seqs"] == [8, 32] and config["steps"] == 20 and config["quick"] is True
    assert config["schema"]["minItems"] == config["schema"]["maxItems"] == 200

    assert [r["num_seqs"] for r in result["runs"]] == [8, 32]
    for r in result["runs"]:
        n = r["num_seqs"]
        plain, constrained = r["unconstrained"], r["constrained"]
        for run in (plain, constrained):
            assert run["steps"] == 20 and run["num_seqs_mean"] == n
            for clock in ("cpu", "wall"):
                for phase in PHASES:
                    s = run[clock][f"{phase}_us"]
                    assert 0 <= s["p50"] <= s["max"] and 0 <= s["mean"] <= s["max"], (clock, phase)
            check = run["integrity"]
            assert check["ok"] and check["all_free"] and check["free_blocks"] == check["num_blocks"] > 0, check
        # Only the constrained run fills masks; its rows allow a few tokens, not the vocabulary,
        # so they travel as those ids (a dense row would be ceil(49152 / 32) int32 words).
        assert plain["wall"]["fill_masks_us"]["max"] == 0 and plain["allowed_tokens_per_row_mean"] == 0
        assert constrained["wall"]["fill_masks_us"]["p50"] > 0
        assert 1 <= constrained["allowed_tokens_per_row_mean"] < 1000
        allowed = constrained["allowed_tokens_per_row_mean"]
        assert n * allowed * 4 <= constrained["plan_bytes_mean"] - plain["plan_bytes_mean"] < n * 1536 * 4
        assert constrained["output_tokens_at_end_min"] > 20  # the grammars advanced every step
        o = r["overhead"]
        assert 0 < o["plan_bytes"] < n * 1536 * 4
        for clock in ("cpu", "wall"):
            assert o[clock]["fill_masks_us"] == constrained[clock]["fill_masks_us"]["mean"]
            assert o[clock]["ratio"] > 0 and o[clock]["total_per_seq_us"] == o[clock]["total_us"] / n
