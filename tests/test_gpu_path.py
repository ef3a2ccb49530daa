"""The GPU path's load and step contracts, held without a GPU (issue 18).

The meta device stands in for CUDA where a tensor must end up on the device the model is
built on: one left on the CPU mixes devices there exactly as it would next to a CUDA tensor.
CUDA's current device is faked, per thread as on a GPU (every new thread starts on device 0),
to show that each thread that runs the model is bound to the worker's device first.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from common import worker_wire
from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo
from tests.plans import Feed, make_plan
from worker_svc.device.parallel import ParallelGroup, bind_device, dist_backend, init_group
from worker_svc.device.pipeline import PipelineStage
from worker_svc.layers.rotary import RotaryEmbedding
from worker_svc.models.registry import build_model
from worker_svc.service.server import rank_device
from worker_svc.service.servicer import WorkerServicer
from worker_svc.step.loader import resolve_device
from worker_svc.step.runner import PlanError

ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}
SCALED = ["linear", "llama3", "yarn"]


def tiny_config(rope: str = "default", **overrides: Any) -> LlamaConfig:
    params: dict[str, Any] = dict(
        vocab_size=301,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=dict(ROPES[rope]),
    )
    return LlamaConfig(**(params | overrides))


# ---- 1. rotary tables on the model's device ----


@pytest.mark.parametrize("rope", list(ROPES))
def test_rotary_tables_are_made_on_the_device_the_model_is_built_on(rope: str) -> None:
    with torch.device("meta"):
        rotary = RotaryEmbedding(tiny_config(rope), 16, 256, torch.bfloat16)
    for table in (rotary.cos, rotary.sin):
        assert (table.device.type, table.dtype, tuple(table.shape)) == ("meta", torch.bfloat16, (256, 8))


@pytest.mark.parametrize("rope", SCALED)
def test_a_scaled_rope_model_is_built_wholly_on_its_device(rope: str) -> None:
    with torch.device("meta"):
        model = build_model(tiny_config(rope), torch.bfloat16)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert {"rotaries.default.cos", "rotaries.default.sin", "lm_head.weight"} <= tensors.keys()
    assert {name: (t.device.type, t.dtype) for name, t in tensors.items() if t.device.type != "meta"} == {}
    assert {name: t.dtype for name, t in tensors.items() if t.dtype != torch.bfloat16} == {}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rotary_tables_match_transformers(rope: str) -> None:
    config = tiny_config(rope)
    rotary = RotaryEmbedding(config, 16, 256, torch.float32)
    reference = LlamaRotaryEmbedding(config)
    with torch.no_grad():
        cos, sin = reference(torch.zeros(1), torch.arange(256)[None])  # [1, positions, head_dim], both halves alike
    torch.testing.assert_close(rotary.cos, cos[0, :, :8], atol=1e-6, rtol=0)
    torch.testing.assert_close(rotary.sin, sin[0, :, :8], atol=1e-6, rtol=0)


# ---- 2. every step on the worker's GPU, and a failing step is a failed rank ----


class FakeCuda:
    """torch.cuda's current device as CUDA keeps it: per thread, 0 until the thread sets it."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.set_calls: list[tuple[str, int]] = []  # (thread name, device index)

    def set_device(self, device: torch.device | int) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index is None:  # torch's own refusal (torch.cuda._utils._get_device_index)
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        self.set_calls.append((threading.current_thread().name, index))
        self._local.index = index

    def current_device(self) -> int:
        return int(getattr(self._local, "index", 0))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    return fake


class FakeRunner:
    """What the servicer uses of a ModelRunner. `execute` does what the real one does in this
    order: the plan checks (`refuse`: they raise PlanError), then the forward pass, whose
    kernels launch on the current CUDA device (`fail`: it raises)."""

    def __init__(
        self, device: str = "cpu", world_size: int = 1, refuse: bool = False, fail: Exception | None = None
    ) -> None:
        self.device = torch.device(device)
        self.group = ParallelGroup(0, world_size)
        self.config = SimpleNamespace(profile_steps=False, world_size=world_size, rank=0)
        self.refuse, self.fail = refuse, fail
        self.launched_on: list[tuple[str, int]] = []  # (thread name, current device) per forward

    def info(self, model_name: str) -> WorkerInfo:
        # What the handshake reports, and what bounds the plans the servicer decodes.
        return WorkerInfo(model_name, 49152, 4096, "float32", str(self.device), 0, self.group.world_size, 16, 64, 0)

    def execute(self, plan: StepPlan) -> StepResult:
        if self.refuse:
            raise PlanError("block id outside the cache of 16 blocks")
        if self.device.type == "cuda":
            self.launched_on.append((threading.current_thread().name, torch.cuda.current_device()))
        if self.fail is not None:
            raise self.fail
        return StepResult(plan.step_id, np.zeros(plan.num_seqs, np.int32))


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted(code, details)


