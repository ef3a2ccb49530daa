"""benchmarks/unequal_groups.py end to end on the tiny model: two stand-in groups, one three
times slower, both phases stream every token, and the fast group computes most of them."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_benchmark


def test_quick_run_gives_the_faster_group_the_larger_share(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "unequal.json"
    args = ["--model", str(tiny_model_dir), "--slowdown", "3", "--clients", "8", "--num-requests", "48"]
    args += ["--step-ms", "6", "--token-ms", "0.5"]  # sleeps well above the scheduler's own work, busy or not
    args += ["--min-tokens", "8", "--max-tokens", "16", "--out", str(out), "--results-dir", str(tmp_path)]
    run_benchmark("benchmarks/unequal_groups.py", *args, timeout=300)
    result = json.loads(out.read_text())
    for phase in ("closed_loop", "burst"):
        groups = result[phase]["groups"]
        assert groups["fast"]["sampled_tokens"] + groups["slow"]["sampled_tokens"] == result[phase]["tokens"]
        assert groups["slow"]["cost"] == 3.0
    # The closed loop's first request goes to the slow group (unmeasured groups tie, and it is
    # listed first). In the burst it may get none: its measured speed is tokens over step time,
    # and a busy machine can make it look slow enough that the fast group's queue still wins.
    assert result["closed_loop"]["groups"]["slow"]["steps"] > 0
    # A burst after both groups were measured: room alone would split it about evenly.
    assert result["burst"]["groups"]["fast"]["token_share"] > 0.6
