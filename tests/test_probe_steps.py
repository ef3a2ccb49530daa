"""What a worker runs on itself before serving, and what a step waits for.

- On CUDA the KV cache is sized from the memory peak of the heaviest step it can be sent: a
  full token budget over `max_num_seqs` rows, every row sampled with top-p, penalties, bias,
  min-p and alternatives, and prompt log-probabilities; on the torch attention path also
  `max_num_seqs` rows decoding at the longest context. Run here on the CPU with the CUDA
  memory calls faked: the profile must execute those plans, whole.
- With CUDA graphs, the profile also keeps back what the decode graphs will hold, from a trial
  capture of the largest bucket (faked here); the budget's arithmetic is a pure function. With
  adapter slots, the probes run through an empty slot posing as an adapter, left empty after.
- On CUDA a warm-up runs a prompt step and decode steps (one per merge tile) before serving,
  so Triton compiles the decode kernels then, not in the first requests' steps (here through
  the interpreter, counting decode-kernel launches).
- Sampling decides on the host which rows take which path, and a step copies its results
  from the device once: no call that would wait for a CUDA device inside the sampler, the
  logit processing or the log-probabilities, and no host-to-device copy in a step that is not
  queued (a torch function mode records both on the CPU).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM

from common.config import CacheConfig, LoraConfig, WorkerConfig
from common.plan import SamplingBatch, StepPlan, StepResult
from kernels.paged_attention import MERGE_PADS
from worker_svc.layers import triton_attention as backend
from worker_svc.sampling.logits_processor import process_logits
from worker_svc.sampling.logprobs import logprob_tensors
from worker_svc.sampling.sampler import sample
from worker_svc.step import kv_cache, runner_setup
from worker_svc.step import runner as runner_module
from worker_svc.step.device_memory import kv_budget
from worker_svc.step.probe_plans import PROFILE_LOGPROBS, heaviest_step, prompt_rows, widest_decode_step
from worker_svc.step.runner import ModelRunner
from worker_svc.step.step_buckets import Buckets


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("probe-model")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
    )
    LlamaForCausalLM(cfg).float().save_pretrained(str(path))
    return path


class _Executed:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[tuple[StepPlan, StepResult]] = []
        execute = ModelRunner.execute

        def spy(runner: ModelRunner, plan: StepPlan) -> StepResult:
            result = execute(runner, plan)
            self.steps.append((plan, result))
            return result

        monkeypatch.setattr(ModelRunner, "execute", spy)


MIB = 1 << 20


def _fake_cuda_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64 MiB device with 48 MiB free, 8 MiB of it ours; the peak 1 MiB above that, and the
    allocator's segments at that peak 1 MiB more again (what the budget counts)."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (48 * MIB, 64 * MIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 8 * MIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 9 * MIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 10 * MIB)


def _profiled_config(model_dir: Path) -> WorkerConfig:
    """A torch-attention worker whose memory profile runs (with the CUDA calls faked)."""
    return WorkerConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        attention_backend="torch",
        max_num_batched_tokens=96,
        max_num_seqs=24,
        cache=CacheConfig(block_size=16, num_cpu_blocks=0),
    )


def test_the_memory_profile_runs_the_heaviest_step_whole(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    executed = _Executed(monkeypatch)
    _fake_cuda_memory(monkeypatch)
    monkeypatch.setattr(ModelRunner, "_profiles_memory", lambda self: True)
    runner = ModelRunner(_profiled_config(model_dir))
    # The torch attention path: the widest decode too, every row at the longest context.
    assert len(executed.steps) == 2
    widest, widest_result = executed.steps[1]
    assert widest.num_seqs == 24 and (widest.query_lens == 1).all()
    assert (widest.context_lens == runner.max_model_len - 1).all() and (widest_result.sampled_token_ids >= 0).all()
    plan, result = executed.steps[0]
    s = plan.sampling
    assert plan.num_seqs == 24 and plan.num_tokens == 96 and plan.sample.all()
    assert (s.temperature > 0).all() and (s.top_p < 1).all() and (s.top_k > 0).all() and (s.min_p > 0).all()
    assert (s.repetition_penalty != 1).all() and (s.presence_penalty > 0).all() and (s.frequency_penalty > 0).all()
    assert np.diff(s.history_offsets).min() > 0 and np.diff(s.bias_offsets).min() > 0
    assert (s.num_logprobs == PROFILE_LOGPROBS).all() and s.prompt_logprobs[0] == PROFILE_LOGPROBS
    # It ran through every path: a token for every row, alternatives, the chunk's prompt scores.
    assert (result.sampled_token_ids >= 0).all()
    assert result.top_token_ids.shape == (24, PROFILE_LOGPROBS) and (result.top_token_ids >= 0).all()
    assert result.prompt_logprobs.size == plan.query_lens[0] - 1
    # The budget: 0.9 x 64 MiB, less the 8 MiB others use, less the step's reserved peak
    # (10 MiB with the probe's own cache in it).
    probe_cache = heaviest_step(96, 24, 16, runner.shape.vocab_size)[1] * kv_cache.bytes_per_block(
        runner.shape, 16, runner.dtype
    )
    budget = 0.9 * 64 * MIB - 8 * MIB - (10 * MIB - probe_cache)
    assert runner.kv.num_blocks == kv_cache.blocks_in(budget, runner.shape, 16, runner.dtype)
    assert runner.profiled_peak_bytes == 1 * MIB
    assert runner._last_sampled == {}  # noqa: SLF001 (nothing of the probe carries over)


def test_the_kv_budget_is_what_the_weights_the_step_the_graphs_and_others_leave() -> None:
    total, free, allocated = 100 * MIB, 60 * MIB, 30 * MIB  # 10 MiB held elsewhere
    assert kv_budget(total, free, allocated, 0.9, 40 * MIB, 0) == 90 * MIB - 10 * MIB - 40 * MIB
    assert kv_budget(total, free, allocated, 0.9, 40 * MIB, 15 * MIB) == 25 * MIB
    assert kv_budget(total, free, allocated, 0.5, 40 * MIB, 15 * MIB) == 0.0  # never below 0
    assert kv_budget(total, total, 0, 1.0, 0, 0) == total  # an empty device, all of it


class _FakeGraphs:
    """DecodeGraphs without CUDA: a capture reserves 1 MiB per bucket, plus 2 MiB for the
    largest (its pool); what the trial and the real capture asked for is recorded."""

    reserved = 0
    captured: list[tuple[int, ...]] = []

    def __init__(self, forward: Any, make_meta: Any, buckets: Buckets, width: int, *rest: Any) -> None:
        self.buckets, self.width = buckets, width

    def capture(self) -> None:
        _FakeGraphs.captured.append(self.buckets.sizes)
        _FakeGraphs.reserved += (2 + len(self.buckets.sizes)) * MIB


def test_the_memory_profile_keeps_back_what_the_decode_graphs_hold(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_cuda_memory(monkeypatch)
    monkeypatch.setattr(ModelRunner, "_profiles_memory", lambda self: True)
    monkeypatch.setattr(ModelRunner, "_use_graphs", lambda self: True)
    monkeypatch.setattr(runner_setup, "DecodeGraphs", _FakeGraphs)
    monkeypatch.setattr(_FakeGraphs, "captured", [])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: _FakeGraphs.reserved)
    logged: dict[str, dict[str, Any]] = {}
    # The loggers are cached at first use (tests/conftest.py configures structlog so): replaced whole.
    monkeypatch.setattr(runner_setup, "log", SimpleNamespace(info=lambda event, **kw: logged.setdefault(event, kw)))
    runner = ModelRunner(_profiled_config(model_dir))
    # The trial: the largest bucket alone (max_num_seqs); then every bucket, for serving.
    assert _FakeGraphs.captured[0] == (24,) and _FakeGraphs.captured[1][-1] == 24
    assert len(_FakeGraphs.captured) == 2 and len(_FakeGraphs.captured[1]) > 1
    assert (
        runner.graph_pool_bytes == 3 * MIB and runner.captured_graph_bytes == (2 + len(_FakeGraphs.captured[1])) * MIB
    )
    probe_cache = heaviest_step(96, 24, 16, runner.shape.vocab_size)[1] * kv_cache.bytes_per_block(
        runner.shape, 16, runner.dtype
    )
    budget = 0.9 * 64 * MIB - 8 * MIB - (10 * MIB - probe_cache) - 3 * MIB  # as without graphs, less the pool
    assert runner.kv.num_blocks == kv_cache.blocks_in(budget, runner.shape, 16, runner.dtype)
    assert logged["kv_profiled"]["graph_pool_gib"] == round(3 * MIB / kv_cache.GIB, 3)
    held = (2 + len(_FakeGraphs.captured[1])) * MIB  # what the real capture held, to compare with the trial's
    assert logged["cuda_graphs_memory"]["held_gib"] == round(held / kv_cache.GIB, 3)
    assert logged["cuda_graphs_memory"]["profiled_gib"] == round(3 * MIB / kv_cache.GIB, 3)


def test_with_adapter_slots_the_probes_run_adapted_and_leave_the_slots_empty(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executed = _Executed(monkeypatch)
    _fake_cuda_memory(monkeypatch)
    monkeypatch.setattr(ModelRunner, "_profiles_memory", lambda self: True)
    active: list[frozenset[int]] = []  # the slots each forward pass's linears adapted through
    begin_step = runner_setup.LoraSlots.begin_step

    def recorded(self: Any, token_slots: Any) -> None:
        begin_step(self, token_slots)
        active.append(self.step.active)

    monkeypatch.setattr(runner_setup.LoraSlots, "begin_step", recorded)
    config = dataclasses.replace(_profiled_config(model_dir), lora=LoraConfig(max_loras=2, max_lora_rank=8))
    runner = ModelRunner(config)
    assert len(executed.steps) == 2 and all((p.lora_slots == 0).all() for p, _ in executed.steps)
    assert active == [frozenset({0}), frozenset()] * 2  # each probe adapted, then the step's slots cleared
    slots = runner.lora
    assert slots is not None and slots.loaded == [None, None] and slots.targets == [frozenset()] * 2
    assert not slots.step.active and slots.ranks == [0, 0]
    with pytest.raises(runner_module.PlanError, match="holds no adapter"):
        runner.execute(dataclasses.replace(executed.steps[0][0], step_id=5))


def test_a_probe_that_does_not_fit_says_what_to_lower(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda_memory(monkeypatch)
    monkeypatch.setattr(ModelRunner, "_profiles_memory", lambda self: True)
    execute = ModelRunner.execute

    def short_of_memory(self: ModelRunner, plan: StepPlan) -> StepResult:
        if int(plan.context_lens.max()) > 0:  # the widest decode
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return execute(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", short_of_memory)
    with pytest.raises(RuntimeError, match="24 rows .* lower --max-num-seqs or --max-model-len, or use --attention"):
        ModelRunner(_profiled_config(model_dir))


def test_the_widest_decode_is_a_valid_plan_within_the_cache() -> None:
    plan = widest_decode_step(8, 100, 16, 1000, num_blocks=3)
    plan.validate()
    tables = plan.block_tables.dense()
    assert tables.shape == (8, 7) and tables.max() == 2 and tables.min() == 0
    assert (plan.context_lens == 100).all() and plan.num_tokens == 8


@pytest.mark.parametrize(
    ("tokens", "rows", "max_len", "want"),
    [(1024, 16, 4096, [64] * 16), (10, 4, 64, [3, 3, 2, 2]), (300, 2, 100, [100] * 3)],
)
def test_the_long_prompts_spread_over_the_rows_a_step_may_have(
    tokens: int, rows: int, max_len: int, want: list[int]
) -> None:
    plan = prompt_rows(tokens, rows, max_len, 16, 300, num_blocks=5)
    plan.validate()
    assert plan.query_lens.tolist() == want and (plan.context_lens == 0).all() and plan.sample.all()
    tables = plan.block_tables
    assert tables.max_len * 16 >= max(want) and 0 <= tables.ids.min() <= tables.ids.max() < 5


@pytest.mark.parametrize(("tokens", "seqs"), [(96, 24), (2048, 256), (5, 256), (1, 1), (300, 1)])
def test_the_heaviest_step_is_a_valid_plan_over_distinct_blocks(tokens: int, seqs: int) -> None:
    plan, blocks = heaviest_step(tokens, seqs, 16, 1000)
    plan.validate()
    assert plan.num_tokens == tokens and plan.num_seqs == min(seqs, tokens)
    tables = plan.block_tables
    assert sorted(tables.ids.tolist()) == list(range(blocks))
    assert all(len(tables.row(i)) * 16 >= q for i, q in enumerate(plan.query_lens))


def test_the_warm_up_launches_the_decode_kernel_before_serving(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executed = _Executed(monkeypatch)
    launches = {"decode": 0}
    launch = backend.paged_decode_attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        launches["decode"] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(backend, "paged_decode_attention", counted)
    monkeypatch.setattr(ModelRunner, "_warms_up", lambda self: True)
    runner = ModelRunner(
        WorkerConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            attention_backend="triton",
            cache=CacheConfig(block_size=16, num_gpu_blocks=8),
            max_num_seqs=4,
        )
    )
    # A prompt step, then one decode step per merge tile a device could pick (the ranks of a
    # group must run as many: tests/test_warm_up_variants.py).
    steps = [p for p, _ in executed.steps]
    assert steps[0].query_lens.tolist() == [24] and len(steps) == 1 + len(MERGE_PADS)
    assert all((p.query_lens == 1).all() and (p.context_lens > 0).all() for p in steps[1:])
    # The first decode carries an open token mask: the mask kernel compiles here too.
    assert (steps[1].sampling.mask_rows >= 0).all() and (steps[1].sampling.token_masks == -1).all()
    assert launches["decode"] >= len(MERGE_PADS)
    assert runner._last_sampled == {}  # noqa: SLF001


# Calls that make the host wait for a CUDA device (a value or a size that lives there).
WAITS = {
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "item",
    "tolist",
    "numpy",
    "cpu",
    "nonzero",
    "masked_select",
    "unique",
}


def _names_a_device(args: Any, kwargs: dict[str, Any]) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])


class _Waits(TorchFunctionMode):
    """Records calls that wait for a device: reads of its values (`calls`), and host-to-device
    copies that are not queued (`uploads`: on CUDA a plain `.to(device)` or
    `torch.tensor(..., device=)` is a copy followed by a wait for the stream). On the CPU both
    kinds run as usual, so the code under test is checked where it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.uploads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in WAITS:
            self.calls.append(name)
        elif name == "to" and not kwargs.get("non_blocking", False) and _names_a_device(args, kwargs):
            self.uploads.append(name)
        elif name in ("tensor", "as_tensor") and "device" in kwargs:
            self.uploads.append(name)
        return func(*args, **kwargs)


