"""The worker service's protobuf edge: the only module that touches generated message types."""

from __future__ import annotations

import numpy as np

from common import token_masks
from common.arrays import pack, unpack
from common.pb.llmserve.v1 import worker_pb2 as worker_pb
from common.plan import AdapterLoad, SamplingBatch, StepPlan, StepResult
from common.worker_info import WorkerInfo


def step_plan(msg: worker_pb.StepPlan) -> StepPlan:
    """Decode a plan; malformed byte lengths raise ValueError naming the field."""
    seq_ids = unpack(msg.seq_ids, np.int64, "seq_ids")
    n = seq_ids.shape[0]
    width = msg.block_table_width
    tables = unpack(msg.block_tables, np.int32, "block_tables", n * width)
    s = msg.sampling
    return StepPlan(
        step_id=msg.step_id,
        seq_ids=seq_ids,
        query_lens=unpack(msg.query_lens, np.int32, "query_lens", n),
        context_lens=unpack(msg.context_lens, np.int32, "context_lens", n),
        input_ids=unpack(msg.input_ids, np.int32, "input_ids"),
        block_tables=tables.reshape(n, width),
        sample=unpack(msg.sample, np.uint8, "sample", n),
        sampling=SamplingBatch(
            temperature=unpack(s.temperature, np.float32, "sampling.temperature", n),
            top_p=unpack(s.top_p, np.float32, "sampling.top_p", n),
            top_k=unpack(s.top_k, np.int32, "sampling.top_k", n),
            seed=unpack(s.seed, np.int64, "sampling.seed", n),
            output_position=unpack(s.output_position, np.int32, "sampling.output_position", n),
            # Empty means 0 for every sequence: a scheduler that never asks sends nothing.
            num_logprobs=_optional(s.num_logprobs, np.int32, "sampling.num_logprobs", n),
            min_p=_optional(s.min_p, np.float32, "sampling.min_p", n),
            repetition_penalty=_optional(s.repetition_penalty, np.float32, "sampling.repetition_penalty", n),
            presence_penalty=_optional(s.presence_penalty, np.float32, "sampling.presence_penalty", n),
            frequency_penalty=_optional(s.frequency_penalty, np.float32, "sampling.frequency_penalty", n),
            bias_offsets=_optional(s.bias_offsets, np.int32, "sampling.bias_offsets", n + 1),
            bias_token_ids=unpack(s.bias_token_ids, np.int32, "sampling.bias_token_ids"),
            bias_values=unpack(s.bias_values, np.float32, "sampling.bias_values"),
            history_offsets=_optional(s.history_offsets, np.int32, "sampling.history_offsets", n + 1),
            history_token_ids=unpack(s.history_token_ids, np.int32, "sampling.history_token_ids"),
            prompt_logprobs=_optional(s.prompt_logprobs, np.int32, "sampling.prompt_logprobs", n),
            prompt_next_token=_optional(s.prompt_next_token, np.int32, "sampling.prompt_next_token", n),
            mask_rows=_optional(s.mask_rows, np.int32, "sampling.mask_rows", n),
            token_masks=_masks(s),
        ),
        swap_out=_pairs(msg.swap_out, "swap_out"),
        swap_in=_pairs(msg.swap_in, "swap_in"),
        copy=_pairs(msg.copy, "copy"),
        adapter_loads=tuple(AdapterLoad(a.slot, a.name, a.path, a.version) for a in msg.adapter_loads),
        lora_slots=_optional(msg.lora_slots, np.int32, "lora_slots", n),
    )


def _optional(data: bytes, dtype: type, field: str, count: int) -> np.ndarray:
    """A per-sequence array that may be absent: empty means the default for every sequence,
    so a scheduler that never uses a feature sends nothing for it."""
    return unpack(data, dtype, field, count if data else 0)


def _masks(s: worker_pb.SamplingBatch) -> np.ndarray:
    words = s.token_mask_words
    dense = unpack(s.token_masks, np.int32, "sampling.token_masks")
    if dense.size and (not words or dense.size % words):
        raise ValueError(f"sampling.token_masks: {dense.size} words is not a whole number of rows of {words}")
    dense = dense.reshape(-1, words) if dense.size else np.zeros((0, words), np.int32)
    if not s.mask_sparse:
        return dense
    parts = token_masks.SplitMasks(
        unpack(s.mask_sparse, np.uint8, "sampling.mask_sparse"),
        dense,
        unpack(s.mask_id_offsets, np.int32, "sampling.mask_id_offsets"),
        unpack(s.mask_token_ids, np.int32, "sampling.mask_token_ids"),
    )
    token_masks.check(parts, words)
    return token_masks.join(parts, words)


def _pairs(data: bytes, field: str) -> np.ndarray:
    """int32 [k, 2] (src, dst) block pairs."""
    flat = unpack(data, np.int32, field)
    if flat.shape[0] % 2:
        raise ValueError(f"{field}: {flat.shape[0]} values is not a whole number of (src, dst) pairs")
    return flat.reshape(-1, 2)


def step_result(result: StepResult) -> worker_pb.StepResult:
    return worker_pb.StepResult(
        step_id=result.step_id,
        sampled_token_ids=pack(result.sampled_token_ids, np.int32),
        execute_seconds=result.execute_seconds,
        logprobs=pack(result.logprobs, np.float32),
        top_token_ids=pack(result.top_token_ids, np.int32),
        top_logprobs=pack(result.top_logprobs, np.float32),
        top_width=result.top_token_ids.shape[1],
        prompt_offsets=pack(result.prompt_offsets, np.int32),
        prompt_logprobs=pack(result.prompt_logprobs, np.float32),
        prompt_top_token_ids=pack(result.prompt_top_token_ids, np.int32),
        prompt_top_logprobs=pack(result.prompt_top_logprobs, np.float32),
        prompt_top_width=result.prompt_top_token_ids.shape[1],
        part_seconds=result.part_seconds,
    )


def worker_info(info: WorkerInfo) -> worker_pb.WorkerInfo:
    return worker_pb.WorkerInfo(
        model_name=info.model_name,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        dtype=info.dtype,
        device=info.device,
        rank=info.rank,
        world_size=info.world_size,
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
        block_bytes=info.block_bytes,
        max_loras=info.max_loras,
        max_lora_rank=info.max_lora_rank,
    )
