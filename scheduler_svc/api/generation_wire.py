"""The Generation API's protobuf edge (`llmserve.v1.Generation`, what clients call): the only
module touching its message types. The worker protocol's codec is common/worker_wire.py and
the Registry's is registry_wire.py, so this module serves the client-facing API alone."""

from __future__ import annotations

import dataclasses

from common.pb.llmserve.v1 import generation_pb2 as gen_pb
from scheduler_svc.engine.load import Load, ModelInfo
from scheduler_svc.engine.request import GenerationRequest, RequestOutput, TokenLogprob
from scheduler_svc.lora.adapter_registry import Adapter
from scheduler_svc.sched.sequence import FinishReason
from scheduler_svc.text.structured_output import StructuredOutput

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
            spec_draft_tokens=out.stats.spec_draft_tokens,
            spec_accepted_tokens=out.stats.spec_accepted_tokens,
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


def model_info(info: ModelInfo, paths: bool = True) -> gen_pb.ModelInfo:
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
        adapters=[adapter_info(a, paths) for a in info.adapters],
    )


def adapter_info(adapter: Adapter, paths: bool = True) -> gen_pb.AdapterInfo:
    """`paths` False leaves out where the adapter lies on the server (what admins alone see)."""
    return gen_pb.AdapterInfo(
        name=adapter.name,
        path=adapter.path if paths else "",
        rank=adapter.rank,
        scale=adapter.scale,
        target_modules=list(adapter.target_modules),
    )


def adapter_list(adapters: list[Adapter], paths: bool = True) -> gen_pb.ListAdaptersResponse:
    return gen_pb.ListAdaptersResponse(adapters=[adapter_info(a, paths) for a in adapters])


def load(value: Load) -> gen_pb.Load:
    return gen_pb.Load(
        running=value.running,
        waiting=value.waiting,
        swapped=value.swapped,
        groups=[gen_pb.WorkerGroupLoad(**dataclasses.asdict(g)) for g in value.groups],
    )
