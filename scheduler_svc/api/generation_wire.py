"""The scheduler service's protobuf edge: the only module that touches generated message types."""

from __future__ import annotations

import dataclasses

import numpy as np
from grpc_health.v1 import health_pb2

from common import token_masks
from common.arrays import pack, unpack
from common.pb.llmserve.v1 import generation_pb2 as gen_pb
from common.pb.llmserve.v1 import registry_pb2 as reg_pb
from common.pb.llmserve.v1 import worker_pb2 as worker_pb
from common.plan import StepPlan, StepResult
from common.worker_info import WorkerInfo
from scheduler_svc.engine.load import Load, ModelInfo
from scheduler_svc.engine.request import GenerationRequest, RequestOutput, TokenLogprob
from scheduler_svc.lora.adapter_registry import Adapter
from scheduler_svc.sched.sequence import FinishReason
from scheduler_svc.text.structured_output import StructuredOutput
from scheduler_svc.workers.worker_registry import Registration

_FINISH = {
    None: gen_pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: gen_pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: gen_pb.FINISH_REASON_STOP,
    FinishReason.STOP_SEQUENCE: gen_pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CONTEXT_LENGTH: gen_pb.FINISH_REASON_CONTEXT_LENGTH,
}


def generation_request(msg: gen_pb.GenerateRequest) -> GenerationRequest:
    return GenerationRequest(
        request_id=msg.request_id,
        prompt=msg.prompt,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        temperature=msg.sampling.temperature,
        top_p=msg.sampling.top_p,
        top_k=msg.sampling.top_k,
        seed=msg.sampling.seed if msg.sampling.HasField("seed") else None,
        max_tokens=msg.stopping.max_tokens,
        stop=tuple(msg.stopping.stop),
        stop_token_ids=tuple(msg.stopping.stop_token_ids),
        ignore_eos=msg.stopping.ignore_eos,
        n=msg.sampling.n,
        best_of=msg.sampling.best_of,
        beam_width=msg.sampling.beam_width,
        length_penalty=msg.sampling.length_penalty if msg.sampling.HasField("length_penalty") else None,
        priority=msg.priority,
        messages=tuple((m.role, m.content) for m in msg.messages),
        min_p=msg.sampling.min_p,
        repetition_penalty=msg.sampling.repetition_penalty,
        presence_penalty=msg.sampling.presence_penalty,
        frequency_penalty=msg.sampling.frequency_penalty,
        logprobs=msg.sampling.logprobs if msg.sampling.HasField("logprobs") else None,
        prompt_logprobs=msg.sampling.prompt_logprobs if msg.sampling.HasField("prompt_logprobs") else None,
        logit_bias=tuple(sorted(msg.sampling.logit_bias.items())),
        min_tokens=msg.stopping.min_tokens,
        include_stop_str_in_output=msg.stopping.include_stop_str_in_output,
        structured_output=_structured_output(msg),
        adapter_id=msg.adapter_id,
    )


def _structured_output(msg: gen_pb.GenerateRequest) -> StructuredOutput | None:
    kind = msg.structured_output.WhichOneof("kind") if msg.HasField("structured_output") else None
    if kind is None or (kind == "json_object" and not msg.structured_output.json_object):
        return None
    so = msg.structured_output
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(so.choice.choices))
    return StructuredOutput(kind, "" if kind == "json_object" else getattr(so, kind))


def generate_response(out: RequestOutput) -> gen_pb.GenerateResponse:
    return gen_pb.GenerateResponse(
        request_id=out.request_id,
        token_ids=out.token_ids,
        text=out.text,
        finish_reason=_FINISH[out.finish_reason],
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        index=out.index,
        cumulative_logprob=out.cumulative_logprob,
        stats=None
        if out.stats is None
        else gen_pb.RequestStats(
            prefix_cache_hit_tokens=out.stats.prefix_cache_hit_tokens,
            num_preemptions=out.stats.num_preemptions,
            num_swaps=out.stats.num_swaps,
            swapped_bytes=out.stats.swapped_bytes,
        ),
        logprobs=_token_logprobs(out.logprobs),
        prompt_logprobs=_token_logprobs(out.prompt_logprobs),
        stop_sequence=out.stop_sequence,
        stop_token_id=out.stop_token_id,
    )


def _token_logprobs(entries: tuple[TokenLogprob, ...]) -> list[gen_pb.TokenLogprob]:
    return [
        gen_pb.TokenLogprob(
            token_id=e.token_id, logprob=e.logprob, top=[gen_pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top]
        )
        for e in entries
    ]


def step_plan(plan: StepPlan) -> worker_pb.StepPlan:
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
        _put_token_masks(msg.sampling, s.token_masks)
    return msg


def _put_token_masks(sampling: worker_pb.SamplingBatch, masks: np.ndarray) -> None:
    """Narrow rows as their allowed ids, the others as words (common/token_masks.py)."""
    parts = token_masks.split(masks)
    sampling.token_masks = pack(parts.dense, np.int32)
    sampling.token_mask_words = masks.shape[1]
    sampling.mask_sparse = pack(parts.sparse, np.uint8)
    sampling.mask_id_offsets = pack(parts.offsets, np.int32)
    sampling.mask_token_ids = pack(parts.ids, np.int32)


def step_result(msg: worker_pb.StepResult, num_seqs: int) -> StepResult:
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
        **_prompt_logprobs(msg, num_seqs),
    )


def _prompt_logprobs(msg: worker_pb.StepResult, num_seqs: int) -> dict[str, np.ndarray]:
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


def describe_request() -> worker_pb.DescribeRequest:
    return worker_pb.DescribeRequest()


def worker_info(msg: worker_pb.WorkerInfo) -> WorkerInfo:
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


def model_info(info: ModelInfo) -> gen_pb.ModelInfo:
    limits = info.limits
    return gen_pb.ModelInfo(
        model_name=info.model_name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        block_size=info.block_size,
        has_chat_template=info.has_chat_template,
        limits=gen_pb.RequestLimits(
            max_prompt_tokens=limits.max_prompt_tokens or limits.max_model_len - 1,
            max_stop_strings=limits.max_stop_strings,
            max_logprobs=limits.max_logprobs,
            max_n=limits.max_n,
            max_queue_len=info.max_queue_len,
        ),
        adapters=[adapter_info(a) for a in info.adapters],
    )


def adapter_info(adapter: Adapter) -> gen_pb.AdapterInfo:
    return gen_pb.AdapterInfo(
        name=adapter.name,
        path=adapter.path,
        rank=adapter.rank,
        scale=adapter.scale,
        target_modules=list(adapter.target_modules),
    )


def adapter_list(adapters: list[Adapter]) -> gen_pb.ListAdaptersResponse:
    return gen_pb.ListAdaptersResponse(adapters=[adapter_info(a) for a in adapters])


def load(value: Load) -> gen_pb.Load:
    return gen_pb.Load(
        running=value.running,
        waiting=value.waiting,
        swapped=value.swapped,
        groups=[gen_pb.WorkerGroupLoad(**dataclasses.asdict(g)) for g in value.groups],
    )


def registration(msg: reg_pb.RegisterRequest) -> Registration:
    return Registration(
        address=msg.address,
        group=msg.group or msg.address,
        rank=msg.rank,
        world_size=msg.world_size or 1,
        model_name=msg.model_name,
        block_size=msg.block_size,
    )


def register_reply(accepted: bool, message: str) -> reg_pb.RegisterReply:
    return reg_pb.RegisterReply(accepted=accepted, message=message)


def health_check_request() -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service="")


def is_serving(reply: health_pb2.HealthCheckResponse) -> bool:
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
