"""The smg gateway's engine protocol (`vllm.grpc.engine.VllmEngine`) on the scheduler's port.

In-suite tests talk through the smg-grpc-proto stubs to a real scheduler and tiny worker and
compare with the native `llmserve.v1.Generation` API over the same engine. Every test that
uses `tiny_scheduler` ends with all requests gone and every KV block back in the free pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import re
import signal
import sys
import zipfile
from pathlib import Path

import grpc
import jsonschema
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from scheduler_svc.api import vllm_kv_wire, vllm_wire
from scheduler_svc.engine.kv_event_log import CacheCleared, KvBatch, KvEventLog
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.kv.kv_events import BlockRemoved, BlockStored, KvEventQueue
from tests.conftest import Scheduler, WorkerProcess, collect, request
from tests.engine_state import first_scheduler
from tests.test_structured_output import PROMPT as GUIDED_PROMPT
from tests.test_structured_output import SCHEMAS

GRPCURL = str(Path(sys.executable).parent / "grpcurl")
PROMPT = [100 + 7 * k for k in range(12)]


def stub(s: Scheduler) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(s.channel)


def generate(
    ids: list[int] | None = None, text: str | None = None, stream: bool = True, request_id: str = "", **sampling: object
) -> vpb.GenerateRequest:
    """Greedy unless told otherwise (the protocol's unset temperature means 1.0)."""
    sampling.setdefault("temperature", 0.0)
    bias = sampling.pop("logit_bias", None)
    params = vpb.SamplingParams(**sampling)  # type: ignore[arg-type]
    if bias:
        params.logit_bias.update(bias)  # type: ignore[arg-type]
    req = vpb.GenerateRequest(request_id=request_id, sampling_params=params, stream=stream)
    if text is not None:
        req.text = text
    else:
        req.tokenized.input_ids.extend(ids if ids is not None else PROMPT)
    return req


async def run(s: Scheduler, req: vpb.GenerateRequest) -> list[vpb.GenerateResponse]:
    return [m async for m in stub(s).Generate(req)]


def chunks(messages: list[vpb.GenerateResponse], index: int = 0) -> list[vpb.GenerateStreamChunk]:
    return [m.chunk for m in messages if m.WhichOneof("response") == "chunk" and m.chunk.index == index]


def completes(messages: list[vpb.GenerateResponse]) -> list[vpb.GenerateComplete]:
    return [m.complete for m in messages if m.WhichOneof("response") == "complete"]


def streamed_ids(messages: list[vpb.GenerateResponse], index: int = 0) -> list[int]:
    return [t for c in chunks(messages, index) for t in c.token_ids]


async def native(s: Scheduler, ids: list[int] | None = None, **fields: object) -> list[int]:
    return (await collect(s.stub, request(ids=ids or PROMPT, **fields))).token_ids  # type: ignore[arg-type]


async def read_all(call: grpc.aio.UnaryStreamCall) -> list[vpb.GenerateResponse]:
    """The rest of a call already read with read() (the two APIs may not be mixed)."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


async def expect_error(s: Scheduler, req: vpb.GenerateRequest, code: grpc.StatusCode, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run(s, req)
    assert err.value.code() == code, err.value.details()
    assert err.value.details().startswith(field + ":"), err.value.details()


# ---- generation ----


async def test_greedy_stream_and_unary_equal_the_native_api(tiny_scheduler: Scheduler) -> None:
    want = await native(tiny_scheduler, max_tokens=8, ignore_eos=True)
    assert len(want) == 8
    messages = await run(tiny_scheduler, generate(max_tokens=8, ignore_eos=True))
    assert [m.WhichOneof("response") for m in messages][-1] == "complete"
    assert len(chunks(messages)) >= 2 and streamed_ids(messages) == want
    assert [c.completion_tokens for c in chunks(messages)][-1] == 8
    assert all(c.prompt_tokens == len(PROMPT) for c in chunks(messages))
    (done,) = completes(messages)
    assert list(done.output_ids) == want and done.finish_reason == "length"
    assert (done.prompt_tokens, done.completion_tokens, done.index) == (len(PROMPT), 8, 0)
    assert done.WhichOneof("matched_stop") is None
    unary = await run(tiny_scheduler, generate(stream=False, max_tokens=8, ignore_eos=True))
    assert [m.WhichOneof("response") for m in unary] == ["complete"]
    assert list(unary[0].complete.output_ids) == want and unary[0].complete.finish_reason == "length"


async def test_text_input_is_tokenized_like_a_native_prompt(tiny_scheduler: Scheduler) -> None:
    text = "Hello there, how are you?"
    want = await collect(tiny_scheduler.stub, request(text, max_tokens=6, ignore_eos=True))
    (done,) = completes(await run(tiny_scheduler, generate(text=text, stream=False, max_tokens=6, ignore_eos=True)))
    assert list(done.output_ids) == want.token_ids
    assert done.prompt_tokens == want.final.prompt_tokens == len(tiny_scheduler.engine.tokenizer.encode(text))


async def test_truncate_prompt_tokens_keeps_the_end_of_the_prompt(tiny_scheduler: Scheduler) -> None:
    long = [200 + k for k in range(30)]
    want = await native(tiny_scheduler, ids=long[-5:], max_tokens=4, ignore_eos=True)
    (done,) = completes(
        await run(tiny_scheduler, generate(long, stream=False, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=5))
    )
    assert (list(done.output_ids), done.prompt_tokens) == (want, 5)
    # -1: as much of the end as the context takes (one token is left to generate)
    max_len = tiny_scheduler.engine.limits.max_model_len
    (done,) = completes(
        await run(
            tiny_scheduler, generate([9] * (max_len + 20), stream=False, ignore_eos=True, truncate_prompt_tokens=-1)
        )
    )
    assert (done.prompt_tokens, done.completion_tokens, done.finish_reason) == (max_len - 1, 1, "length")


async def test_seeded_sampling_is_reproducible_and_is_the_native_seed(tiny_scheduler: Scheduler) -> None:
    def sampled(seed: int) -> vpb.GenerateRequest:
        return generate(stream=False, max_tokens=12, ignore_eos=True, temperature=1.5, seed=seed)

    first, again, other = [list(completes(await run(tiny_scheduler, sampled(s)))[0].output_ids) for s in (7, 7, 8)]
    assert first == again != other
    assert first == await native(tiny_scheduler, max_tokens=12, ignore_eos=True, temperature=1.5, seed=7)
    # int32 on this wire: a negative seed is its unsigned 32-bit pattern
    negative = list(completes(await run(tiny_scheduler, sampled(-3)))[0].output_ids)
    assert negative == await native(tiny_scheduler, max_tokens=12, ignore_eos=True, temperature=1.5, seed=2**32 - 3)


async def test_stop_token_and_stop_string_are_reported_as_matched_stop(tiny_scheduler: Scheduler) -> None:
    base = await collect(tiny_scheduler.stub, request(ids=PROMPT, max_tokens=20, ignore_eos=True))
    stop_token = base.token_ids[5]
    cut = base.token_ids.index(stop_token)
    messages = await run(tiny_scheduler, generate(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token]))
    (done,) = completes(messages)
    assert streamed_ids(messages) == list(done.output_ids) == base.token_ids[: cut + 1]
    assert (done.finish_reason, done.WhichOneof("matched_stop"), done.matched_token_id) == (
        "stop",
        "matched_token_id",
        stop_token,
    )

    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    by_string = await collect(tiny_scheduler.stub, request(ids=PROMPT, max_tokens=20, ignore_eos=True, stop=[stop]))
    (done,) = completes(await run(tiny_scheduler, generate(stream=False, max_tokens=20, ignore_eos=True, stop=[stop])))
    assert list(done.output_ids) == by_string.token_ids and len(done.output_ids) < 20
    assert (done.finish_reason, done.matched_stop_str) == ("stop", stop)


async def test_eos_stops_with_no_matched_stop_unless_ignored(tiny_scheduler: Scheduler) -> None:
    eos = next(iter(tiny_scheduler.engine.spec.eos_token_ids))
    forced = {eos: 100.0}  # the bias makes eos the argmax at every step
    (done,) = completes(await run(tiny_scheduler, generate(stream=False, max_tokens=5, logit_bias=forced)))
    assert (list(done.output_ids), done.finish_reason, done.WhichOneof("matched_stop")) == ([eos], "stop", None)
    (done,) = completes(
        await run(tiny_scheduler, generate(stream=False, max_tokens=5, logit_bias=forced, ignore_eos=True))
    )
    assert (list(done.output_ids), done.finish_reason) == ([eos] * 5, "length")
    # min_tokens bans eos (and the bias cannot bring it back) until three tokens are out
    (done,) = completes(
        await run(tiny_scheduler, generate(stream=False, max_tokens=5, logit_bias=forced, min_tokens=3))
    )
    assert len(done.output_ids) == 4 and done.output_ids[-1] == eos and eos not in done.output_ids[:3]
    # skip_special_tokens decides whether a stop string can match a special token's text
    eos_text = tiny_scheduler.engine.tokenizer.token_strings([eos])[0]
    seen = dict(stream=False, max_tokens=5, logit_bias=forced, ignore_eos=True, stop=[eos_text])
    (done,) = completes(await run(tiny_scheduler, generate(**seen, skip_special_tokens=False)))  # type: ignore[arg-type]
    assert (list(done.output_ids), done.finish_reason, done.matched_stop_str) == ([eos], "stop", eos_text)
    (done,) = completes(await run(tiny_scheduler, generate(**seen, skip_special_tokens=True)))  # type: ignore[arg-type]
    assert (done.completion_tokens, done.finish_reason) == (5, "length")


async def test_max_tokens_ends_with_length_and_unset_runs_to_the_context(tiny_scheduler: Scheduler) -> None:
    (done,) = completes(await run(tiny_scheduler, generate(stream=False, max_tokens=3, ignore_eos=True)))
    assert (done.completion_tokens, done.finish_reason) == (3, "length")
    max_len = tiny_scheduler.engine.limits.max_model_len
    (done,) = completes(await run(tiny_scheduler, generate([9] * (max_len - 4), stream=False, ignore_eos=True)))
    assert (done.completion_tokens, done.finish_reason) == (4, "length")


async def test_n_outputs_carry_their_index(tiny_scheduler: Scheduler) -> None:
    fields = dict(max_tokens=6, ignore_eos=True, temperature=1.0, seed=11, n=2)
    messages = await run(tiny_scheduler, generate(**fields))  # type: ignore[arg-type]
    done = sorted(completes(messages), key=lambda c: c.index)
    assert [c.index for c in done] == [0, 1]
    assert all(list(d.output_ids) == streamed_ids(messages, d.index) for d in done)
    assert done[0].output_ids != done[1].output_ids
    want = await collect(tiny_scheduler.stub, request(ids=PROMPT, **fields))  # type: ignore[arg-type]
    assert [[t for m in want.messages if m.index == i for t in m.token_ids] for i in (0, 1)] == [
        list(d.output_ids) for d in done
    ]
    unary = completes(await run(tiny_scheduler, generate(stream=False, **fields)))  # type: ignore[arg-type]
    assert [(c.index, list(c.output_ids)) for c in unary] == [(d.index, list(d.output_ids)) for d in done]


async def test_logprobs_match_the_native_api(tiny_scheduler: Scheduler) -> None:
    want = await collect(
        tiny_scheduler.stub, request(ids=PROMPT, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    )
    entries = [e for m in want.messages for e in m.logprobs]
    prompt_entries = list(want.messages[0].prompt_logprobs)
    messages = await run(tiny_scheduler, generate(max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1))
    streamed = chunks(messages)
    assert all(list(c.output_logprobs.token_ids) == list(c.token_ids) for c in streamed)
    values = [v for c in streamed for v in c.output_logprobs.token_logprobs]
    assert values == pytest.approx([e.logprob for e in entries], abs=1e-6)
    tops = [t for c in streamed for t in c.output_logprobs.top_logprobs]
    assert [list(t.token_ids) for t in tops] == [[a.token_id for a in e.top] for e in entries]
    assert all(len(t.values) == 2 for t in tops)
    first = streamed[0].input_logprobs
    assert not any(c.HasField("input_logprobs") for c in streamed[1:])
    assert list(first.token_ids) == PROMPT and not first.token_logprobs[0].HasField("value")
    assert [v.value for v in first.token_logprobs[1:]] == pytest.approx([e.logprob for e in prompt_entries], abs=1e-6)
    (done,) = completes(
        await run(tiny_scheduler, generate(stream=False, max_tokens=5, ignore_eos=True, logprobs=0, prompt_logprobs=1))
    )
    assert list(done.output_logprobs.token_logprobs) == pytest.approx(values, abs=1e-6)
    assert not done.output_logprobs.top_logprobs  # logprobs=0: the sampled token's only
    assert len(done.input_logprobs.token_logprobs) == len(PROMPT)
    plain = completes(await run(tiny_scheduler, generate(stream=False, max_tokens=2)))[0]
    assert not plain.HasField("output_logprobs") and not plain.HasField("input_logprobs")


@pytest.mark.parametrize(
    "fields",
    [
        dict(temperature=1.0, seed=3, repetition_penalty=1.8),
        dict(temperature=1.0, seed=3, presence_penalty=2.0, frequency_penalty=2.0),
        dict(temperature=1.0, seed=3, top_k=2),
        dict(temperature=1.0, seed=3, top_p=0.3),
        dict(temperature=1.0, seed=3, min_p=0.4),
    ],
    ids=["repetition", "presence-frequency", "top_k", "top_p", "min_p"],
)
async def test_sampling_fields_reach_the_engine(tiny_scheduler: Scheduler, fields: dict[str, object]) -> None:
    """Each field changes the output the way it changes the native API's."""
    plain = {k: v for k, v in fields.items() if k in ("temperature", "seed")}
    with_field = await native(tiny_scheduler, max_tokens=24, ignore_eos=True, **fields)
    without = await native(tiny_scheduler, max_tokens=24, ignore_eos=True, **plain)
    assert with_field != without, "the field must matter for this prompt"
    (done,) = completes(await run(tiny_scheduler, generate(stream=False, max_tokens=24, ignore_eos=True, **fields)))
    assert list(done.output_ids) == with_field


# ---- structured outputs: the constraint oneof (tests/test_structured_output.py covers the engine) ----


async def test_constraints_give_outputs_that_follow_them(tiny_scheduler: Scheduler) -> None:
    regex = r"[a-f]{3}-[0-9]{2,3}"
    choices = ["alpha", "beta", "gamma delta"]
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [1-9]'
    cases: list[tuple[str, dict[str, object], object]] = [
        *((f"schema {i}", {"json_schema": json.dumps(SCHEMAS[i])}, SCHEMAS[i]) for i in (2, 5, 12, 16, 18, 25, 29)),
        ("regex", {"regex": regex}, regex),
        ("choice", {"choice": vpb.ChoiceConstraint(choices=choices)}, choices),
        ("grammar", {"grammar": grammar}, r"\([1-9](\+[1-9])*\)"),
        # Keys and strings are free: a bias on the closing quote and brace ends them sooner.
        ("object", {"json_object": True, "logit_bias": {18: 8.0, 109: 8.0}}, dict),
    ]
    runs = [
        (name, want, generate(text=GUIDED_PROMPT, stream=stream, max_tokens=160, **sampling, **fields))
        for name, fields, want in cases
        for sampling, stream in (
            ({}, True),
            ({"temperature": 1.0, "seed": 1}, False),
            ({"temperature": 1.0, "seed": 2}, True),
        )
    ]
    results = await asyncio.gather(*(run(tiny_scheduler, req) for _, _, req in runs))
    texts = set()
    for (name, want, _), messages in zip(runs, results):
        (done,) = completes(messages)
        text = tiny_scheduler.engine.tokenizer.decode(list(done.output_ids))
        assert done.finish_reason == "stop", (name, text)
        if name.startswith("schema"):
            jsonschema.validate(json.loads(text), want)  # type: ignore[arg-type]
        elif name == "object":
            assert isinstance(json.loads(text), dict), text
        elif name == "choice":
            assert text in want, text  # type: ignore[operator]
        else:
            assert re.fullmatch(want, text), (name, text)  # type: ignore[arg-type]
        texts.add(text)
    assert len(texts) > len(cases)  # sampled, not one fixed output per constraint
    # json_object false is no constraint at all.
    free = await run(tiny_scheduler, generate(max_tokens=6, ignore_eos=True, json_object=False))
    assert streamed_ids(free) == await native(tiny_scheduler, max_tokens=6, ignore_eos=True)


async def test_bad_constraints_are_refused_naming_the_field(tiny_scheduler: Scheduler) -> None:
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    for fields, code, field in [
        ({"structural_tag": "{}"}, grpc.StatusCode.UNIMPLEMENTED, "sampling_params.structural_tag"),
        ({"json_schema": "{not json"}, invalid, "sampling_params.json_schema"),
        ({"json_schema": '{"type": "no-such-type"}'}, invalid, "sampling_params.json_schema"),  # the compiler's
        ({"regex": "(unclosed"}, invalid, "sampling_params.regex"),
        ({"grammar": "root ::= undefined_rule"}, invalid, "sampling_params.grammar"),
        ({"choice": vpb.ChoiceConstraint()}, invalid, "sampling_params.choice"),
        ({"json_object": True, "min_tokens": 2}, invalid, "sampling_params.min_tokens"),
    ]:
        await expect_error(tiny_scheduler, generate(max_tokens=4, **fields), code, field)


def _with(edit: object) -> vpb.GenerateRequest:
    req = generate(max_tokens=4)
    edit(req)  # type: ignore[operator]
    return req


@pytest.mark.parametrize(
    ("req", "code", "field"),
    [
        (generate(max_tokens=4, temperature=-1.0), "INVALID_ARGUMENT", "sampling_params.temperature"),
        (generate(max_tokens=4, top_p=1.5), "INVALID_ARGUMENT", "sampling_params.top_p"),
        (generate(max_tokens=4, min_p=2.0), "INVALID_ARGUMENT", "sampling_params.min_p"),
        (generate(max_tokens=4, presence_penalty=3.0), "INVALID_ARGUMENT", "sampling_params.presence_penalty"),
        (generate(max_tokens=4, repetition_penalty=-1.0), "INVALID_ARGUMENT", "sampling_params.repetition_penalty"),
        (generate(max_tokens=4, logprobs=-1), "INVALID_ARGUMENT", "sampling_params.logprobs"),
        (generate(max_tokens=4, prompt_logprobs=21), "INVALID_ARGUMENT", "sampling_params.prompt_logprobs"),
        (generate(max_tokens=0), "INVALID_ARGUMENT", "sampling_params.max_tokens"),
        (generate([1] * 500, max_tokens=13), "INVALID_ARGUMENT", "sampling_params.max_tokens"),
        (generate([1] * 600), "INVALID_ARGUMENT", "tokenized.input_ids"),
        (generate([1, 49152]), "INVALID_ARGUMENT", "tokenized.input_ids[1]"),
        (generate(text=""), "INVALID_ARGUMENT", "text"),
        (vpb.GenerateRequest(), "INVALID_ARGUMENT", "input"),
        (generate(max_tokens=4, stop=["ok", ""]), "INVALID_ARGUMENT", "sampling_params.stop[1]"),
        (generate(max_tokens=4, stop_token_ids=[10**6]), "INVALID_ARGUMENT", "sampling_params.stop_token_ids[0]"),
        (generate(max_tokens=4, min_tokens=5), "INVALID_ARGUMENT", "sampling_params.min_tokens"),
        (generate(max_tokens=4, n=17), "INVALID_ARGUMENT", "sampling_params.n"),
        (generate(max_tokens=4, logit_bias={5: 200.0}), "INVALID_ARGUMENT", "sampling_params.logit_bias[5]"),
        (
            generate(max_tokens=4, truncate_prompt_tokens=0),
            "INVALID_ARGUMENT",
            "sampling_params.truncate_prompt_tokens",
        ),
        (_with(lambda r: setattr(r, "data_parallel_rank", 1)), "INVALID_ARGUMENT", "data_parallel_rank"),
        (_with(lambda r: r.mm_inputs.mm_hashes.append("x")), "UNIMPLEMENTED", "mm_inputs"),
        (_with(lambda r: setattr(r, "kv_transfer_params_json", "{}")), "UNIMPLEMENTED", "kv_transfer_params_json"),
    ],
)
async def test_bad_requests_are_refused_naming_the_field(
    tiny_scheduler: Scheduler, req: vpb.GenerateRequest, code: str, field: str
) -> None:
    await expect_error(tiny_scheduler, req, getattr(grpc.StatusCode, code), field)


# ---- cancel and abort ----


async def test_cancel_mid_stream_frees_every_block(tiny_scheduler: Scheduler) -> None:
    call = stub(tiny_scheduler).Generate(generate(list(range(100, 140)), max_tokens=400, ignore_eos=True))
    for _ in range(3):
        assert (await call.read()).WhichOneof("response") == "chunk"
    assert first_scheduler(tiny_scheduler.engine).block_manager.num_used_blocks > 0
    call.cancel()
    await tiny_scheduler.wait_idle(10.0)


async def test_abort_ends_streamed_and_unary_requests_with_abort(
    tiny_scheduler: Scheduler, tiny_worker: WorkerProcess
) -> None:
    engine = tiny_scheduler.engine
    call = stub(tiny_scheduler).Generate(generate(max_tokens=400, ignore_eos=True, request_id="gw-1"))
    seen = [await call.read(), await call.read()]
    await stub(tiny_scheduler).Abort(vpb.AbortRequest(request_ids=["gw-1", "unknown"]))
    rest = await read_all(call)
    (done,) = completes(rest)
    assert done.finish_reason == "abort" and 2 <= done.completion_tokens < 400
    assert list(done.output_ids) == streamed_ids(seen + rest)

    # The worker is paused before the unary request goes in, so the request's first step sits
    # unanswered in the worker's stream while the abort is served: polling for it to run while
    # the worker computes could, on a busy machine, first see it with all 400 tokens sampled.
    # A request is admitted only once the step in flight returns, so the worker is paused only
    # when no step is in flight. Every wait is bounded and the worker is always resumed.
    await tiny_scheduler.wait_idle(10.0)

    async def no_step_in_flight() -> None:
        while any(replica.worker._sent for replica in engine.replicas):
            await asyncio.sleep(0.005)

    await asyncio.wait_for(no_step_in_flight(), 10.0)
    tiny_worker.proc.send_signal(signal.SIGSTOP)
    try:
        unary = stub(tiny_scheduler).Generate(
            generate(stream=False, max_tokens=400, ignore_eos=True, request_id="gw-2")
        )

        async def running() -> None:
            while engine.num_requests == 0 or engine.activity()[0].load.running == 0:
                await asyncio.sleep(0.005)

        await asyncio.wait_for(running(), 10.0)
        await asyncio.wait_for(stub(tiny_scheduler).Abort(vpb.AbortRequest(request_ids=["gw-2"])), 10.0)
    finally:
        tiny_worker.proc.send_signal(signal.SIGCONT)
    (done,) = completes([m async for m in unary])
    assert done.finish_reason == "abort" and done.completion_tokens < 400
    await tiny_scheduler.wait_idle(10.0)


# ---- model, server, loads, tokenizer ----


async def test_model_and_server_info_and_health(tiny_scheduler: Scheduler, tiny_model_dir: Path) -> None:
    engine = tiny_scheduler.engine
    info = await stub(tiny_scheduler).GetModelInfo(vpb.GetModelInfoRequest())
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert info.served_model_name == tiny_model_dir.name and info.model_path == str(tiny_model_dir)
    assert (info.max_context_length, info.vocab_size) == (engine.limits.max_model_len, config["vocab_size"])
    assert list(info.eos_token_ids) == [config["eos_token_id"]] and info.bos_token_id == config["bos_token_id"]
    assert list(info.architectures) == config["architectures"] and info.model_type == "llama"
    assert info.is_generation and info.max_req_input_len == engine.limits.max_model_len - 1

    call = stub(tiny_scheduler).Generate(generate(max_tokens=400, ignore_eos=True))
    await call.read()
    server = await stub(tiny_scheduler).GetServerInfo(vpb.GetServerInfoRequest())
    assert (server.server_type, server.active_requests, server.block_size) == ("llmserve", 1, engine.block_size)
    assert server.max_num_seqs == engine.config.max_num_seqs and server.model_dtype == "float32"
    assert server.last_receive_timestamp > 0 and server.uptime_seconds > 0 and not server.is_paused
    call.cancel()

    health = await stub(tiny_scheduler).HealthCheck(vpb.HealthCheckRequest())
    assert health.healthy and health.message == "serving"
    status = await health_pb2_grpc.HealthStub(tiny_scheduler.channel).Check(
        health_pb2.HealthCheckRequest(service="vllm.grpc.engine.VllmEngine")
    )
    assert status.status == health_pb2.HealthCheckResponse.SERVING


async def test_get_loads_reports_each_worker_group(tiny_scheduler: Scheduler) -> None:
    idle = await stub(tiny_scheduler).GetLoads(vpb.GetLoadsRequest())
    assert idle.dp_rank_count == 1 and idle.timestamp
    (load,) = idle.loads
    assert (load.dp_rank, load.num_running_reqs, load.num_waiting_reqs, load.token_usage) == (0, 0, 0, 0.0)
    bm = first_scheduler(tiny_scheduler.engine).block_manager
    assert load.max_total_num_tokens == bm.num_blocks * bm.block_size and load.max_running_requests > 0

    prompt = list(range(300, 340))
    await run(tiny_scheduler, generate(prompt, max_tokens=2))
    call = stub(tiny_scheduler).Generate(generate(prompt, max_tokens=400, ignore_eos=True))  # hits the cached prefix
    for _ in range(4):
        await call.read()
    (busy,) = (await stub(tiny_scheduler).GetLoads(vpb.GetLoadsRequest(dp_rank=0))).loads
    assert busy.num_running_reqs == 1 and busy.num_total_reqs == 1
    assert busy.num_used_tokens >= 3 * bm.block_size  # 40 prompt tokens and a few generated
    assert busy.token_usage == pytest.approx(busy.num_used_tokens / busy.max_total_num_tokens)
    assert 0 < busy.cache_hit_rate < 1 and busy.gen_throughput > 0
    call.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(tiny_scheduler).GetLoads(vpb.GetLoadsRequest(dp_rank=3))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("dp_rank:")


async def test_get_tokenizer_streams_the_model_dirs_files(tiny_scheduler: Scheduler, tiny_model_dir: Path) -> None:
    pieces = [c async for c in stub(tiny_scheduler).GetTokenizer(common_pb2.GetTokenizerRequest())]
    assert len(pieces) > 1, "the bundle should span several chunks"
    assert all(not p.sha256 for p in pieces[:-1])
    data = b"".join(p.data for p in pieces)
    assert pieces[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names)
        for name in names:
            assert archive.read(name) == (tiny_model_dir / name).read_bytes(), name
    again = [c async for c in stub(tiny_scheduler).GetTokenizer(common_pb2.GetTokenizerRequest())]
    assert again[-1].sha256 == pieces[-1].sha256  # reproducible


# ---- prefix cache: flush and events ----


async def test_flush_cache_forgets_cached_blocks_only_when_idle(tiny_scheduler: Scheduler) -> None:
    bm = first_scheduler(tiny_scheduler.engine).block_manager
    await run(tiny_scheduler, generate(list(range(400, 440)), max_tokens=2))
    assert bm.device.num_cached >= 2
    call = stub(tiny_scheduler).Generate(generate(max_tokens=400, ignore_eos=True))
    await call.read()
    busy = await stub(tiny_scheduler).FlushCache(common_pb2.FlushCacheRequest())
    assert not busy.success and "in flight" in busy.message and bm.device.num_cached >= 2
    call.cancel()
    flushed = await stub(tiny_scheduler).FlushCache(common_pb2.FlushCacheRequest(timeout_s=10))
    assert flushed.success, flushed.message
    assert bm.device.num_cached == 0 and not bm.indexed_hashes()
    bm.check_integrity()


async def next_batch(call: grpc.aio.UnaryStreamCall) -> common_pb2.KvEventBatch:
    return await asyncio.wait_for(call.read(), 10)


async def test_kv_events_report_stored_and_removed_blocks(tiny_scheduler: Scheduler) -> None:
    bm = first_scheduler(tiny_scheduler.engine).block_manager
    size = bm.block_size
    events = stub(tiny_scheduler).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    await events.initial_metadata()  # subscribed
    prompt = list(range(500, 500 + 2 * size + 3))
    await run(tiny_scheduler, generate(prompt, max_tokens=2))
    batch = await next_batch(events)
    (event,) = batch.events
    stored = event.stored
    assert [list(b.token_ids) for b in stored.blocks] == [prompt[:size], prompt[size : 2 * size]]
    assert all(b.block_size == size for b in stored.blocks) and not stored.HasField("parent_block_hash")
    hashes = [b.block_hash for b in stored.blocks]
    assert set(hashes) == bm.indexed_hashes()

    # the same prompt again is a cache hit: nothing new is stored
    await run(tiny_scheduler, generate(prompt, max_tokens=2))
    assert (await stub(tiny_scheduler).FlushCache(common_pb2.FlushCacheRequest(timeout_s=10))).success
    removed = await next_batch(events)
    assert removed.sequence_number == batch.sequence_number + 1
    assert sorted(h for e in removed.events for h in e.removed.block_hashes) == sorted(hashes)
    events.cancel()

    # a subscriber resuming after the first batch is replayed the second
    resumed = stub(tiny_scheduler).SubscribeKvEvents(
        common_pb2.SubscribeKvEventsRequest(start_sequence_number=batch.sequence_number)
    )
    assert await next_batch(resumed) == removed
    resumed.cancel()
    # one the history cannot serve is told to forget this engine's blocks, numbered after its cursor
    lost = stub(tiny_scheduler).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=41))
    await lost.initial_metadata()
    first = await next_batch(lost)
    assert first.sequence_number == 42 and [e.WhichOneof("data") for e in first.events] == ["cleared"]
    await run(tiny_scheduler, generate(prompt, max_tokens=2))
    assert (await next_batch(lost)).sequence_number == 43
    lost.cancel()