def plan(step_id: int) -> StepPlan:
    return make_plan(step_id, [Feed(0, [5], context_len=3, block_table=[1])])


async def run_stream(runner: FakeRunner, messages: list[Any], context: FakeContext) -> list[int]:
    """The step ids the servicer answers to `messages` (encoded plans), in order."""

    async def requests() -> AsyncIterator[Any]:
        for msg in messages:
            yield msg

    servicer = WorkerServicer(runner, "m")
    answered: list[int] = []

    async def drain() -> None:
        async for reply in servicer.Execute(requests(), context):
            answered.append(reply.step_id)

    try:
        await asyncio.wait_for(drain(), 30)
    finally:
        servicer.shutdown()
    return answered


def test_a_group_of_one_binds_the_main_thread_to_its_gpu(fake_cuda: FakeCuda) -> None:
    # Loading, the KV profile step and graph capture run on the main thread, with --device
    # cuda:2 and no tensor parallelism.
    group = init_group(0, 1, "unused://", torch.device("cuda", 2))
    assert group.world_size == 1
    assert torch.cuda.current_device() == 2


@pytest.mark.parametrize("flag", ["cuda", "auto"])
def test_a_device_named_without_an_index_binds_the_first_gpu(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    # --device cuda (what the benchmarks and GPU tests pass) reaches set_device through the
    # runner and the worker's group; torch refuses a CUDA device without an index.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device = resolve_device(flag)
    assert device == torch.device("cuda", 0)
    init_group(0, 1, "unused://", rank_device(device, 0, 1))
    bind_device(resolve_device("cuda:1"))
    assert fake_cuda.set_calls == [("MainThread", 0), ("MainThread", 1)]


def test_the_stand_in_refuses_what_cuda_refuses(fake_cuda: FakeCuda) -> None:
    with pytest.raises(ValueError, match="specified index"):
        bind_device(torch.device("cuda"))


def test_ranks_share_a_gpu_only_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda = resolve_device("cuda")
    assert [rank_device(cuda, r, 2, "gloo") for r in range(2)] == [torch.device("cuda", 0)] * 2
    with pytest.raises(ValueError, match="--dist-backend gloo"):
        rank_device(cuda, 1, 2, "nccl")
    assert dist_backend("auto", cuda) == "nccl" and dist_backend("gloo", cuda) == "gloo"
    assert dist_backend("auto", torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError, match="needs CUDA"):
        dist_backend("nccl", torch.device("cpu"))


async def test_every_step_runs_with_the_workers_gpu_current(fake_cuda: FakeCuda) -> None:
    runner = FakeRunner("cuda:1")
    context = FakeContext()
    answered = await run_stream(runner, [worker_wire.encode_plan(plan(i)) for i in range(3)], context)
    assert answered == [0, 1, 2] and context.aborted is None
    assert len(runner.launched_on) == 3
    assert all(name.startswith("forward") and device == 1 for name, device in runner.launched_on), runner.launched_on
    assert all(index == 1 for _, index in fake_cuda.set_calls)


class RankExit(Exception):
    pass


# Triton's error for a pointer on another device than the current one, and a CUDA fault.
KERNEL_ERRORS = [
    ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
]


@pytest.mark.parametrize("error", KERNEL_ERRORS, ids=["ValueError", "RuntimeError"])
async def test_an_error_in_the_forward_pass_of_a_group_fails_the_rank(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    # Not a refused plan: rank 0 would wait for this rank in an all-reduce until the NCCL timeout.
    def exit_(code: int) -> None:
        raise RankExit(code)

    monkeypatch.setattr(os, "_exit", exit_)
    context = FakeContext()
    with pytest.raises(RankExit) as exited:
        await run_stream(FakeRunner(world_size=2, fail=error), [worker_wire.encode_plan(plan(0))], context)
    assert exited.value.args == (3,) and context.aborted is None


async def test_an_error_in_the_forward_pass_of_a_single_worker_is_not_a_refused_plan() -> None:
    context = FakeContext()
    with pytest.raises(ValueError, match="cannot be accessed from Triton"):
        await run_stream(FakeRunner(fail=KERNEL_ERRORS[0]), [worker_wire.encode_plan(plan(0))], context)
    assert context.aborted is None


async def test_a_plan_the_checks_refuse_is_invalid_argument_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "_exit", lambda code: pytest.fail(f"a refused plan exited the rank ({code})"))
    context = FakeContext()
    with pytest.raises(Aborted):
        await run_stream(FakeRunner(world_size=2, refuse=True), [worker_wire.encode_plan(plan(4))], context)
    assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "step 4: block id outside the cache of 16 blocks")


