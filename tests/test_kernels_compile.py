"""Every kernel compiles for a Hopper GPU (sm_90), down to a cubin, on this CPU-only machine.

The interpreter accepts programs a GPU compiler rejects (tl.dot shapes under 16, loop-carried
values that change type, ...). Triton's wheel ships ptxas, so the real compile chain runs here
without a device: what passes this test will at least build on the H200.

The same compile checks the address arithmetic. The interpreter computes offsets in numpy
int64 and cannot see an int32 product wrap, but on the GPU a KV block id or a token index
times its stride passes 2^31 once a cache layer or a step's activations hold that many
elements, and the kernel reads someone else's memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.compile_kernels import PLANTED, cases
from tests.conftest import REPO


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.compile_kernels"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


KEYS = [case.key for case in cases()]


@pytest.mark.parametrize("key", KEYS)
def test_kernel_compiles_for_sm90(compiled: dict[str, dict[str, object]], key: str) -> None:
    assert compiled[key]["compiled"] == "ok", compiled[key]["compiled"]


@pytest.mark.parametrize("key", KEYS)
def test_batch_sized_offsets_are_int64(compiled: dict[str, dict[str, object]], key: str) -> None:
    """No KV block id, token, sequence or tile index is multiplied by a stride in int32."""
    found = compiled[key]["int32_index_products"]
    assert found == [], "\n".join(found)  # type: ignore[arg-type]


def test_the_int32_check_finds_a_planted_int32_product(compiled: dict[str, dict[str, object]]) -> None:
    """Guards the check itself: a parser that matched nothing would pass every kernel."""
    found = compiled[PLANTED.key]["int32_index_products"]
    assert len(found) == 1 and "arith.muli" in found[0], found  # type: ignore[arg-type,index]
