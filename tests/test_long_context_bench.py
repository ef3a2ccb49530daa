"""benchmarks/long_context.py end to end at small sizes: a 16k-token prompt through the real
services, the plan cost with and without a long row, the context sweep on the tiny model and
on SmolLM2, and the KV pool's efficiency; the JSON holds each with sane values."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_benchmark

LONG = 16384


def test_quick_run_measures_a_long_prompt_its_plans_and_the_pool(tmp_path: Path) -> None:
    out = tmp_path / "long.json"
    args = ["--long-tokens", str(LONG), "--chunk", "4096", "--output-tokens", "8", "--context-lens", "512,2048"]
    args += ["--smollm2-lens", "256", "--context-requests", "1", "--short-rows", "31", "--short-tokens", "1024"]
    args += ["--plan-steps", "10", "--kv-requests", "60", "--kv-lens", "16,4096", "--kv-blocks", "1024"]
    run_benchmark("benchmarks/long_context.py", *args, "--out", str(out), "--results-dir", str(tmp_path), timeout=480)
    r = json.loads(out.read_text())
    assert r["model"]["max_position_embeddings"] >= LONG + 8 and r["model"]["head_dim"] == 64

    long = r["long"]
    assert long["prompt_tokens"] == LONG and 0 < long["ttft_s"] < 120 and long["decode_tokens_per_s"] > 0
    assert "--max-num-batched-tokens" in long["engine_flags"]
    assert all(0 < long["rss_peak"][k] < 16 * 1024 for k in ("scheduler_mib", "workers_mib"))
    assert 0 < long["ttft_cached_s"] < long["ttft_s"]
    # The prompt alone: 4 chunks of 4,096, its one token with the last. Then the same prompt from
    # the prefix cache: one step for its last position (and the first token), 7 decodes.
    assert (long["prefill"]["steps"], long["decode"]["steps"]) == (LONG // 4096, 8)
    for phase in ("prefill", "decode"):
        assert 0 < long[phase]["plan_bytes_mean"] < 1 << 20 and long[phase]["scheduler_ms_per_step"] > 0
    # A decode plan carries the whole table: 4 bytes a block of 16 tokens, and little else.
    assert LONG / 16 * 4 < long["decode"]["plan_bytes_mean"] < LONG / 16 * 4 + 4096

    plan = r["plan"]
    assert (plan["without_long"]["rows"], plan["with_long"]["rows"]) == (31, 32)
    assert plan["with_long"]["plan_bytes_max"] < 1 << 20
    assert plan["bytes_ratio"] > 1 and plan["ms_ratio"] > 0

    assert [(c["model"], c["context"]) for c in r["context"]] == [("tiny", 512), ("tiny", 2048), ("smollm2", 256)]
    assert all(c["ttft_s"] > 0 and c["decode_tokens_per_s"] > 0 for c in r["context"])

    kv = r["kv"]
    assert kv["requests"] == 60 and kv["integrity"]["ok"] and kv["integrity"]["all_free"]
    assert kv["efficiency_token_weighted"] >= 0.96 and 0 <= kv["pool_fragmented_share_mean"] <= 0.04