async def test_a_plan_that_does_not_decode_is_invalid_argument() -> None:
    msg = worker_wire.encode_plan(plan(5))
    msg.query_lens = b"\x01\x02\x03"  # not a whole int32
    context = FakeContext()
    with pytest.raises(Aborted):
        await run_stream(FakeRunner(world_size=2), [msg], context)
    assert context.aborted is not None and context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "query_lens" in context.aborted[1]


# ---- 3. parameters made in the model's dtype ----


class Allocations(TorchDispatchMode):
    """(dtype, bytes) of every tensor an op makes anew on `device_type`: not a view, not an
    in-place or out= write, which alias a tensor made before."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.made: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if all(a.alias_info is None for a in func._schema.arguments):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                    self.made.append((t.dtype, t.numel() * t.element_size()))
        return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("group", [ParallelGroup(), ParallelGroup(1, 2)], ids=["tp1", "tp2-rank1"])
def test_a_bfloat16_model_never_holds_a_float32_weight(tied: bool, group: ParallelGroup) -> None:
    config = tiny_config(tie_word_embeddings=tied, attention_bias=True, mlp_bias=True)
    with torch.device("meta"), Allocations("meta") as allocations:
        model = build_model(config, torch.bfloat16, group=group)
    assert {dtype for dtype, _ in allocations.made} == {torch.bfloat16}
    # Nothing but the weights, once, and the rotary tables: 2 bytes a parameter at the peak.
    weights = sum(p.numel() for p in model.parameters())  # a tied head counts once
    tables = sum(
        t.numel() * t.element_size()
        for t in (r for rotary in model.rotaries.values() for r in (rotary.cos, rotary.sin))
    )
    assert sum(size for _, size in allocations.made) == 2 * weights + tables


def test_a_float32_model_is_float32_throughout() -> None:
    model = build_model(tiny_config(), torch.float32)
    tensors = list(model.parameters()) + list(model.buffers())
    assert {(t.device.type, t.dtype) for t in tensors} == {("cpu", torch.float32)}


@pytest.mark.parametrize(
    ("backend", "world_size", "graphs"), [("gloo", 2, False), ("auto", 2, True), ("gloo", 1, True)]
)
def test_a_group_over_gloo_on_cuda_runs_without_graphs(backend: str, world_size: int, graphs: bool) -> None:
    # A gloo collective copies through the host, which a CUDA graph capture cannot contain.
    from common.config import WorkerConfig
    from worker_svc.step.runner_setup import RunnerSetup

    config = WorkerConfig(model="m", world_size=world_size, dist_init_method="tcp://x:1", dist_backend=backend)
    runner = SimpleNamespace(
        device=torch.device("cuda", 0),
        attention_backend="triton",
        config=config,
        group=ParallelGroup(0, world_size),
        stage=PipelineStage(),
        draft=None,
    )
    assert RunnerSetup._use_graphs(runner) is graphs  # type: ignore[arg-type]
    runner.draft = object()  # a draft model's steps run both models eagerly
    assert RunnerSetup._use_graphs(runner) is False  # type: ignore[arg-type]
