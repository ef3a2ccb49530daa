"""benchmarks/serving.py: its command lines, the checks on vLLM's result and the ratios (no server)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "serving.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load()


def _args(*extra: str) -> object:
    return bench.parse_args(["--vllm-python", "/venv/bin/python", *extra])


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_vllm_bench_serve_names_the_model_by_its_path_like_any_vllm_user() -> None:
    cmd = bench.bench_serve_command(_args("--num-prompts", "8"), "http://127.0.0.1:8000", "/m/Smol", "/tmp/r", "x.json")
    assert cmd[:3] == ["/venv/bin/python", "-c", bench.BENCH_SERVE]
    assert "from vllm.benchmarks.serve import add_cli_args, main" in cmd[2]
    assert _flag(cmd, "--model") == "/m/Smol" and _flag(cmd, "--base-url") == "http://127.0.0.1:8000"
    assert (_flag(cmd, "--num-prompts"), _flag(cmd, "--random-input-len"), _flag(cmd, "--random-output-len")) == (
        "8",
        "256",
        "96",
    )
    assert "--ignore-eos" in cmd and _flag(cmd, "--temperature") == "0" and _flag(cmd, "--request-rate") == "inf"
    assert _flag(cmd, "--result-dir") == "/tmp/r" and _flag(cmd, "--result-filename") == "x.json"


def test_the_servers_get_the_same_model_and_dtype() -> None:
    args = _args("--input-len", "1000", "--output-len", "100")
    ours = bench.ours_command(args, Path("/m/Smol"), 50051, 8000, 9092)
    assert ours[2:4] == ["llmserve.cli", "up"] and _flag(ours, "--model") == "/m/Smol"
    assert (_flag(ours, "--http-port"), _flag(ours, "--http-metrics-port")) == ("8000", "9092")
    vllm = bench.vllm_command(args, Path("/m/Smol"), "bfloat16", 8001)
    assert vllm[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert (_flag(vllm, "--model"), _flag(vllm, "--dtype"), _flag(vllm, "--port")) == ("/m/Smol", "bfloat16", "8001")
    assert _flag(vllm, "--max-model-len") == "1116"


def test_each_binding_sets_its_own_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # inherited: must not leak into the default run
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in bench.vllm_env("vllm_default_binding")
    assert bench.vllm_env("vllm_all_cores")["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert bench.vllm_env("vllm_all_cores")["HF_HUB_OFFLINE"] == "1"


def _raw(completed: int = 4, tokens: int = 64, tok_s: float = 100.0, ttft: float = 500.0) -> dict[str, object]:
    return {
        "completed": completed,
        "total_output_tokens": tokens,
        "output_throughput": tok_s,
        "median_ttft_ms": ttft,
        "median_tpot_ms": 20.0,
        "errors": ["", "boom"],
        "not_kept": 1,
    }


def test_a_result_counts_only_when_every_request_got_every_token() -> None:
    kept = bench.summarize(_raw(), 4, 16)
    assert kept["output_throughput"] == 100.0 and "not_kept" not in kept
    with pytest.raises(RuntimeError, match=r"3 of 4 requests completed: \['boom'\]"):
        bench.summarize(_raw(completed=3), 4, 16)
    with pytest.raises(RuntimeError, match="60 output tokens, expected 64"):
        bench.summarize(_raw(tokens=60), 4, 16)


def test_ours_is_compared_with_the_faster_binding_of_each_round() -> None:
    runs = {
        "ours": [_raw(tok_s=120, ttft=400), _raw(tok_s=90, ttft=600)],
        "vllm_default_binding": [_raw(tok_s=60, ttft=900), _raw(tok_s=100, ttft=300)],
        "vllm_all_cores": [_raw(tok_s=100, ttft=500), _raw(tok_s=80, ttft=700)],
    }
    ratios = bench.compare(runs, ["vllm_default_binding", "vllm_all_cores"])
    first, second = ratios["rounds"]
    assert (first["throughput_ratio"], first["ttft_ratio"]) == (1.2, 0.8)  # against all_cores, the faster
    assert (second["throughput_ratio"], second["ttft_ratio"]) == (0.9, 2.0)  # against the default binding
    assert first["throughput_ratio_vllm_default_binding"] == 2.0
    assert ratios["ours_over_vllm"] == pytest.approx(1.05) and ratios["ttft_ours_over_vllm"] == pytest.approx(1.4)
