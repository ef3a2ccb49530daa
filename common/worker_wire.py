"""Both ends of the scheduler-worker protocol (`llmserve.v1.Worker`): the one module that
touches its generated message types.

The scheduler encodes plans and decodes results and the handshake's WorkerInfo; the worker
does the reverse. Each pair sits side by side here so that the two ends cannot drift apart,
and in common/ because both services import it (neither may import the other). The gRPC
health messages the scheduler's worker link polls with are here for the same reason: that
link is the only caller, and it must not reach into the scheduler's API edge.
"""

from __future__ import annotations

import numpy as np
from grpc_health.v1 import health_pb2

from common import token_masks
from common.arrays import pack, unpack
from common.pb.llmserve.v1 import worker_pb2 as worker_pb
from common.plan import AdapterLoad, SamplingBatch, StepPlan, StepResult
from common.worker_info import WorkerInfo

# ---- plans: scheduler -> worker ----


def encode_plan(plan: StepPlan) -> worker_pb.StepPlan:
    s = plan.sampling
    msg = worker_pb.StepPlan(
        step_id=plan.step_id,
        seq_ids=pack(plan.seq_ids, np.int64),
        query_lens=pack(plan.query_lens, np.int32),
        context_lens=pack(plan.context_lens, np.int32),
        input_ids=pack(plan.input_ids, np.int32),
        block_tables=pack(plan.block_tables, np.int32),
        block_table_width=plan.block_tables.shape[1],
        sample=pack(plan.sample, np.uint8),
        sampling=worker_pb.SamplingBatch(
            temperature=pack(s.temperature, np.float32),
            top_p=pack(s.top_p, np.float32),
            top_k=pack(s.top_k, np.int32),
            seed=pack(s.seed, np.int64),
            output_position=pack(s.output_position, np.int32),
            num_logprobs=pack(s.num_logprobs, np.int32),
            min_p=pack(s.min_p, np.float32),
            repetition_penalty=pack(s.repetition_penalty, np.float32),
            presence_penalty=pack(s.presence_penalty, np.float32),
            frequency_penalty=pack(s.frequency_penalty, np.float32),
            bias_offsets=pack(s.bias_offsets, np.int32),
            bias_token_ids=pack(s.bias_token_ids, np.int32),
            bias_values=pack(s.bias_values, np.float32),
            history_offsets=pack(s.history_offsets, np.int32),
            history_token_ids=pack(s.history_token_ids, np.int32),
            prompt_logprobs=pack(s.prompt_logprobs, np.int32),
            prompt_next_token=pack(s.prompt_next_token, np.int32),
            mask_rows=pack(s.mask_rows, np.int32),
        ),
        swap_out=pack(plan.swap_out, np.int32),
        swap_in=pack(plan.swap_in, np.int32),
        copy=pack(plan.copy, np.int32),
        adapter_loads=[
            worker_pb.AdapterLoad(slot=a.slot, name=a.name, path=a.path, version=a.version) for a in plan.adapter_loads
        ],
        lora_slots=pack(plan.lora_slots, np.int32),
    )
    if s.token_masks.size:
        _encode_masks(msg.sampling, s.token_masks)
    return msg


def _encode_masks(sampling: worker_pb.SamplingBatch, masks: np.ndarray) -> None:
    """Narrow rows as their allowed ids, the others as words (common/token_masks.py)."""
    parts = token_masks.split(masks)
    sampling.token_masks = pack(parts.dense, np.int32)
    sampling.token_mask_words = masks.shape[1]
    sampling.mask_sparse = pack(parts.sparse, np.uint8)
    sampling.mask_id_offsets = pack(parts.offsets, np.int32)
    sampling.mask_token_ids = pack(parts.ids, np.int32)


def decode_plan(msg: worker_pb.StepPlan) -> StepPlan:
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
            token_masks=_decode_masks(s),
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


def _decode_masks(s: worker_pb.SamplingBatch) -> np.ndarray:
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


# ---- results: worker -> scheduler ----


def encode_result(result: StepResult) -> worker_pb.StepResult:
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


def decode_result(msg: worker_pb.StepResult, num_seqs: int) -> StepResult:
    width = msg.top_width
    return StepResult(
        step_id=msg.step_id,
        sampled_token_ids=unpack(msg.sampled_token_ids, np.int32, "sampled_token_ids", num_seqs),
        execute_seconds=msg.execute_seconds,
        # Empty when no sequence sampled.
        logprobs=unpack(msg.logprobs, np.float32, "logprobs", num_seqs if msg.logprobs else 0),
        top_token_ids=unpack(msg.top_token_ids, np.int32, "top_token_ids", num_seqs * width).reshape(num_seqs, width),
        top_logprobs=unpack(msg.top_logprobs, np.float32, "top_logprobs", num_seqs * width).reshape(num_seqs, width),
        part_seconds=dict(msg.part_seconds),
        **_decode_prompt_logprobs(msg, num_seqs),
    )


def _decode_prompt_logprobs(msg: worker_pb.StepResult, num_seqs: int) -> dict[str, np.ndarray]:
    if not msg.prompt_offsets:
        return {}
    offsets = unpack(msg.prompt_offsets, np.int32, "prompt_offsets", num_seqs + 1)
    entries, width = int(offsets[-1]), msg.prompt_top_width
    return {
        "prompt_offsets": offsets,
        "prompt_logprobs": unpack(msg.prompt_logprobs, np.float32, "prompt_logprobs", entries),
        "prompt_top_token_ids": unpack(
            msg.prompt_top_token_ids, np.int32, "prompt_top_token_ids", entries * width
        ).reshape(entries, width),
        "prompt_top_logprobs": unpack(
            msg.prompt_top_logprobs, np.float32, "prompt_top_logprobs", entries * width
        ).reshape(entries, width),
    }


# ---- the handshake and the link's health ----


def describe_request() -> worker_pb.DescribeRequest:
    return worker_pb.DescribeRequest()


def encode_worker_info(info: WorkerInfo) -> worker_pb.WorkerInfo:
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


def decode_worker_info(msg: worker_pb.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        model_name=msg.model_name,
        vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len,
        dtype=msg.dtype,
        device=msg.device,
        rank=msg.rank,
        world_size=msg.world_size,
        block_size=msg.block_size,
        num_gpu_blocks=msg.num_gpu_blocks,
        num_cpu_blocks=msg.num_cpu_blocks,
        block_bytes=msg.block_bytes,
        max_loras=msg.max_loras,
        max_lora_rank=msg.max_lora_rank,
    )


def health_check_request() -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service="")


def is_serving(reply: health_pb2.HealthCheckResponse) -> bool:
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
