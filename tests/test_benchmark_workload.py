"""benchmarks/throughput.py: the workload generator and flag checks (no model, no server)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "throughput.py"


def _load() -> ModuleType:
    # benchmarks/ is not a package: load the script by path, as `python benchmarks/...` would.
    spec = importlib.util.spec_from_file_location("bench_throughput", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


bench = _load()
VOCAB = 49152


def test_same_seed_same_workload() -> None:
    assert bench.make_workload(16, 7, VOCAB) == bench.make_workload(16, 7, VOCAB)


def test_other_seed_other_workload() -> None:
    assert bench.make_workload(16, 7, VOCAB) != bench.make_workload(16, 8, VOCAB)


def test_lengths_and_ids_within_bounds() -> None:
    workload = bench.make_workload(256, 3, VOCAB)
    assert len(workload) == 256
    for prompt, max_tokens in workload:
        assert bench.PROMPT_LEN[0] <= len(prompt) <= bench.PROMPT_LEN[1]
        assert bench.OUTPUT_LEN[0] <= max_tokens <= bench.OUTPUT_LEN[1]
        assert all(bench.MIN_TOKEN_ID <= t < VOCAB for t in prompt)
        assert all(type(t) is int for t in prompt) and type(max_tokens) is int


def test_bounds_are_reached() -> None:
    # Inclusive bounds: a large draw hits both ends of the output range.
    outputs = [m for _, m in bench.make_workload(2000, 1, VOCAB)]
    assert min(outputs) == bench.OUTPUT_LEN[0] and max(outputs) == bench.OUTPUT_LEN[1]


def test_tiny_vocab_stays_in_range() -> None:
    workload = bench.make_workload(8, 0, bench.MIN_TOKEN_ID + 2)
    assert {t for p, _ in workload for t in p} <= {bench.MIN_TOKEN_ID, bench.MIN_TOKEN_ID + 1}


def test_useful_output_tokens() -> None:
    workload = bench.make_workload(8, 0, VOCAB)
    assert bench.useful_output_tokens(workload) == sum(m for _, m in workload)


@pytest.mark.parametrize(("num", "vocab"), [(0, VOCAB), (-1, VOCAB), (4, bench.MIN_TOKEN_ID)])
def test_make_workload_rejects_bad_arguments(num: int, vocab: int) -> None:
    with pytest.raises(ValueError):
        bench.make_workload(num, 0, vocab)


def test_other_lengths() -> None:
    workload = bench.make_workload(300, 4, VOCAB, prompt_len=(16, 384), output_len=(16, 160))
    assert min(len(p) for p, _ in workload) >= 16 and max(len(p) for p, _ in workload) <= 384
    assert {m for _, m in workload} <= set(range(16, 161)) and max(len(p) for p, _ in workload) > 256
    with pytest.raises(ValueError):
        bench.make_workload(4, 0, VOCAB, prompt_len=(10, 5))


def test_median_run_and_paired_ratios() -> None:
    runs = [{"output_tokens_per_s": v} for v in (300.0, 100.0, 200.0)]
    assert bench._median_run(runs)["output_tokens_per_s"] == 200.0
    assert bench._median_run(runs[:2])["output_tokens_per_s"] == 100.0  # the lower middle of two
    assert bench._ratio({"output_tokens_per_s": 300.0}, {"output_tokens_per_s": 200.0}) == 1.5


def test_defaults() -> None:
    args = bench.parse_args([])
    assert (args.num_requests, args.seed, args.dtype, args.hf_batch_size) == (64, 0, "auto", 8)
    assert (args.prompt_len, args.output_len, args.repeat) == (bench.PROMPT_LEN, bench.OUTPUT_LEN, 1)
    assert not args.skip_hf and args.vllm_python is None and args.out is None
    assert args.max_num_seqs is None and args.max_num_batched_tokens is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-requests", "0"],
        ["--num-requests", "x"],
        ["--hf-batch-size", "0"],
        ["--max-num-seqs", "-4"],
        ["--max-num-batched-tokens", "0"],
        ["--dtype", "float16"],
        ["--vllm-python", "/nonexistent/python"],
        ["--prompt-len", "5"],
        ["--prompt-len", "9,3"],
        ["--output-len", "0,4"],
        ["--repeat", "0"],
    ],
)
def test_parse_args_rejects(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2


def test_parse_args_accepts_overrides(tmp_path: Path) -> None:
    args = bench.parse_args(
        [
            "--num-requests",
            "8",
            "--seed",
            "5",
            "--dtype",
            "float32",
            "--skip-hf",
            "--max-num-seqs",
            "16",
            "--max-num-batched-tokens",
            "512",
            "--out",
            str(tmp_path / "r.json"),
            "--vllm-python",
            sys.executable,
        ]
    )
    assert args.num_requests == 8 and args.seed == 5 and args.dtype == "float32" and args.skip_hf
    assert args.max_num_seqs == 16 and args.max_num_batched_tokens == 512
    assert args.out == tmp_path / "r.json" and args.vllm_python == sys.executable


def test_step_breakdown_from_the_schedulers_counters() -> None:
    before = {"steps": 10.0, "part:linear": 1.0, "part:plan_build": 0.1}
    after = {
        "steps": 30.0,
        "part:linear": 5.0,
        "part:plan_build": 0.3,
        "part:attention": 2.0,
        "part:forward_other": 0.5,
        "part:prepare": 0.2,
        "part:sampling": 0.3,
    }
    out = bench.step_breakdown(before, after, wall_s=10.0)
    assert out["steps"] == 20 and list(out["parts"]) == [
        "plan_build",
        "prepare",
        "linear",
        "attention",
        "forward_other",
        "sampling",
    ]
    assert out["parts"]["linear"] == {"seconds": 4.0, "ms_per_step": 200.0, "share": 0.4}
    # The worker worked 0.2 + 4 + 2 + 0.5 + 0.3 = 7 s of the 10: idle the rest.
    assert abs(out["worker_idle_share"] - 0.3) < 1e-9
    # Without the worker's parts (not profiled) there is no idle figure.
    assert "worker_idle_share" not in bench.step_breakdown(before, {"steps": 12.0, "part:linear": 2.0}, 1.0)


def test_profiling_the_steps_is_the_default() -> None:
    assert bench.parse_args([]).profile_steps and not bench.parse_args(["--no-profile-steps"]).profile_steps


def test_vllm_runs_both_bindings_unless_told() -> None:
    assert bench.vllm_bindings(bench.parse_args([])) == []
    both = bench.parse_args(["--vllm-python", sys.executable])
    assert bench.vllm_bindings(both) == ["vllm_default_binding", "vllm_all_cores"]
    one = bench.parse_args(["--vllm-python", sys.executable, "--skip-vllm-default-binding"])
    assert bench.vllm_bindings(one) == ["vllm_all_cores"]
    assert bench.VLLM_BINDINGS["vllm_all_cores"] == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert bench.VLLM_BINDINGS["vllm_default_binding"] == {}


def test_ratio_against_the_faster_binding_of_each_round() -> None:
    def tps(*values: float) -> list[dict[str, float]]:
        return [{"output_tokens_per_s": v} for v in values]

    runs = {"ours": tps(600, 500), "vllm_default_binding": tps(300, 250), "vllm_all_cores": tps(200, 500)}
    paired = bench.paired_ratios(runs, ["vllm_default_binding", "vllm_all_cores"])
    assert paired == {"vllm_default_binding": [2.0, 2.0], "vllm_all_cores": [3.0, 1.0], "vllm_best": [2.0, 1.0]}
    assert bench.paired_ratios({"ours": tps(1)}, []) == {}
    assert bench._median_or_none([2.0, None, 1.0]) == 1.5 and bench._median_or_none([None]) is None
