"""No kernel the worker launches at head_dim 64 or 128 spills registers on Hopper (sm_90).

Runs benchmarks/kernel_resources.py --quick in a process of its own, without the
interpreter (the test process runs kernels in it, and interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def resources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("kernel_resources")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/kernel_resources.py", "--quick", "--results-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(Path(out, "kernel_resources.json").read_text())


def test_every_kernel_and_dtype_is_measured(resources: dict[str, object]) -> None:
    configs = resources["configs"]
    assert isinstance(configs, list)
    kernels = {c["config"].split("-")[0] for c in configs}
    assert kernels == {
        "decode",
        "decode_merge",
        "prefill",
        "store_kv",
        "rotary",
        "rms_norm",
        "silu_and_mul",
        "moe_gate_up",
        "moe_down",
        "token_mask",
        "lora_shrink",
        "lora_expand",
    }
    assert {c["dtype"] for c in configs} == {"bf16", "fp16", "fp32"}
    assert {c["head_dim"] for c in configs if c["head_dim"] is not None} == {64, 128}
    for c in configs:
        assert 0 < c["registers"] <= 255, c


def test_no_spills_at_head_dim_64_and_128(resources: dict[str, object]) -> None:
    configs = resources["configs"]
    assert isinstance(configs, list)
    spilling = [
        f"{c['config']}-{c['dtype']}: {c['spill_stores']} B stored, {c['spill_loads']} B loaded"
        for c in configs
        if c["spill_stores"] or c["spill_loads"]
    ]
    assert spilling == [], "\n".join(spilling)


def test_attention_pipelines_its_kv_loads_within_shared_memory(resources: dict[str, object]) -> None:
    """num_stages > 1 turns the K/V gathers into cp.async copies; the buffers must still fit."""
    configs = resources["configs"]
    assert isinstance(configs, list)
    attention = [c for c in configs if c["config"].startswith(("decode-", "prefill-"))]
    assert attention and all(c["cp_async"] for c in attention), [c["config"] for c in attention if not c["cp_async"]]
    limit = resources["shared_limit_bytes"]
    assert all(c["shared_bytes"] <= limit for c in configs), [c["config"] for c in configs if c["shared_bytes"] > limit]
