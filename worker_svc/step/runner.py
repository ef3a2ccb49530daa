"""One step on the worker: plan arrays -> input tensors -> forward -> sampled tokens.

The runner keeps no per-request state between steps: everything it needs comes in the plan,
and its memory is the weights and the KV-cache tensors, plus the tokens its last step
sampled, which a plan the scheduler made before that step's result arrived refers to
(DEFERRED_INPUT in common/plan.py).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import structlog
import torch

from common.config import WorkerConfig
from common.plan import DEFERRED_INPUT, AdapterLoad, SamplingBatch, StepPlan, StepResult
from common.worker_info import WorkerInfo
from kernels.limits import max_tokens_per_step
from kernels.paged_attention import MERGE_PADS, decode_shapes
from worker_svc.device.host_copy import to_device, to_host
from worker_svc.device.parallel import SINGLE, ParallelGroup, bind_device
from worker_svc.layers.replicated import cpu_kernels_for
from worker_svc.layers.triton_attention import TritonAttentionMetadata
from worker_svc.lora.adapter_cache import HostAdapter
from worker_svc.lora.lora_slots import LoraSlots
from worker_svc.sampling.logits_processor import process_logits, processed_rows
from worker_svc.sampling.logprobs import logits_stats, logprob_arrays, logprob_tensors, prompt_logprobs
from worker_svc.sampling.sampler import sample
from worker_svc.step import host_memory, kv_cache
from worker_svc.step.cuda_graphs import DecodeGraphs, fits, stage
from worker_svc.step.host_allocator import keep_freed_memory
from worker_svc.step.kv_cache import KVCache
from worker_svc.step.loader import (
    head_dim_of,
    load_config,
    load_model,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from worker_svc.step.probe_plans import decode_step, heaviest_step, widest_decode_step, with_open_masks
from worker_svc.step.step_buckets import gemm_buckets, graph_buckets, pad_rows
from worker_svc.step.step_profile import StepProfile

log = structlog.get_logger(__name__)


def triton_token_limit(hf_config: Any) -> int:
    """kernels.limits.max_tokens_per_step for a checkpoint's whole shape (a rank's share
    only raises the limit, so the whole model's is safe for every tensor-parallel size)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(text.num_attention_heads)
    return max_tokens_per_step(
        hidden_size=int(text.hidden_size),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim_of(hf_config),
        intermediate_size=int(text.intermediate_size),
    )


class PlanError(ValueError):
    """A plan that would read or write outside this worker's cache or model."""


