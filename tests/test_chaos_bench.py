"""benchmarks/chaos.py end to end, briefly: two workers on the tiny model are disrupted while
clients stream, cancel, time out, ask for n = 2 samples and for structured outputs; every request
ends right (a finished structured output validates against its schema) and every block comes
back."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_benchmark


def test_a_short_soak_ends_every_request_right(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    run_benchmark(
        "benchmarks/chaos.py",
        "--model",
        str(tiny_model_dir),
        "--seconds",
        "20",
        "--workers",
        "2",
        "--concurrency",
        "6",
        "--pool",
        "4",
        "--max-tokens",
        "16",
        "--gpu-blocks",
        "24",
        "--chaos-interval",
        "3",
        "--out",
        str(out),
        "--results-dir",
        str(tmp_path),
        timeout=400,
    )
    result = json.loads(out.read_text())
    assert result["ok"] and result["num_failures"] == 0 and result["leaked_at_end"] == {}
    assert result["requests"] > 10 and sum(result["disruptions"].values()) >= 2
    assert any(key.endswith(":OK") for key in result["outcomes"])
    kinds = {key.split(":")[0] for key in result["outcomes"]}
    assert kinds == {"stream", "cancel", "deadline", "samples", "structured"}, result["outcomes"]
    assert result["outcomes"].get("structured:OK", 0) > 0, result["outcomes"]
