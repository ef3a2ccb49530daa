"""What a worker's runner does once, before its first step: load the model, size the KV
cache (on CUDA from the memory peak of the heaviest step it can be sent), warm the kernels up
and capture the decode graphs.

Kept apart from the step (runner.py) because none of it runs again once the worker serves,
though it runs steps: the memory profile and the warm-up are real plans, executed by the
subclass's `execute`. It all runs on the thread that constructs the runner, the one that
then runs every step (the main-thread executor, worker_svc/service/main_thread.py: one
OpenMP team for loading, warm-up and steps alike).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext

import structlog
import torch

from common.config import WorkerConfig
from common.model_spec import served_context
from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo
from kernels.cpu_linear import own_kernel
from kernels.fused_moe import BLOCK_M, moe_block_m_tokens
from kernels.paged_attention import MERGE_PADS, decode_shapes, decode_workspace
from worker_svc.device.parallel import SINGLE, ParallelGroup, bind_device, dist_backend
from worker_svc.device.pipeline import PipelineStage
from worker_svc.layers.replicated import cpu_kernels_for
from worker_svc.layers.triton_attention import TritonAttentionMetadata
from worker_svc.lora.lora_slots import LoraSlots
from worker_svc.step import host_memory, kv_cache
from worker_svc.step.cuda_graphs import DecodeGraphs
from worker_svc.step.device_memory import kv_budget, reserved_growth, workspace_bytes
from worker_svc.step.draft_model import DraftModel
from worker_svc.step.host_allocator import keep_freed_memory
from worker_svc.step.kv_cache import KVCache
from worker_svc.step.loader import (
    head_dim_of,
    load_config,
    load_model,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
    triton_token_limit,
)
from worker_svc.step.probe_plans import (
    decode_step,
    heaviest_step,
    prompt_rows,
    through_slot,
    widest_decode_step,
    with_open_masks,
    zero_adapter,
)
from worker_svc.step.step_buckets import Buckets, gemm_buckets, graph_buckets
from worker_svc.step.step_profile import StepProfile

log = structlog.get_logger(__name__)


class RunnerSetup(ABC):
    """A runner's state, built in `__init__` (weights, adapter slots, the KV cache and swap
    pool, the captured graphs); ModelRunner adds the step. `group`: the tensor-parallel group
    this runner is a rank of."""

    def __init__(self, config: WorkerConfig, group: ParallelGroup = SINGLE, stage: PipelineStage | None = None) -> None:
        self.config = config
        self.group = group
        self.device = resolve_device(config.device)
        bind_device(self.device)  # loading, profiling and graph capture launch kernels on this thread
        keep_freed_memory()  # before the model's first allocations (see worker_svc.step.host_allocator)
        self.dtype = resolve_dtype(config.dtype, self.device)
        hf_config = load_config(config.model)
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, self.device, self.dtype, head_dim_of(hf_config)
        )
        # The Triton kernels index a step's tokens in int32 (kernels/limits.py): a bigger step
        # is refused here, at start, and per plan in check().
        self.step_token_limit = triton_token_limit(hf_config) if self.attention_backend == "triton" else None
        if self.step_token_limit is not None and config.max_num_batched_tokens > self.step_token_limit:
            raise ValueError(
                f"--max-num-batched-tokens {config.max_num_batched_tokens} is above {self.step_token_limit}, the most "
                f"tokens one step may carry through this model's Triton kernels (their int32 indices would wrap)"
            )
        self.max_model_len = served_context(hf_config, config.max_model_len)
        self.model = load_model(
            config.model,
            self.dtype,
            self.device,
            max_positions=self.max_model_len,  # the rotary tables cover every position served
            attention_backend=self.attention_backend,
            group=group,
            stage=stage,
        )
        self.stage = self.model.stage
        if self.stage.pipelined and config.lora is not None:
            raise ValueError("--enable-lora with --pp is not supported yet: serve adapters with --tp alone")
        self.draft = self._load_draft() if config.speculative_model else None
        self._cpu_kernels = cpu_kernels_for(self.attention_backend)
        # Adapter slots before the KV cache is sized: on CUDA the profile then counts them.
        self.lora = (
            LoraSlots(
                self.model,
                config.lora,
                self.dtype,
                self.device,
                use_kernels=self.attention_backend == "triton",  # the interpreter runs them on a CPU (tests)
            )
            if config.lora is not None
            else None
        )
        self._profile = StepProfile(self.model, self.device) if config.profile_steps else None
        # What the last step sampled, by sequence: the next plan's deferred inputs. The only
        # thing a worker carries from one step to the next.
        self._last_sampled: dict[int, int] = {}
        # oneDNN builds a GEMM per row count: keep its counts to a few buckets (our bf16 GEMM has no need).
        own_gemm = self.dtype == torch.bfloat16 and own_kernel()
        self._gemm_buckets = (
            gemm_buckets(config.max_num_batched_tokens) if self.attention_backend == "cpu" and not own_gemm else None
        )
        self.shape = self.model.shape
        self.block_size = config.cache.block_size
        self._graphs: DecodeGraphs | None = None  # eager until captured, below (profiling runs steps)
        self.profiled_peak_bytes: int | None = None  # the heaviest step's, when CUDA memory was profiled
        self.graph_pool_bytes: int | None = None  # what the profile's trial capture held, less the workspace
        self.captured_graph_bytes: int | None = None  # and what serving's capture held
        num_blocks = self._kv_capacity()
        self.kv = KVCache(
            self.shape, num_blocks, self.block_size, self.dtype, self.device, self._swap_capacity(), self._layers
        )
        log.info(
            "kv_cache_allocated",
            num_blocks=num_blocks,
            block_size=self.block_size,
            tokens=num_blocks * self.block_size,
            gib=round(self.kv.nbytes / kv_cache.GIB, 3),
        )
        if self.draft is not None:
            self.draft.allocate(num_blocks, self.block_size, self.kv.num_cpu_blocks)
        log.info(
            "swap_pool_allocated",
            num_blocks=self.kv.num_cpu_blocks,
            tokens=self.kv.num_cpu_blocks * self.block_size,
            gib=round(self.kv.host_nbytes / kv_cache.GIB, 3),
            pinned=self.kv.pinned,
        )
        if self._warms_up():
            self._warm_up()
        self._graphs = self._capture_graphs() if self._use_graphs() else None

    def _load_draft(self) -> DraftModel:
        if self.group.world_size > 1 or self.stage.pipelined:
            raise ValueError("--speculative-model with --tp or --pp is not supported yet: a draft model needs one rank")
        path, vocab = self.config.speculative_model, self.model.shape.vocab_size
        return DraftModel(path, self.dtype, self.device, self.attention_backend, vocab, self.max_model_len)

    @property
    def _layers(self) -> int:
        """Decoder layers this rank holds a KV cache for: its pipeline stage's."""
        return len(self.stage.layers)

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult:
        """One step (ModelRunner's): the memory profile and the warm-up run real ones."""

    def _warms_up(self) -> bool:
        # Triton compiles a kernel on its first launch (seconds): on CUDA that happens here,
        # not in the first requests' steps.
        return self.device.type == "cuda"

    def _warm_up(self) -> None:
        """A prompt step, then a decode step for each compiled variant of the decode kernels a
        step can pick (_warm_up_decodes), in blocks 0-1, and the experts' longer prompts
        (_warm_up_moe_tokens), before any sequence owns a block; with adapter slots, the
        prompt and the first decode again through an adapter.

        A LoRA launch's key follows its layer (features, its part's place in the output) and
        the slots' shape (max_loras, max_lora_rank), not the step: token counts, splits and
        chunks are unspecialised (kernels/lora.py), ranks padded to the slots', and a step's
        adapters share its launches. One adapter of every module compiles them all."""
        if self.kv.num_blocks < 2:
            return
        s, context = self.shape, self.block_size + self.block_size // 2
        prompt, _ = heaviest_step(context, 1, self.block_size, s.vocab_size)
        shapes, moe = self._warm_up_decodes(), self._warm_up_moe_tokens()
        decodes = [decode_step(self.block_size, s.vocab_size, n, w) for n, w in shapes]
        decodes[0] = with_open_masks(decodes[0], s.vocab_size)
        rows, blocks = self.config.max_num_seqs, self.kv.num_blocks
        long = [prompt_rows(t, rows, self.max_model_len, self.block_size, s.vocab_size, blocks) for t in moe]
        for plan in (prompt, *decodes, *long):
            self.execute(plan)
        steps = ["prompt", *(f"decode {n}x{w}" for n, w in shapes), *(f"prompt of {t}" for t in moe)]
        if self.lora is not None:
            with zero_adapter(self.lora) as slot:
                for plan in (prompt, decodes[0]):
                    self.execute(through_slot(plan, slot))
            steps += ["adapted prompt", "adapted decode"]
        self._last_sampled = {}
        log.info("worker_warmed_up", steps=tuple(steps))

    def _warm_up_moe_tokens(self) -> list[int]:
        """Prompt tokens of a step for each taller row tile the grouped GEMMs can pick (the
        warm-up's prompt and decodes take the 16-row one): the tile follows the step's rows
        per expert, and each is a compiled variant (kernels.fused_moe.moe_block_m_tokens)."""
        s = self.shape
        if not s.num_experts:
            return []
        tiles = moe_block_m_tokens(s.experts_per_token, s.num_experts, self.config.max_num_batched_tokens)
        return [tokens for tile, tokens in sorted(tiles.items()) if tile > BLOCK_M]

    def _warm_up_decodes(self) -> list[tuple[int, int]]:
        """(sequences, block-table width) of the warm-up's decode steps. The Triton kernels'
        step-sized integers are not specialised (kernels/*.py), so what still picks a variant
        is the decode merge's split tile: one step for each value the split heuristic can
        choose within max_num_seqs and the widest table (kernels.paged_attention.decode_shapes).
        """
        if self.attention_backend != "triton":
            return [(1, 2)]
        widest = -(-self.max_model_len // self.block_size)
        found = sorted(decode_shapes(*self._decode_layout(), self.config.max_num_seqs, widest).values())
        # Which variants a device reaches follows its SM count, but the ranks of a
        # tensor-parallel group (GPUs of different models, at worst) must run as many steps,
        # each holding collectives: every rank runs one per possible tile, repeating its last.
        return found + found[-1:] * (len(MERGE_PADS) - len(found))

    def _decode_layout(self) -> tuple[int, int, int, torch.dtype, torch.device, int]:
        s = self.shape  # what the decode kernels' split choice reads of this rank's model and cache
        return s.num_heads, s.num_kv_heads, s.head_dim, self.dtype, self.device, self.block_size

    def _use_graphs(self) -> bool:
        # Profiling synchronizes the device at every part, which a capture cannot contain.
        return (
            self.device.type == "cuda"
            and self.attention_backend == "triton"
            and not self.config.enforce_eager
            and not self.config.profile_steps
            # A gloo collective passes through the host, which a capture cannot contain.
            and not (self.group.world_size > 1 and dist_backend(self.config.dist_backend, self.device) == "gloo")
            # Nor do the stages' sends and receives (eager until they are captured too).
            and not self.stage.pipelined
            and self.draft is None  # its steps run both models, eagerly
        )

    def _captured_graphs(self, buckets: Buckets) -> tuple[DecodeGraphs, int]:
        """The decode graphs of `buckets`, and the memory they hold: static inputs, the pool,
        what the workspace grew by. It is reserved for every bucket serving captures, even in
        the profile's trial of the largest alone: a smaller bucket can take more splits."""
        width = -(-self.max_model_len // self.block_size)
        sizes = graph_buckets(self.config.max_num_seqs).sizes
        most = max(decode_workspace(n, *self._decode_layout(), width) for n in sizes)

        def capture() -> DecodeGraphs:
            graphs = DecodeGraphs(
                lambda ids, positions, meta: self.model(ids, positions, self.kv.layers, meta),
                TritonAttentionMetadata,
                buckets,
                width,
                self.block_size,
                self.device,
                lambda _bucket: most,
            )
            graphs.capture()
            return graphs

        return reserved_growth(self.device, capture)

    def _capture_graphs(self) -> DecodeGraphs:
        graphs, held = self._captured_graphs(graph_buckets(self.config.max_num_seqs))
        self.captured_graph_bytes = held
        # Beside what the profile kept back for them (None: the cache was sized otherwise).
        profiled = None if self.graph_pool_bytes is None else round(self.graph_pool_bytes / kv_cache.GIB, 3)
        log.info("cuda_graphs_memory", held_gib=round(held / kv_cache.GIB, 3), profiled_gib=profiled)
        return graphs

    def info(self, model_name: str) -> WorkerInfo:
        return WorkerInfo(
            model_name=model_name,
            vocab_size=self.shape.vocab_size,
            max_model_len=self.max_model_len,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            rank=self.stage.world_rank if self.stage.pipelined else self.group.rank,
            world_size=self.group.world_size * self.stage.num_stages,
            block_size=self.block_size,
            num_gpu_blocks=self.kv.num_blocks,
            num_cpu_blocks=self.kv.num_cpu_blocks,
            block_bytes=kv_cache.bytes_per_block(self.shape, self.block_size, self.dtype, self._layers),
            pipeline_stages=self.stage.num_stages,
            max_loras=self.lora.max_loras if self.lora is not None else 0,
            max_lora_rank=self.config.lora.max_lora_rank if self.config.lora is not None else 0,
            draft_model=self.draft.name if self.draft is not None else "",
        )

    # ---- capacity ----

    def _kv_capacity(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        if cache.kv_cache_gb is not None:
            budget = cache.kv_cache_gb * kv_cache.GIB
        elif not self._profiles_memory():
            budget = host_memory.default_cpu_kv_bytes(host_memory.available_bytes())
        else:
            budget = self._profile_cuda_budget()
        return self._blocks_in(budget)

    def _blocks_in(self, budget: float) -> int:
        """Blocks of the model's cache and, with a draft model, of its cache beside it."""
        draft = self.draft.block_bytes(self.block_size) if self.draft is not None else 0
        return kv_cache.blocks_in(budget, self.shape, self.block_size, self.dtype, self._layers, draft)

    def _swap_capacity(self) -> int:
        """Host blocks for preempted sequences; 0 turns swapping off."""
        cache = self.config.cache
        if cache.num_cpu_blocks is not None:
            return cache.num_cpu_blocks
        if cache.swap_space_gb is not None:
            budget = cache.swap_space_gb * kv_cache.GIB
        else:
            budget = host_memory.default_swap_bytes(self.device.type, host_memory.available_bytes())
        return self._blocks_in(budget)

    def _profiles_memory(self) -> bool:
        return self.device.type == "cuda"

    def _profile_cuda_budget(self) -> float:
        """What is left of gpu_memory_utilization after weights, the peak of the heaviest
        step (worker_svc/step/probe_plans.py) and the decode graphs (_graph_pool_bytes). The
        heaviest step: a full token budget over max_num_seqs sampled rows, and on the torch
        attention path also max_num_seqs rows decoding at the longest context (it gathers
        each row's whole context into new tensors); with adapter slots, every row through
        an adapter (probe_plans.zero_adapter)."""
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        plan, blocks = heaviest_step(tokens, self.config.max_num_seqs, self.block_size, self.shape.vocab_size)
        # Each probe with what to lower when it does not fit.
        probes = [(plan, "--max-num-batched-tokens or --max-num-seqs")]
        if self.attention_backend == "torch":
            widest = widest_decode_step(
                self.config.max_num_seqs, self.max_model_len - 1, self.block_size, self.shape.vocab_size, blocks
            )
            probes.append((widest, "--max-num-seqs or --max-model-len, or use --attention-backend triton"))
        self.kv = KVCache(self.shape, blocks, self.block_size, self.dtype, self.device, layers=self._layers)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        for probe, lower in probes:
            try:
                with zero_adapter(self.lora) if self.lora is not None else nullcontext() as slot:
                    self.execute(probe if slot is None else through_slot(probe, slot))
            except torch.cuda.OutOfMemoryError as error:
                raise RuntimeError(
                    f"a step of {probe.num_seqs} rows and {probe.num_tokens} tokens, contexts up to "
                    f"{int(probe.context_lens.max()) + 1}, does not fit on {self.device} beside the weights: "
                    f"lower {lower}"
                ) from error
        self._last_sampled = {}
        torch.cuda.synchronize(self.device)
        self.profiled_peak_bytes = torch.cuda.max_memory_allocated(self.device) - before  # the step's own
        # Weights and the step, as the allocator reserved them: its segments hold more than the
        # tensors in them (on an H200 at 0.5, 0.8 GiB more at the heaviest step), and the device
        # limit is on what is reserved.
        peak = torch.cuda.max_memory_reserved(self.device) - self.kv.nbytes
        graph_pool = self._graph_pool_bytes() if self._use_graphs() else 0
        del self.kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        budget = kv_budget(total, free, allocated, self.config.cache.gpu_memory_utilization, peak, graph_pool)
        log.info(
            "kv_profiled",
            peak_gib=round(peak / kv_cache.GIB, 3),
            graph_pool_gib=round(graph_pool / kv_cache.GIB, 3),
            budget_gib=round(budget / kv_cache.GIB, 3),
        )
        return budget

    def _graph_pool_bytes(self) -> int:
        """What the decode graphs will hold, from a trial capture of the largest bucket over the
        probe's cache (shapes matter, not the cache's size), released after. Not the peak of
        an eager decode at that bucket: the pool keeps the segments the allocator reserved
        while capturing, which memory_reserved counts and a peak of allocated bytes does not,
        and an eager step would count the LM head and sampling, outside the graphs. Smaller
        buckets reuse the pool, their outputs may come on top: cuda_graphs_memory tells."""
        largest = graph_buckets(self.config.max_num_seqs).largest
        workspace_before = workspace_bytes(self.device)
        try:
            trial, held = self._captured_graphs(Buckets((largest,)))
        except torch.cuda.OutOfMemoryError as error:
            raise RuntimeError(
                f"the CUDA graph of a decode step of {largest} rows does not fit on {self.device} beside the "
                f"weights: lower --max-num-seqs or --max-model-len, or pass --enforce-eager"
            ) from error
        del trial  # with its graph and outputs goes the pool (emptied with the caches next)
        # The workspace it grew stays, reserved: serving's capture will hold all but that again.
        self.graph_pool_bytes = held - (workspace_bytes(self.device) - workspace_before)
        return max(held, 0)