class ModelRunner:
    """`group`: the tensor-parallel group this runner is a rank of; every rank must run the
    same plans in the same order (the forward holds collectives)."""

    def __init__(self, config: WorkerConfig, group: ParallelGroup = SINGLE) -> None:
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
        self.model = load_model(
            config.model, self.dtype, self.device, attention_backend=self.attention_backend, group=group
        )
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
        # oneDNN builds a GEMM per row count: keep the CPU kernels' counts to a few buckets.
        self._gemm_buckets = gemm_buckets(config.max_num_batched_tokens) if self.attention_backend == "cpu" else None
        self.shape = self.model.shape
        self.max_model_len = self.shape.max_position_embeddings
        self.block_size = config.cache.block_size
        self._graphs: DecodeGraphs | None = None  # eager until captured, below (profiling runs steps)
        self.profiled_peak_bytes: int | None = None  # the heaviest step's, when CUDA memory was profiled
        num_blocks = self._kv_capacity()
        self.kv = KVCache(self.shape, num_blocks, self.block_size, self.dtype, self.device, self._swap_capacity())
        log.info(
            "kv_cache_allocated",
            num_blocks=num_blocks,
            block_size=self.block_size,
            tokens=num_blocks * self.block_size,
            gib=round(self.kv.nbytes / kv_cache.GIB, 3),
        )
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

    def _warms_up(self) -> bool:
        # Triton compiles a kernel on its first launch (seconds): on CUDA that happens here,
        # not in the first requests' steps.
        return self.device.type == "cuda"

    def _warm_up(self) -> None:
        """A prompt step, then a decode step for each compiled variant of the decode kernels a
        step can pick (_warm_up_decodes), in blocks 0-1, before any sequence owns them."""
        if self.kv.num_blocks < 2:
            return
        context = self.block_size + self.block_size // 2
        prompt, _ = heaviest_step(context, 1, self.block_size, self.shape.vocab_size)
        shapes = self._warm_up_decodes()
        decodes = [decode_step(self.block_size, self.shape.vocab_size, n, w) for n, w in shapes]
        decodes[0] = with_open_masks(decodes[0], self.shape.vocab_size)
        for plan in (prompt, *decodes):
            self.execute(plan)
        self._last_sampled = {}
        log.info("worker_warmed_up", steps=("prompt", *(f"decode {n}x{w}" for n, w in shapes)))

    def _warm_up_decodes(self) -> list[tuple[int, int]]:
        """(sequences, block-table width) of the warm-up's decode steps. The Triton kernels'
        step-sized integers are not specialised (kernels/*.py), so what still picks a variant
        is the decode merge's split tile: one step for each value the split heuristic can
        choose within max_num_seqs and the widest table (kernels.paged_attention.decode_shapes).
        """
        if self.attention_backend != "triton":
            return [(1, 2)]
        s = self.shape
        widest = -(-self.max_model_len // self.block_size)
        shapes = decode_shapes(
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            self.dtype,
            self.device,
            self.block_size,
            self.config.max_num_seqs,
            widest,
        )
        found = sorted(shapes.values())
        # Which variants a device reaches follows its SM count, but the ranks of a
        # tensor-parallel group (GPUs of different models, at worst) must run as many steps,
        # each holding collectives: every rank runs one per possible tile, repeating its last.
        return found + found[-1:] * (len(MERGE_PADS) - len(found))

    def _use_graphs(self) -> bool:
        # Profiling synchronizes the device at every part, which a capture cannot contain.
        return (
            self.device.type == "cuda"
            and self.attention_backend == "triton"
            and not self.config.enforce_eager
            and not self.config.profile_steps
        )

    def _capture_graphs(self) -> DecodeGraphs:
        graphs = DecodeGraphs(
            lambda ids, positions, meta: self.model(ids, positions, self.kv.layers, meta),
            TritonAttentionMetadata,
            graph_buckets(self.config.max_num_seqs),
            -(-self.max_model_len // self.block_size),
            self.block_size,
            self.device,
        )
        graphs.capture()
        return graphs

    def info(self, model_name: str) -> WorkerInfo:
        return WorkerInfo(
            model_name=model_name,
            vocab_size=self.shape.vocab_size,
            max_model_len=self.max_model_len,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            rank=self.group.rank,
            world_size=self.group.world_size,
            block_size=self.block_size,
            num_gpu_blocks=self.kv.num_blocks,
            num_cpu_blocks=self.kv.num_cpu_blocks,
            block_bytes=kv_cache.bytes_per_block(self.shape, self.block_size, self.dtype),
            max_loras=self.lora.max_loras if self.lora is not None else 0,
            max_lora_rank=self.config.lora.max_lora_rank if self.config.lora is not None else 0,
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
        return kv_cache.blocks_in(budget, self.shape, self.block_size, self.dtype)

    def _swap_capacity(self) -> int:
        """Host blocks for preempted sequences; 0 turns swapping off."""
        cache = self.config.cache
        if cache.num_cpu_blocks is not None:
            return cache.num_cpu_blocks
        if cache.swap_space_gb is not None:
            budget = cache.swap_space_gb * kv_cache.GIB
        else:
            budget = host_memory.default_swap_bytes(self.device.type, host_memory.available_bytes())
        return kv_cache.blocks_in(budget, self.shape, self.block_size, self.dtype)

    def _profiles_memory(self) -> bool:
        return self.device.type == "cuda"

    def _profile_cuda_budget(self) -> float:
        """What is left of gpu_memory_utilization after weights and the peak of the heaviest
        step (worker_svc/step/probe_plans.py): a full token budget over max_num_seqs sampled rows,
        and on the torch attention path also max_num_seqs rows decoding at the longest context
        (it gathers each row's whole context into new tensors)."""
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        plan, blocks = heaviest_step(tokens, self.config.max_num_seqs, self.block_size, self.shape.vocab_size)
        # Each probe with what to lower when it does not fit.
        probes = [(plan, "--max-num-batched-tokens or --max-num-seqs")]
        if self.attention_backend == "torch":
            widest = widest_decode_step(
                self.config.max_num_seqs, self.max_model_len - 1, self.block_size, self.shape.vocab_size, blocks
            )
            probes.append((widest, "--max-num-seqs or --max-model-len, or use --attention-backend triton"))
        self.kv = KVCache(self.shape, blocks, self.block_size, self.dtype, self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        for probe, lower in probes:
            try:
                self.execute(probe)
            except torch.cuda.OutOfMemoryError as error:
                raise RuntimeError(
                    f"a step of {probe.num_seqs} rows and {probe.num_tokens} tokens, contexts up to "
                    f"{int(probe.context_lens.max()) + 1}, does not fit on {self.device} beside the weights: "
                    f"lower {lower}"
                ) from error
        self._last_sampled = {}
        torch.cuda.synchronize(self.device)
        self.profiled_peak_bytes = torch.cuda.max_memory_allocated(self.device) - before  # the step's own
        peak = torch.cuda.max_memory_allocated(self.device) - self.kv.nbytes  # weights and the step
        del self.kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use_elsewhere = total - free - torch.cuda.memory_allocated(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - in_use_elsewhere - peak
        log.info("kv_profiled", peak_gib=round(peak / kv_cache.GIB, 3), budget_gib=round(budget / kv_cache.GIB, 3))
        return max(budget, 0.0)

    # ---- one step ----

    def check(self, plan: StepPlan) -> None:
        try:
            plan.validate()
        except ValueError as error:
            raise PlanError(str(error)) from error
        self._check_block_ops(plan)
        if plan.num_seqs == 0:
            return
        if self.step_token_limit is not None and plan.num_tokens > self.step_token_limit:
            raise PlanError(
                f"{plan.num_tokens} tokens in one step, above the kernels' limit of {self.step_token_limit}"
            )
        bt, bs = plan.block_tables, self.block_size
        ends = plan.context_lens.astype(np.int64) + plan.query_lens
        if int(plan.context_lens.min()) < 0 or int(ends.max()) > self.max_model_len:
            raise PlanError(f"positions outside the model's context of {self.max_model_len}")
        needed = -(-ends // bs)  # blocks each sequence uses after this step
        if int(needed.max()) > bt.shape[1]:
            raise PlanError("block tables too narrow for the sequences' lengths")
        used = bt[np.arange(bt.shape[1])[None, :] < needed[:, None]]  # every entry a token lives in
        if used.size and (int(used.min()) < 0 or int(used.max()) >= self.kv.num_blocks):
            raise PlanError(f"block id outside the cache of {self.kv.num_blocks} blocks")
        vocab = self.shape.vocab_size
        for name, ids in (
            ("input_ids", plan.input_ids),
            ("sampling.bias_token_ids", plan.sampling.bias_token_ids),
            ("sampling.history_token_ids", plan.sampling.history_token_ids),
        ):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise PlanError(f"{name}: token id outside the vocabulary of {vocab}")
        nxt = plan.sampling.prompt_next_token
        if nxt.size and (int(nxt.min()) < -1 or int(nxt.max()) >= vocab):
            raise PlanError("sampling.prompt_next_token outside the vocabulary")
        plp = plan.sampling.prompt_logprobs
        if plp.size and int(plp.max()) > vocab:
            raise PlanError(f"sampling.prompt_logprobs above the vocabulary of {vocab}")
        rep = plan.sampling.repetition_penalty
        if rep.size and not bool((rep > 0).all()):
            raise PlanError("sampling.repetition_penalty must be positive")
        asked = plan.sampling.num_logprobs
        if asked.size and (int(asked.min()) < 0 or int(asked.max()) > self.shape.vocab_size):
            raise PlanError(f"num_logprobs outside [0, {self.shape.vocab_size}]")
        self._check_lora(plan)

    def _check_lora(self, plan: StepPlan) -> None:
        if self.lora is None:
            if plan.adapter_loads or (plan.lora_slots.size and int(plan.lora_slots.max()) >= 0):
                raise PlanError("a plan with LoRA adapters, and this worker has no adapter slots (--enable-lora)")
            return
        try:
            self.lora.check(plan.lora_slots, plan.adapter_loads)
        except ValueError as error:
            raise PlanError(str(error)) from error

    def _prepare_adapters(self, plan: StepPlan) -> list[tuple[AdapterLoad, HostAdapter]]:
        """The plan's adapter loads read and checked against the model before anything of this
        worker changes: a bad adapter refuses the plan with the cache and the slots untouched."""
        if self.lora is None or not plan.adapter_loads:
            return []
        try:
            return self.lora.prepare(plan.adapter_loads)
        except ValueError as error:
            raise PlanError(str(error)) from error

    def _check_block_ops(self, plan: StepPlan) -> None:
        """Every (src, dst) id inside its pool, and no block written twice (the result would
        depend on the order of the scatter)."""
        device, host = ("device", self.kv.num_blocks), ("host", self.kv.num_cpu_blocks)
        for name, pools in (("swap_out", (device, host)), ("swap_in", (host, device)), ("copy", (device, device))):
            ops = getattr(plan, name)
            if not len(ops):
                continue
            for column, role, (pool, size) in zip(ops.T, ("source", "destination"), pools):
                if int(column.min()) < 0 or int(column.max()) >= size:
                    raise PlanError(f"{name} {role} block outside the {pool} pool of {size} blocks")
            if np.unique(ops[:, 1]).size != len(ops):
                raise PlanError(f"{name} writes a {pools[1][0]} block twice")

    def _inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, Any, np.ndarray]:
        """(input ids, positions, attention metadata) of the forward pass, and query start
        offsets [seqs + 1]. On the CPU kernels the rows are padded to a GEMM bucket
        (worker_svc/step/step_buckets.py); the forward pass then returns that many rows."""
        n, q, c, bs = plan.num_seqs, plan.query_lens, plan.context_lens, self.block_size
        starts = self.model.attention.query_starts(q).astype(np.int64)
        # token t of sequence i sits at position c[i] + (t - starts[i])
        seq_of_token = np.repeat(np.arange(n), q)
        positions = np.arange(plan.num_tokens) + np.repeat(c - starts[:-1], q)
        slots = plan.block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        input_ids = plan.input_ids.astype(np.int64)
        adapters = np.repeat(plan.lora_slots, q) if plan.lora_slots.size else None  # a slot per token
        if self._gemm_buckets is not None:
            rows = self._gemm_buckets.pad(plan.num_tokens)
            input_ids, positions, slots = (
                pad_rows(input_ids, rows, 0),
                pad_rows(positions, rows, 0),
                pad_rows(slots, rows, -1),
            )
            if adapters is not None:
                adapters = pad_rows(adapters, rows, -1)
        if self.lora is not None:
            self.lora.begin_step(adapters)
        meta = self.model.attention.build_metadata(q, c, plan.block_tables, slots, bs, self.device)
        return to_device(input_ids, self.device), to_device(positions, self.device), meta, starts

    def _section(self, part: str) -> AbstractContextManager[None]:
        return self._profile.section(part) if self._profile is not None else nullcontext()

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits of every fed token (tests compare them with the reference)."""
        self.check(plan)
        adapters = self._prepare_adapters(plan)
        if adapters and self.lora is not None:
            self.lora.apply(adapters)
        input_ids, positions, meta, _ = self._inputs(plan)
        return self.model.compute_logits(self.model(input_ids, positions, self.kv.layers, meta)[: plan.num_tokens])

    def _fill_deferred(self, plan: StepPlan) -> StepPlan:
        """The plan with each DEFERRED_INPUT replaced by the token this worker sampled for that
        sequence in its previous step (the scheduler planned this step before knowing it)."""
        where = np.flatnonzero(plan.input_ids == DEFERRED_INPUT)
        if not where.size:
            return plan
        try:
            plan.validate()  # the offsets below assume consistent arrays
        except ValueError as error:
            raise PlanError(str(error)) from error
        ends = np.cumsum(plan.query_lens)
        rows = np.searchsorted(ends, where, side="right")  # the sequence of each deferred token
        if not np.array_equal(ends[rows] - 1, where):
            raise PlanError("a deferred input that is not its sequence's last fed token")
        input_ids = plan.input_ids.copy()
        for token_index, seq_id in zip(where.tolist(), plan.seq_ids[rows].tolist()):
            token = self._last_sampled.get(seq_id)
            if token is None:
                raise PlanError(
                    f"a deferred input for sequence {seq_id}, which this worker's previous step did not sample"
                )
            input_ids[token_index] = token
        return dataclasses.replace(plan, input_ids=input_ids)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        with self._section("prepare"):
            plan = self._fill_deferred(plan)
            self.check(plan)
            adapters = self._prepare_adapters(plan)
            # The plan's order (common.plan.StepPlan): copies come last because their source
            # may be a block swapped in this step.
            self.kv.swap_out(plan.swap_out)
            self.kv.swap_in(plan.swap_in)
            self.kv.copy(plan.copy)
            if adapters and self.lora is not None:
                self.lora.apply(adapters)
            sampled = np.full(plan.num_seqs, -1, dtype=np.int32)
            graphs = self._graphs
            # A step with adapted rows runs eagerly: the graphs were captured without LoRA.
            adapted = bool(plan.lora_slots.size) and int(plan.lora_slots.max()) >= 0
            bucket = fits(plan, graphs.buckets, graphs.width) if graphs is not None and not adapted else None
            if bucket is not None:  # a decode step a captured graph replays
                staged = stage(plan, bucket, graphs.width, self.block_size)  # type: ignore[union-attr]
                starts = np.arange(plan.num_seqs + 1)
            elif plan.num_seqs:
                input_ids, positions, meta, starts = self._inputs(plan)
        if plan.num_seqs == 0:
            self._last_sampled = {}
            return StepResult(plan.step_id, sampled, time.perf_counter() - start, part_seconds=self._parts())
        with self._section("forward"):
            if bucket is not None:
                hidden = graphs.run(staged)  # type: ignore[union-attr]
            else:
                hidden = self.model(input_ids, positions, self.kv.layers, meta)
        rows = np.flatnonzero(plan.sample)  # no rows: every tensor below is empty, nothing breaks
        dev = self.device
        last = starts[1:][rows] - 1
        if self._gemm_buckets is not None:
            last = pad_rows(last, self._gemm_buckets.pad(rows.size), 0)
        # [len(rows), vocab]
        logits = self.model.compute_logits(hidden.index_select(0, to_device(last, dev)), upcast=False)[: rows.size]
        with self._section("sampling"):
            s = plan.sampling
            tokens, lse = self._sample(logits, s, rows)
            chosen, top_values, top_indices = logprob_tensors(logits, lse, tokens, rows, s.num_logprobs)
            host = to_host(tokens, chosen, top_values, top_indices)  # the step's only wait for the device
            sampled[rows] = host[0]
            self._last_sampled = dict(zip(plan.seq_ids[rows].tolist(), sampled[rows].tolist()))
            logprobs, top_ids, top_lps = logprob_arrays(host[1], host[2], host[3], rows, s.num_logprobs, plan.num_seqs)
        prompt: dict[str, np.ndarray] = {}
        if s.prompt_logprobs.size and int(s.prompt_logprobs.max()) >= 0:
            fields = ("prompt_offsets", "prompt_logprobs", "prompt_top_token_ids", "prompt_top_logprobs")
            values = prompt_logprobs(
                self.model.compute_logits, hidden, starts, plan.input_ids, s.prompt_logprobs, s.prompt_next_token
            )
            prompt = dict(zip(fields, values))
        return StepResult(
            plan.step_id,
            sampled,
            time.perf_counter() - start,
            logprobs,
            top_ids,
            top_lps,
            part_seconds=self._parts(),
            **prompt,
        )

    def _sample(self, logits: torch.Tensor, s: SamplingBatch, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, logsumexp) of the sampled rows' raw logits [len(rows), vocab]."""
        argmax, lse = logits_stats(logits, self._cpu_kernels)
        # Rows whose token is not simply the argmax of the raw logits: drawn at random, or
        # with logit processing (bias, min_tokens bans, penalties, a structured output's
        # mask). Only they go to float32.
        slow = np.flatnonzero((s.temperature[rows] > 0) | processed_rows(s, rows)) if rows.size else rows
        if not slow.size:
            return argmax, lse
        sub = rows[slow]
        dev = logits.device
        index = to_device(slow, dev)

        processed = process_logits(logits.index_select(0, index).float(), s, sub)
        min_p = s.min_p[sub] if s.min_p.size else None
        drawn = sample(
            processed, s.temperature[sub], s.top_p[sub], s.top_k[sub], s.seed[sub], s.output_position[sub], min_p
        )
        return argmax.index_copy(0, index, drawn), lse

    def _parts(self) -> dict[str, float]:
        return self._profile.take() if self._profile is not None else {}
