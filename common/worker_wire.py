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
from common.block_tables import BlockTables
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
        block_ids=pack(plan.block_tables.ids, np.int32),
        block_offsets=pack(plan.block_tables.offsets, np.int32),
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
        draft_lens=pack(plan.draft_lens, np.int32),
        propose_lens=pack(plan.propose_lens, np.int32),
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


def decode_plan(msg: worker_pb.StepPlan, max_seqs: int | None = None, vocab_size: int | None = None) -> StepPlan:
    """Decode a plan; malformed byte lengths raise ValueError naming the field.

    A worker passes its bounds, so that sizes no scheduler sends are refused before anything is
    built from them: `max_seqs` sequences (its KV blocks: every sequence of a step writes into a
    block of its own), and mask rows of at most ceil(`vocab_size` / 32) words, one per sequence
    at most (a sparse row costs a byte on the wire and a whole row once joined).
    """
    seq_ids = unpack(msg.seq_ids, np.int64, "seq_ids")
    n = seq_ids.shape[0]
    if max_seqs is not None and n > max_seqs:
        raise ValueError(f"seq_ids: {n} sequences in one step, more than this worker's {max_seqs} KV blocks")
    tables = BlockTables(
        unpack(msg.block_offsets, np.int32, "block_offsets", n + 1), unpack(msg.block_ids, np.int32, "block_ids")
    )
    s = msg.sampling
    return StepPlan(
        step_id=msg.step_id,
        seq_ids=seq_ids,
        query_lens=unpack(msg.query_lens, np.int32, "query_lens", n),
        context_lens=unpack(msg.context_lens, np.int32, "context_lens", n),
        input_ids=unpack(msg.input_ids, np.int32, "input_ids"),
        block_tables=tables,
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
            # At most a mask per fed position (a row verifying d drafts has d + 1).
            token_masks=_decode_masks(s, max(n, len(msg.input_ids) // 4), vocab_size),
        ),
        swap_out=_pairs(msg.swap_out, "swap_out"),
        swap_in=_pairs(msg.swap_in, "swap_in"),
        copy=_pairs(msg.copy, "copy"),
        adapter_loads=tuple(AdapterLoad(a.slot, a.name, a.path, a.version) for a in msg.adapter_loads),
        lora_slots=_optional(msg.lora_slots, np.int32, "lora_slots", n),
        draft_lens=_optional(msg.draft_lens, np.int32, "draft_lens", n),
        propose_lens=_optional(msg.propose_lens, np.int32, "propose_lens", n),
    )


def _optional(data: bytes, dtype: type, field: str, count: int) -> np.ndarray:
    """A per-sequence array that may be absent: empty means the default for every sequence,
    so a scheduler that never uses a feature sends nothing for it."""
    return unpack(data, dtype, field, count if data else 0)


def _decode_masks(s: worker_pb.SamplingBatch, most: int, vocab_size: int | None) -> np.ndarray:
    words = s.token_mask_words
    if vocab_size is not None and words > -(-vocab_size // 32):
        raise ValueError(
            f"sampling.token_mask_words: {words} words a row, a vocabulary of {vocab_size} needs {-(-vocab_size // 32)}"
        )
    dense = unpack(s.token_masks, np.int32, "sampling.token_masks")
    if dense.size and (not words or dense.size % words):
        raise ValueError(f"sampling.token_masks: {dense.size} words is not a whole number of rows of {words}")
    dense = dense.reshape(-1, words) if dense.size else np.zeros((0, words), np.int32)
    rows = len(s.mask_sparse) if s.mask_sparse else dense.shape[0]  # mask_sparse has a byte for every row
    if rows > most:
        raise ValueError(f"sampling.token_masks: {rows} mask rows, more than the plan's {most} positions")
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
        num_accepted=pack(result.num_accepted, np.int32),
        draft_logprobs=pack(result.draft_logprobs, np.float32),
        draft_proposals=pack(result.draft_proposals, np.int32),
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
        num_accepted=_optional(msg.num_accepted, np.int32, "num_accepted", num_seqs),
        draft_logprobs=unpack(msg.draft_logprobs, np.float32, "draft_logprobs"),
        draft_proposals=unpack(msg.draft_proposals, np.int32, "draft_proposals"),
        **_decode_prompt_logprobs(msg, num_seqs),
    )


def check_result(plan: StepPlan, result: StepResult, vocab_size: int) -> None:
    """Refuse (ValueError) a decoded result that `plan` could not have produced: a token outside
    the vocabulary, a token for a row that samples nothing, or more alternatives or prompt
    scores than the plan asked for. The scheduler trusts nothing else a worker sends: what
    passes here is indexed, appended to sequences and streamed to clients as it is."""
    s = plan.sampling
    sampled = plan.sample.astype(bool)
    tokens = result.sampled_token_ids
    picked = tokens[sampled]
    if picked.size and (int(picked.min()) < 0 or int(picked.max()) >= vocab_size):
        raise ValueError(f"sampled_token_ids: a token outside the vocabulary of {vocab_size}")
    if (tokens[~sampled] != -1).any():
        raise ValueError("sampled_token_ids: a token for a sequence that samples nothing this step")
    asked = s.num_logprobs[sampled] if s.num_logprobs.size else np.zeros(0, np.int32)
    width = int(asked.max()) if asked.size else 0
    if result.top_token_ids.shape[1] != width:
        raise ValueError(f"top_width: {result.top_token_ids.shape[1]} alternatives a row, the plan asked for {width}")
    _check_ids("top_token_ids", result.top_token_ids, vocab_size)
    _check_drafts(plan, result)
    _check_proposals(plan, result, vocab_size)
    wanted = s.prompt_logprobs
    if not (wanted.size and plan.num_seqs and int(wanted.max()) >= 0):
        if result.prompt_offsets.size:
            raise ValueError("prompt_offsets: prompt log-probabilities the plan did not ask for")
        return
    # Every fed position of an asking row scores the next prompt token, the last one only
    # when the plan names it (common/plan.py, worker_svc/sampling/logprobs.py).
    nxt = s.prompt_next_token if s.prompt_next_token.size else np.full(plan.num_seqs, -1, np.int32)
    counts = np.where(wanted >= 0, plan.query_lens - 1 + (nxt >= 0), 0)
    offsets = result.prompt_offsets
    if offsets.shape != (plan.num_seqs + 1,) or offsets[0] != 0 or not np.array_equal(np.diff(offsets), counts):
        raise ValueError("prompt_offsets: not the prompt positions the plan asked to score")
    if result.prompt_top_token_ids.shape[1] != int(wanted.max()):
        raise ValueError(
            f"prompt_top_width: {result.prompt_top_token_ids.shape[1]} alternatives, the plan asked for {int(wanted.max())}"
        )
    _check_ids("prompt_top_token_ids", result.prompt_top_token_ids, vocab_size)


def _check_drafts(plan: StepPlan, result: StepResult) -> None:
    drafts = plan.draft_lens
    if not (drafts.size and int(drafts.max()) > 0):
        if result.num_accepted.size or result.draft_logprobs.size:
            raise ValueError("num_accepted: draft tokens verified that the plan did not send")
        return
    accepted = result.num_accepted
    if accepted.shape != drafts.shape or int(accepted.min()) < 0 or bool((accepted > drafts).any()):
        raise ValueError("num_accepted: not in [0, draft_lens] for every sequence")
    if result.draft_logprobs.shape != (int(drafts.sum()),):
        raise ValueError("draft_logprobs: not one per draft token of the plan")


def _check_proposals(plan: StepPlan, result: StepResult, vocab_size: int) -> None:
    asked = int(plan.propose_lens.sum()) if plan.propose_lens.size else 0
    if result.draft_proposals.shape != (asked,):
        raise ValueError(f"draft_proposals: {result.draft_proposals.size} tokens, the plan asked for {asked}")
    p = result.draft_proposals
    if p.size and (int(p.min()) < 0 or int(p.max()) >= vocab_size):
        raise ValueError(f"draft_proposals: a token outside the vocabulary of {vocab_size}")


def _check_ids(field: str, ids: np.ndarray, vocab_size: int) -> None:
    """Alternatives' token ids: in the vocabulary, or -1 (padding)."""
    if ids.size and (int(ids.min()) < -1 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{field}: a token outside the vocabulary of {vocab_size}")


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
        pipeline_stages=info.pipeline_stages,
        draft_model=info.draft_model,
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
        pipeline_stages=msg.pipeline_stages or 1,  # 0: a worker from before pipelines
        draft_model=msg.draft_model,
    )


def health_check_request() -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service="")


def is_serving(reply: health_pb2.HealthCheckResponse) -> bool:
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
