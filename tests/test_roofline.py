"""benchmarks/roofline.py: flop and byte counts on a config small enough to count by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import roofline  # noqa: E402

# H=4, I=6, 2 heads, 1 KV head, head_dim 2, 3 layers, vocab 10.
TINY = {
    "hidden_size": 4,
    "intermediate_size": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 2,
    "num_hidden_layers": 3,
    "vocab_size": 10,
    "tie_word_embeddings": True,
}
# (prompt tokens, output tokens): one decode token at context 4; two at contexts 2 and 3.
LENGTHS = [(3, 2), (1, 3)]


def test_shape_from_config() -> None:
    shape = roofline.ModelShape.from_config(TINY)
    # qkv 4x(2+2)*2 = 32, o 4x4 = 16, gate_up 4x12 = 48, down 6x4 = 24
    assert shape.layer_linears() == {"qkv": (4, 8), "o": (4, 4), "gate_up": (4, 12), "down": (6, 4)}
    assert (shape.layer_weights, shape.linear_weights, shape.head_weights) == (120, 360, 40)
    assert shape.tied


def test_head_dim_and_kv_heads_default() -> None:
    config = {k: v for k, v in TINY.items() if k not in ("head_dim", "num_key_value_heads", "tie_word_embeddings")}
    shape = roofline.ModelShape.from_config(config)
    assert (shape.head_dim, shape.kv_heads, shape.tied) == (2, 2, False)


def test_work_counts_by_hand() -> None:
    w = roofline.work(roofline.ModelShape.from_config(TINY), LENGTHS, dtype_bytes=2)
    assert (w.prompt_tokens, w.decode_tokens, w.sampled_rows, w.steps) == (4, 3, 5, 3)
    assert w.prefill_linear_flops == 2 * 360 * 4 == 2880
    assert w.decode_linear_flops == 2 * 360 * 3 == 2160
    assert w.lm_head_flops == 2 * 40 * 5 == 400
    # 4*d*h*L = 48 flops per query-key pair; causal pairs 3*4/2 + 1 = 7; decode contexts 4 + 2 + 3 = 9
    assert w.prefill_attention_flops == 48 * 7 == 336
    assert w.decode_attention_flops == 48 * 9 == 432
    # weights once per step, max(output) = 3 steps
    assert (w.linear_weight_bytes, w.head_weight_bytes) == (3 * 360 * 2, 3 * 40 * 2)
    # K and V: 2 * g * d * b * L = 24 bytes per cached token read
    assert w.kv_read_bytes == 24 * 9 == 216


def test_steps_from_the_run() -> None:
    w = roofline.work(roofline.ModelShape.from_config(TINY), LENGTHS, dtype_bytes=4, steps=7)
    assert (w.steps, w.linear_weight_bytes, w.head_weight_bytes, w.kv_read_bytes) == (7, 7 * 360 * 4, 7 * 40 * 4, 432)


def test_bound_and_compare() -> None:
    w = roofline.work(roofline.ModelShape.from_config(TINY), LENGTHS, dtype_bytes=2)
    peaks = roofline.Peaks(linear_m2048=100.0, linear_m96=10.0, head_m96=20.0, read_bandwidth=100.0)
    b = roofline.bound(w, peaks)
    assert b["prefill_linear"] == pytest.approx(28.8)
    assert b["decode_linear"] == pytest.approx(216.0)  # compute: 2160 / 10 over 2160 bytes / 100
    assert b["lm_head"] == pytest.approx(20.0)  # compute: 400 / 20 over 240 / 100
    assert b["attention"] == pytest.approx(3.36 + 43.2)
    # memory-bound once the bandwidth is low
    slow = roofline.bound(w, roofline.Peaks(100.0, 10.0, 20.0, read_bandwidth=1.0))
    assert slow["decode_linear"] == pytest.approx(2160.0) and slow["lm_head"] == pytest.approx(240.0)

    out = roofline.compare(b, wall_s=1000.0, part_seconds={"linear": 489.6, "attention": 93.12, "lm_head": 40.0})
    assert out["bound_s"] == pytest.approx(311.36) and out["pct_of_bound"] == pytest.approx(31.136)
    assert out["parts"]["linear"]["pct_of_bound"] == pytest.approx(50.0)
    assert out["parts"]["attention"]["pct_of_bound"] == pytest.approx(50.0)
    assert out["parts"]["lm_head"]["pct_of_bound"] == pytest.approx(50.0)
    assert out["parts"]["rest"] == {"bound_s": 0.0, "ours_s": pytest.approx(377.28), "pct_of_bound": 0.0}
    assert roofline.compare(b, wall_s=1000.0, part_seconds={})["parts"] == {}


@pytest.mark.parametrize("lengths", [[], [(0, 4)], [(4, 0)]])
def test_work_rejects_empty_requests(lengths: list[tuple[int, int]]) -> None:
    with pytest.raises(ValueError):
        roofline.work(roofline.ModelShape.from_config(TINY), lengths, dtype_bytes=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_instruction_peak_is_measured_where_the_cpu_has_the_instruction(dtype: str) -> None:
    import machine_peaks

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    peak = machine_peaks.instruction_peak(dtype, iters=2_000_000)
    has = "avx512f" in flags and (dtype == "float32" or "avx512_bf16" in flags)
    if not has:
        assert peak is None
    else:
        # At least one multiply-add instruction every other cycle of a 1 GHz core.
        assert peak is not None and peak > (64 if dtype == "bfloat16" else 32) * 0.5e9


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gemm_rate_runs_the_workers_own_gemm(dtype: str) -> None:
    import machine_peaks

    rate = machine_peaks.gemm_rate({"a": (64, 128), "b": (128, 64)}, m=8, dtype_name=dtype, min_s=0.001, repeats=1)
    assert rate["m"] == 8 and rate["dtype"] == dtype and set(rate["per_shape"]) == {"a", "b"}
    # Every shape did its flops in a finite, positive time, and the whole is their total over their sum.
    assert all(r > 0 for r in rate["per_shape"].values())
    assert min(rate["per_shape"].values()) <= rate["flops_per_s"] <= max(rate["per_shape"].values())