async def test_kv_events_refuse_a_cursor_with_no_room_after_it(tiny_scheduler: Scheduler) -> None:
    # Found by benchmarks/fuzz_api.py: the resync batch numbered start + 1 overflowed the uint64
    # (INTERNAL, "Value out of range").
    for start in (2**64 - 1, 2**63):
        call = stub(tiny_scheduler).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await next_batch(call)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "start_sequence_number" in (err.value.details() or "")


async def test_unsupported_rpcs_and_reflection(tiny_scheduler: Scheduler) -> None:
    for call in (
        stub(tiny_scheduler).Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 2]))),
        stub(tiny_scheduler).StartProfile(common_pb2.StartProfileRequest()),
        stub(tiny_scheduler).StopProfile(common_pb2.StopProfileRequest()),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and err.value.details()
    proc = await asyncio.create_subprocess_exec(
        GRPCURL,
        "-plaintext",
        f"127.0.0.1:{tiny_scheduler.port}",
        "list",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err_out = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err_out.decode()
    assert "vllm.grpc.engine.VllmEngine" in out.decode().split()


# ---- the pieces, without a server ----


def test_block_manager_records_what_its_prefix_cache_indexes_and_evicts() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    bm.allocate(0, 5)
    bm.commit(0, tokens, 5)
    events, lost = bm.kv_events.drain()
    assert not lost and [type(e) for e in events] == [BlockStored, BlockStored]
    first, second = events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert (first.token_ids, first.parent_hash, second.token_ids, second.parent_hash) == (
        (1, 2),
        None,
        (3, 4),
        first.block_hash,
    )
    bm.free(0)
    bm.allocate(1, 6)  # takes every block: the cached ones are evicted, tail first
    assert bm.kv_events.drain() == ([BlockRemoved(second.block_hash), BlockRemoved(first.block_hash)], False)
    queue = KvEventQueue(max_events=2)
    for h in range(3):
        queue.removed(h)
    assert queue.drain() == ([BlockRemoved(1), BlockRemoved(2)], True)


async def test_event_log_merges_groups_and_resyncs_after_loss() -> None:
    a, b = BlockManager(4, 2), BlockManager(4, 2)
    managers = [a, b]
    log = KvEventLog(lambda: managers)
    for bm in (a, b):
        bm.allocate(0, 2)
        bm.commit(0, [7, 8], 2)
    batch = log.poll()
    assert batch is not None and [type(e) for e in batch.events] == [BlockStored]  # stored once for both
    a.free(0)
    a.allocate(1, 8)  # evicts a's copy; b still holds it
    assert log.poll() is None
    managers.remove(b)  # b's group is lost: its cache with it
    removed = log.poll()
    assert removed is not None and removed.events == (BlockRemoved(batch.events[0].block_hash),)  # type: ignore[union-attr]
    assert removed.sequence_number == batch.sequence_number + 1


def test_kv_batches_chain_consecutive_stores() -> None:
    batch = KvBatch(
        9,
        1.5,
        (
            BlockStored(11, None, (1, 2)),
            BlockStored(12, 11, (3, 4)),
            BlockStored(21, 5, (9, 9)),
            BlockRemoved(12),
            CacheCleared(),
        ),
    )
    msg = vllm_kv_wire.kv_batch(batch)
    kinds = [e.WhichOneof("data") for e in msg.events]
    assert (msg.sequence_number, kinds) == (9, ["stored", "stored", "removed", "cleared"])
    assert [b.block_hash for b in msg.events[0].stored.blocks] == [11, 12] and not msg.events[0].stored.HasField(
        "parent_block_hash"
    )
    assert msg.events[1].stored.parent_block_hash == 5 and list(msg.events[2].removed.block_hashes) == [12]
    # Token ids are other callers' prompts: only when asked for (the gateway, an admin who asks).
    assert all(not b.token_ids and b.block_size == 2 for e in msg.events[:2] for b in e.stored.blocks)
    shown = vllm_kv_wire.kv_batch(batch, token_ids=True)
    assert [list(b.token_ids) for e in shown.events[:2] for b in e.stored.blocks] == [[1, 2], [3, 4], [9, 9]]


def test_requests_map_to_the_engine_request() -> None:
    params = vpb.SamplingParams(
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        repetition_penalty=1.1,
        max_tokens=30,
        min_tokens=2,
        stop=["\n"],
        stop_token_ids=[7],
        ignore_eos=True,
        n=2,
        logprobs=3,
        prompt_logprobs=0,
        seed=5,
        include_stop_str_in_output=True,
        skip_special_tokens=True,
    )
    params.logit_bias[9] = -1.0
    call = vllm_wire.generate_call(
        vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[1, 2]), sampling_params=params)
    )
    req = call.request
    assert (call.text, call.token_ids, call.stream, call.truncate_prompt_tokens) == (None, (1, 2), False, None)
    assert (req.request_id, req.temperature, req.top_k, req.n, req.seed, req.logprobs, req.prompt_logprobs) == (
        "r",
        1.0,
        5,
        2,
        5,
        3,
        0,
    )
    assert (req.top_p, req.min_p, req.repetition_penalty) == pytest.approx((0.9, 0.1, 1.1))
    assert (req.frequency_penalty, req.presence_penalty) == (0.5, 0.25)
    assert (req.max_tokens, req.min_tokens, req.stop, req.stop_token_ids, req.ignore_eos) == (
        30,
        2,
        ("\n",),
        (7,),
        True,
    )
    assert req.include_stop_str_in_output and req.skip_special_tokens and req.logit_bias == ((9, -1.0),)
    unset = vllm_wire.generate_call(vpb.GenerateRequest(text="hi")).request
    assert (unset.temperature, unset.max_tokens, unset.seed, unset.logprobs) == (1.0, 0, None, None)  # vLLM's defaults
