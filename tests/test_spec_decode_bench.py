"""benchmarks/spec_decode.py end to end at small sizes on SmolLM2: a plain and an n-gram server
each stream a copy, a random-token, a sampled and a JSON-schema point; the JSON holds every point's numbers,
the speculative run reports drafts (most kept on the copy), and the scraped counters agree with
the streams' own stats."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_benchmark


def test_quick_run_reports_drafts_and_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    args = ["--workloads", "copy,random,sampled,schema", "--concurrency", "1", "--num-requests", "2"]
    args += ["--output-cap", "24"]
    args += ["--retries", "0", "--out", str(out), "--results-dir", str(tmp_path)]
    run_benchmark("benchmarks/spec_decode.py", *args, timeout=300)
    r = json.loads(out.read_text())
    assert r["benchmark"] == "spec_decode" and r["modes"] == {
        "off": [],
        "ngram-k4": ["--speculative-method", "ngram", "--num-speculative-tokens", "4"],
    }
    assert [p["workload"] for p in r["points"]] == ["copy", "random", "sampled", "schema"]
    for p in r["points"]:
        assert set(p["modes"]) == {"off", "ngram-k4"} and p["ratio_over_off"]["ngram-k4"] > 0
        assert 0 <= p["same_output_share"]["ngram-k4"] <= 1
        for s in p["modes"].values():
            assert s["requests"] == 2 and 2 <= s["output_tokens"] <= 48 and s["output_tokens_per_s"] > 0
            assert all(s[k]["p50"] > 0 for k in ("ttft_s", "itl_s", "message_gap_s"))
            assert 0 <= s["foreign_cpu_share"] <= 1
            # Each stream's own stats, summed, against the server's counters over the point.
            assert s["metrics_delta"]["drafted"] == s["spec_draft_tokens"]
            assert s["metrics_delta"]["accepted"] == s["spec_accepted_tokens"]
        off = p["modes"]["off"]
        assert off["spec_draft_tokens"] == 0 and off["acceptance_rate"] is None and off["tokens_per_message"] == 1
        assert off["itl_s"] == off["message_gap_s"]  # one token a message without drafts
    copy = r["points"][0]["modes"]["ngram-k4"]
    # Repeating a passage: the drafts come from the prompt, and SmolLM2 keeps most of them.
    assert copy["spec_draft_tokens"] > 0 and copy["acceptance_rate"] > 0.5 and copy["tokens_per_message"] > 1.5
    assert set(r["targets"]) == {"ngram-k4/copy", "ngram-k4/random", "ngram-k4/sampled"}
    assert r["targets"]["ngram-k4/copy"]["target"] == 1.8 and r["machine"]["cpu_count"] >= 1


def test_a_draft_models_modes_run_beside_the_others(tmp_path: Path, smollm2_dir: Path) -> None:
    """--draft-model: SmolLM2 proposing for itself keeps nearly every draft (bf16: a verified
    row may round a near tie the other way than the draft's own decode). --repeat 3: the point
    is its median round, every mode's ratio the median of its three."""
    out = tmp_path / "spec.json"
    args = ["--workloads", "random", "--concurrency", "1", "--num-requests", "2", "--output-cap", "24", "--repeat", "3"]
    args += ["--retries", "0", "--draft-model", str(smollm2_dir), "--out", str(out), "--results-dir", str(tmp_path)]
    run_benchmark("benchmarks/spec_decode.py", *args, timeout=300)
    r = json.loads(out.read_text())
    draft = ["--speculative-method", "draft", "--speculative-model", str(smollm2_dir), "--num-speculative-tokens", "4"]
    assert r["modes"]["draft-k4"] == draft and r["settings"]["draft_model"] == str(smollm2_dir)
    (point,) = r["points"]
    s = point["modes"]["draft-k4"]
    assert s["spec_draft_tokens"] > 0 and s["acceptance_rate"] > 0.8 and s["tokens_per_message"] > 2
    assert s["metrics_delta"]["drafted"] == s["spec_draft_tokens"] and point["ratio_over_off"]["draft-k4"] > 0
    for name in ("ngram-k4", "draft-k4"):
        rounds = point["ratio_rounds"][name]
        assert len(rounds) == 3 and point["ratio_over_off"][name] == sorted(rounds)[1]
    # The point shown is the round of ngram-k4's median ratio.
    shown = point["modes"]["ngram-k4"]["output_tokens_per_s"] / point["modes"]["off"]["output_tokens_per_s"]
    assert shown == point["ratio_over_off"]["ngram-k4"]
