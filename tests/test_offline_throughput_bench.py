"""benchmarks/offline_throughput.py end to end on the tiny model: the same workload through
`llmserve up` over gRPC and through `LLM.generate`, with every engine flag the script takes
reaching both paths; the JSON holds both paths' rates and their ratio."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_benchmark


def test_both_paths_run_the_workload_with_the_same_engine_flags(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    flags = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "32"]
    args = ["--model", str(tiny_model_dir), "--num-requests", "6", "--prompt-len", "8,40", "--output-len", "4,12"]
    run_benchmark(
        "benchmarks/offline_throughput.py",
        *args,
        *flags,
        "--out",
        str(out),
        "--results-dir",
        str(tmp_path),
        timeout=300,
    )
    r = json.loads(out.read_text())
    assert r["engine_flags"] == {"max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 32}
    assert r["workload"]["num_requests"] == 6 and r["workload"]["output_tokens"] > 0
    assert len(r["runs"]["grpc"]) == len(r["runs"]["offline"]) == 1
    assert all(rate > 0 for rates in r["runs"].values() for rate in rates)
    assert r["ratio_offline_over_grpc"] == r["runs"]["offline"][0] / r["runs"]["grpc"][0]
    # The gRPC path's worker allocated its cache in blocks of the size asked for.
    (log,) = tmp_path.glob("server-*.log")
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert [e["block_size"] for e in events if e.get("event") == "kv_cache_allocated"] == [32]
    assert len(list(tmp_path.glob("offline-throughput-*.json"))) == 1