def test_the_wait_recorder_sees_blocking_uploads() -> None:
    with _Waits() as waits:
        torch.from_numpy(np.zeros(3)).to("cpu")
        torch.from_numpy(np.zeros(3)).to(device=torch.device("cpu"))
        torch.tensor([1, 2], device="cpu")
        torch.from_numpy(np.zeros(3)).to("cpu", non_blocking=True)
        torch.zeros(3).to(torch.int64)
    assert waits.uploads == ["to", "to", "tensor"]


def test_sampling_logit_processing_and_logprobs_never_wait_for_the_device() -> None:
    plan, _ = heaviest_step(40, 8, 16, 500)
    s = plan.sampling
    s.temperature[::3] = 0.0  # greedy rows beside drawn ones
    s.top_p[1::2] = 1.0
    s.top_k[1::2] = 0  # rows that walk the distribution in vocabulary order
    rows = np.arange(plan.num_seqs)
    torch.manual_seed(0)
    logits = torch.randn(plan.num_seqs, 500)
    with _Waits() as waits:
        processed = process_logits(logits, s, rows)
        tokens = sample(processed, s.temperature, s.top_p, s.top_k, s.seed, s.output_position, s.min_p)
        lse = torch.logsumexp(logits, dim=-1)
        logprob_tensors(logits, lse, tokens, rows, s.num_logprobs)
    assert waits.calls == [] and waits.uploads == []
    assert tokens.shape == (plan.num_seqs,)


def test_a_step_queues_its_uploads_and_copies_its_results_back_once(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = ModelRunner(
        WorkerConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(block_size=16, num_gpu_blocks=32),
            max_num_seqs=8,
        )
    )
    copies: list[int] = []
    to_host = runner_module.to_host

    def counted(*tensors: torch.Tensor) -> list[np.ndarray]:
        copies.append(len(tensors))
        return to_host(*tensors)

    monkeypatch.setattr(runner_module, "to_host", counted)
    plan, _ = heaviest_step(40, 8, 16, runner.shape.vocab_size)
    plan = StepPlan(
        **{
            **plan.__dict__,
            "sampling": SamplingBatch(
                **{
                    **plan.sampling.__dict__,
                    "prompt_logprobs": np.zeros(0, np.int32),
                    "prompt_next_token": np.zeros(0, np.int32),
                }
            ),
        }
    )
    with _Waits() as waits:
        result = runner.execute(plan)
    assert copies == [4] and (result.sampled_token_ids >= 0).all()
    assert waits.uploads == []
