"""The split-K workspace: one buffer per device, reserved before CUDA graph capture.

Graphs are captured largest bucket first and keep the workspace's address. The split count
falls in steps as sequences are added, so a smaller bucket can ask for more workspace than
every larger one; unless the buffer is reserved for all buckets first, that capture regrows
it and the graphs captured before it read freed memory.
"""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention, workspace
from kernels.paged_attention import decode_workspace, paged_decode_attention
from tests.conftest import KERNEL_DEVICE
from worker_svc.step.step_buckets import graph_buckets

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Llama-3-8B's attention
WIDE = 131072 // BLOCK
CPU = torch.device("cpu")
# Where the kernels launch: the CPU under Triton's interpreter, else the GPU.
DEV = torch.device(KERNEL_DEVICE)


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """An H200's 132 SMs, and buffers of this test's own."""
    monkeypatch.setattr(paged_attention, "_parallel_units", lambda device: 2 * 132)
    monkeypatch.setattr(workspace, "_buffers", {})


def needs(n: int, device: torch.device = CPU) -> int:
    return decode_workspace(n, HEADS, KV_HEADS, HEAD_DIM, torch.float32, device, BLOCK, WIDE)


def test_a_smaller_bucket_can_need_more_workspace_than_the_largest() -> None:
    buckets = graph_buckets(40).sizes  # 1, 2, 4, 8, 16, 24, 32, 40
    largest = max(buckets)
    bigger = [b for b in buckets if needs(b) > needs(largest)]
    assert 32 in bigger  # 32 sequences x 2 splits, against 40 x 1
    # Captured largest first, the 32-sequence graph would regrow the buffer under the 40's.
    workspace.workspace(CPU, needs(largest))
    before = workspace.buffer(CPU)
    workspace.workspace(CPU, needs(32))
    assert workspace.buffer(CPU) is not before


def test_after_reserving_for_every_bucket_no_decode_launch_reallocates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter runs a program at a time: a small model on a 20-SM device, whose
    16-sequence bucket (2 splits) needs more than its largest, 24 (1 split)."""
    monkeypatch.setattr(paged_attention, "_parallel_units", lambda device: 2 * 20)
    heads, kv_heads, head_dim = 4, 2, 16
    buckets = sorted(graph_buckets(24).sizes, reverse=True)
    sizes = {n: decode_workspace(n, heads, kv_heads, head_dim, torch.float32, DEV, BLOCK, WIDE) for n in buckets}
    assert sizes[16] > sizes[24]
    buf = workspace.reserve(DEV, max(sizes.values()))
    ptr = buf.data_ptr()
    k_cache = torch.randn(3, BLOCK, kv_heads, head_dim, device=DEV)
    for n in buckets:  # in capture order: one block each, launched as the graphs' width
        ids = torch.ones(n, dtype=torch.int32, device=DEV)
        offsets = torch.arange(n + 1, dtype=torch.int32, device=DEV)
        seq_lens = torch.full((n,), 2, dtype=torch.int32, device=DEV)
        q = torch.randn(n, heads, head_dim, device=DEV)
        paged_decode_attention(q, k_cache, k_cache, ids, offsets, seq_lens, 0.25, WIDE)
        assert workspace.buffer(DEV) is buf and buf.data_ptr() == ptr, n


def test_the_workspace_a_launch_takes_is_what_decode_workspace_says() -> None:
    n = 3
    q = torch.randn(n, HEADS, HEAD_DIM, device=DEV)
    k_cache = torch.randn(2, BLOCK, KV_HEADS, HEAD_DIM, device=DEV)
    ids = torch.ones(n, dtype=torch.int32, device=DEV)
    offsets = torch.arange(n + 1, dtype=torch.int32, device=DEV)
    paged_decode_attention(q, k_cache, k_cache, ids, offsets, torch.ones(n, dtype=torch.int32, device=DEV), 0.088, WIDE)
    buf = workspace.buffer(DEV)
    assert buf is not None and buf.numel() == needs(n, DEV)


def test_a_device_without_an_index_names_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert workspace.device_key(torch.device("cuda")) == torch.device("cuda", 1)
    assert workspace.device_key("cuda:0") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert workspace.device_key(torch.device("cuda")) == workspace.device_key(torch.device("cuda:0"))
    assert workspace.device_key("cpu") == workspace.device_key(torch.device("cpu", 0)) == CPU


def test_cuda_and_cuda_0_share_one_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer made under "cuda:0" is found, and kept, under a bare "cuda" (no GPU needed: the
    buffer is big enough, so nothing is allocated)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    stand_in = torch.empty(64)
    workspace._buffers[torch.device("cuda", 0)] = stand_in
    assert workspace.buffer(torch.device("cuda")) is stand_in
    assert workspace.reserve(torch.device("cuda"), 64) is stand_in
    assert list(workspace._buffers) == [torch.device("cuda", 0)]
