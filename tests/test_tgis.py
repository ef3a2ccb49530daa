"""The TGIS API (`fmaas.GenerationService`) on the scheduler's port, over the same engine.

In-suite tests talk through our own fmaas stubs to a real scheduler and tiny worker and
compare with the native `llmserve.v1.Generation` API; the last test runs the real TGIS client
stack (caikit-tgis-backend, in its own venv because it needs protobuf < 7) against the server.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import sys
from pathlib import Path

import grpc
import jsonschema
import pytest
from google.protobuf import descriptor_pb2

from common.pb.fmaas import generation_pb2 as tgis
from common.pb.fmaas import generation_pb2_grpc as tgis_grpc
from common.pb.llmserve.v1 import generation_pb2 as pb
from llmserve.cli.configs import cache_root
from scheduler_svc.api import tgis_wire
from scheduler_svc.engine.request import RequestOutput
from scheduler_svc.sched.sequence import FinishReason
from scheduler_svc.text.structured_output import StructuredOutput
from tests.conftest import REPO, Scheduler, collect, request
from tests.engine_state import first_scheduler
from tests.test_structured_output import PROMPT as GUIDED_PROMPT
from tests.test_structured_output import SCHEMAS

PROMPTS = ["Hello there, how are you?", "The capital of France is", "1, 2, 3, 4,"]
GRPCURL = str(Path(sys.executable).parent / "grpcurl")
CLIENT_DIR = REPO / "tests" / "tgis_client"


def stub(s: Scheduler) -> tgis_grpc.GenerationServiceStub:
    return tgis_grpc.GenerationServiceStub(s.channel)


def params(max_new_tokens: int = 10, **fields: object) -> tgis.Parameters:
    """GREEDY parameters; `fields` go to the stopping or response sub-message by name."""
    response_keys = set(tgis.ResponseOptions.DESCRIPTOR.fields_by_name)
    response = {k: v for k, v in fields.items() if k in response_keys}
    stopping = {k: v for k, v in fields.items() if k not in response_keys}
    return tgis.Parameters(
        stopping=tgis.StoppingCriteria(max_new_tokens=max_new_tokens, **stopping),  # type: ignore[arg-type]
        response=tgis.ResponseOptions(**response),  # type: ignore[arg-type]
    )


def single(text: str, p: tgis.Parameters) -> tgis.SingleGenerationRequest:
    return tgis.SingleGenerationRequest(model_id="any-name", request=tgis.GenerationRequest(text=text), params=p)


def batched(texts: list[str], p: tgis.Parameters) -> tgis.BatchedGenerationRequest:
    return tgis.BatchedGenerationRequest(
        model_id="any-name", requests=[tgis.GenerationRequest(text=t) for t in texts], params=p
    )


async def stream(s: Scheduler, req: tgis.SingleGenerationRequest) -> list[tgis.GenerationResponse]:
    return [m async for m in stub(s).GenerateStream(req)]


def token_texts(s: Scheduler, ids: list[int]) -> list[str]:
    return [s.engine.tokenizer.backend.id_to_token(t) for t in ids]


# ---- generation ----


async def test_stream_head_then_a_message_per_token_equal_to_the_native_api(tiny_scheduler: Scheduler) -> None:
    prompt = PROMPTS[0]
    native = await collect(tiny_scheduler.stub, request(prompt, max_tokens=10))
    messages = await stream(tiny_scheduler, single(prompt, params(10, generated_tokens=True)))
    head, body = messages[0], messages[1:]
    assert head.input_token_count == len(tiny_scheduler.engine.tokenizer.encode(prompt))
    assert (head.text, head.generated_token_count, head.stop_reason) == ("", 0, tgis.NOT_FINISHED)
    assert head.seed == 0  # greedy
    assert [m.generated_token_count for m in body] == list(range(1, len(native.token_ids) + 1))
    assert all(m.stop_reason == tgis.NOT_FINISHED for m in body[:-1])
    want = {pb.FINISH_REASON_LENGTH: tgis.MAX_TOKENS, pb.FINISH_REASON_STOP: tgis.EOS_TOKEN}[native.final.finish_reason]
    assert body[-1].stop_reason == want
    assert "".join(m.text for m in messages) == native.text
    assert [t.text for m in body for t in m.tokens] == token_texts(tiny_scheduler, native.token_ids)


async def test_batched_generate_runs_every_prompt_and_keeps_their_order(tiny_scheduler: Scheduler) -> None:
    natives = [await collect(tiny_scheduler.stub, request(p, max_tokens=8)) for p in PROMPTS]
    reply = await stub(tiny_scheduler).Generate(batched(PROMPTS, params(8, input_text=True, input_tokens=True)))
    assert len(reply.responses) == len(PROMPTS)
    for prompt, native, r in zip(PROMPTS, natives, reply.responses):
        ids = tiny_scheduler.engine.tokenizer.encode(prompt)
        assert r.text == prompt + native.text  # input_text echoes the prompt in front
        assert r.input_token_count == len(ids) == native.final.prompt_tokens
        assert [t.text for t in r.input_tokens] == token_texts(tiny_scheduler, ids)
        assert r.generated_token_count == len(native.token_ids)
        assert not r.tokens  # generated_tokens not asked for
    assert (await stub(tiny_scheduler).Generate(batched([], params()))).responses == []


async def test_max_new_tokens_zero_means_twenty(tiny_scheduler: Scheduler) -> None:
    reply = await stub(tiny_scheduler).Generate(batched(["1, 2, 3"], tgis.Parameters()))
    r = reply.responses[0]
    assert (r.generated_token_count, r.stop_reason) == (20, tgis.MAX_TOKENS)


async def test_stop_sequence_is_kept_by_default_and_dropped_on_request(tiny_scheduler: Scheduler) -> None:
    prompt = PROMPTS[1]
    base = (await stub(tiny_scheduler).Generate(batched([prompt], params(20)))).responses[0]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    before = text[: text.index(stop)]
    kept = (await stub(tiny_scheduler).Generate(batched([prompt], params(20, stop_sequences=[stop])))).responses[0]
    assert kept.stop_reason == tgis.STOP_SEQUENCE and kept.stop_sequence == stop
    assert kept.text == before + stop  # TGIS's server default: include_stop_sequence
    dropped = await stream(
        tiny_scheduler, single(prompt, params(20, stop_sequences=[stop], include_stop_sequence=False))
    )
    assert dropped[-1].stop_reason == tgis.STOP_SEQUENCE and dropped[-1].stop_sequence == stop
    assert "".join(m.text for m in dropped) == before


async def test_truncated_prompt_running_into_the_context_ends_with_token_limit(tiny_scheduler: Scheduler) -> None:
    max_len = tiny_scheduler.engine.limits.max_model_len
    text = " word" * (max_len + 100)
    ids = tiny_scheduler.engine.tokenizer.encode(text)
    assert len(ids) > max_len
    p = params(100)
    p.truncate_input_tokens = max_len - 5
    reply = (await stub(tiny_scheduler).Generate(batched([text], p))).responses[0]
    assert reply.input_token_count == max_len - 5
    native = await collect(tiny_scheduler.stub, request(ids=ids[-(max_len - 5) :], max_tokens=0))
    assert native.final.finish_reason == pb.FINISH_REASON_CONTEXT_LENGTH
    assert reply.text == native.text
    assert (reply.stop_reason, reply.generated_token_count) == (tgis.TOKEN_LIMIT, 5)


async def test_time_limit_ends_the_stream_and_frees_the_request(tiny_scheduler: Scheduler) -> None:
    messages = await stream(tiny_scheduler, single("1, 2, 3", params(400, time_limit_millis=300)))
    last = messages[-1]
    assert last.stop_reason == tgis.TIME_LIMIT, last
    assert 0 <= last.generated_token_count < 400
    assert last.generated_token_count == max(m.generated_token_count for m in messages)
    # the fixture then checks that every block is back in the pool


async def test_cancelled_stream_frees_its_blocks(tiny_scheduler: Scheduler) -> None:
    call = stub(tiny_scheduler).GenerateStream(single("1, 2, 3", params(400)))
    for _ in range(3):
        await call.read()
    assert first_scheduler(tiny_scheduler.engine).block_manager.num_used_blocks > 0
    call.cancel()
    await tiny_scheduler.wait_idle(10.0)


async def test_sampling_is_reproducible_from_the_reported_seed(tiny_scheduler: Scheduler) -> None:
    def sample(seed: int | None) -> tgis.Parameters:
        p = params(12)
        p.method = tgis.SAMPLE
        p.sampling.temperature = 1.5
        if seed is not None:
            p.sampling.seed = seed
        return p

    drawn = (await stub(tiny_scheduler).Generate(batched([PROMPTS[2]], sample(None)))).responses[0]
    assert drawn.seed != 0
    again = await stream(tiny_scheduler, single(PROMPTS[2], sample(drawn.seed)))
    assert again[0].seed == drawn.seed
    assert "".join(m.text for m in again) == drawn.text


@pytest.mark.parametrize(
    ("field", "edit"),
    [
        (
            "params.sampling.typical_p",
            lambda p: (setattr(p, "method", tgis.SAMPLE), setattr(p.sampling, "typical_p", 0.5)),
        ),
        (
            "params.response.token_ranks",
            lambda p: (setattr(p.response, "input_tokens", True), setattr(p.response, "token_ranks", True)),
        ),
        ("params.decoding.length_penalty", lambda p: p.decoding.length_penalty.SetInParent()),
    ],
)
async def test_unsupported_options_are_unimplemented_naming_the_field(
    tiny_scheduler: Scheduler, field: str, edit: object
) -> None:
    p = params(4)
    edit(p)  # type: ignore[operator]
    for call in (stub(tiny_scheduler).Generate(batched(["hi"], p)), stream(tiny_scheduler, single("hi", p))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert err.value.details().startswith(field + ":"), err.value.details()


# ---- guided decoding: structured outputs (tests/test_structured_output.py covers the engine) ----


def guided(seed: int | None = None, max_new_tokens: int = 160, **decoding: object) -> tgis.Parameters:
    """GREEDY, or SAMPLE at temperature 1 with `seed`, under a `decoding` guided constraint."""
    p = params(max_new_tokens)
    if seed is not None:
        p.method = tgis.SAMPLE
        p.sampling.seed = seed
    p.decoding.CopyFrom(tgis.DecodingParameters(**decoding))  # type: ignore[arg-type]
    return p


async def test_guided_decoding_outputs_follow_the_schema_regex_choices_or_grammar(tiny_scheduler: Scheduler) -> None:
    regex = r"[a-f]{3}-[0-9]{2,3}"
    choices = ["alpha", "beta", "gamma delta"]
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [1-9]'
    cases: list[tuple[str, dict[str, object], object]] = [
        *((f"schema {i}", {"json_schema": json.dumps(SCHEMAS[i])}, SCHEMAS[i]) for i in (1, 4, 11, 15, 17, 22, 31)),
        ("regex", {"regex": regex}, regex),
        ("choice", {"choice": tgis.DecodingParameters.StringChoices(choices=choices)}, choices),
        ("grammar", {"grammar": grammar}, r"\([1-9](\+[1-9])*\)"),
    ]

    def check(name: str, want: object, text: str, reason: int) -> None:
        assert reason == tgis.EOS_TOKEN, (name, text)  # the grammar completed
        if name.startswith("schema"):
            jsonschema.validate(json.loads(text), want)  # type: ignore[arg-type]
        elif name == "choice":
            assert text in want, text  # type: ignore[operator]
        else:
            assert re.fullmatch(want, text), (name, text)  # type: ignore[arg-type]

    prompts = [GUIDED_PROMPT, GUIDED_PROMPT + " now"]
    seeds = (None, 1, 2)
    calls = [stub(tiny_scheduler).Generate(batched(prompts, guided(seed, **d))) for _, d, _ in cases for seed in seeds]
    streams = [stream(tiny_scheduler, single(GUIDED_PROMPT, guided(3, **d))) for _, d, _ in cases]
    replies, streamed = await asyncio.gather(asyncio.gather(*calls), asyncio.gather(*streams))
    runs = [(name, want) for name, _, want in cases for _ in seeds]
    for (name, want), reply in zip(runs, replies):
        assert len(reply.responses) == len(prompts)
        for r in reply.responses:
            check(name, want, r.text, r.stop_reason)
    for (name, _, want), messages in zip(cases, streamed):
        check(name, want, "".join(m.text for m in messages), messages[-1].stop_reason)
    # The model's choice, not one fixed output per constraint: sampling gives other values.
    assert len({r.text for reply in replies for r in reply.responses}) > len(cases)


async def test_format_json_is_the_native_json_object_constraint(tiny_scheduler: Scheduler) -> None:
    """Any JSON object: the tiny model rarely closes a free key, so it runs into max_new_tokens
    here (tests/test_structured_output.py biases it to finish); greedy, it writes exactly
    what the native API's json_object writes."""
    reply = (
        await stub(tiny_scheduler).Generate(
            batched([GUIDED_PROMPT], guided(max_new_tokens=24, format=tgis.DecodingParameters.JSON))
        )
    ).responses[0]
    so = pb.StructuredOutput(json_object=True)
    req = request(GUIDED_PROMPT, max_tokens=24)
    req.structured_output.CopyFrom(so)
    native = await collect(tiny_scheduler.stub, req)
    assert reply.text == native.text and reply.text.lstrip().startswith("{")
    assert reply.generated_token_count == len(native.token_ids)
    free = await stub(tiny_scheduler).Generate(batched([GUIDED_PROMPT], params(24)))
    text = await stub(tiny_scheduler).Generate(
        batched([GUIDED_PROMPT], guided(max_new_tokens=24, format=tgis.DecodingParameters.TEXT))
    )
    assert text.responses[0].text == free.responses[0].text != reply.text  # TEXT: no constraint


async def test_invalid_guided_constraints_are_refused_naming_the_field(tiny_scheduler: Scheduler) -> None:
    cases: list[tuple[tgis.Parameters, str]] = [
        (guided(json_schema="{not json"), "params.decoding.json_schema"),
        (guided(json_schema='{"type": "no-such-type"}'), "params.decoding.json_schema"),  # the compiler's reason
        (guided(regex="(unclosed"), "params.decoding.regex"),
        (guided(grammar="root ::= undefined_rule"), "params.decoding.grammar"),
        (guided(choice=tgis.DecodingParameters.StringChoices()), "params.decoding.choice"),
        (guided(choice=tgis.DecodingParameters.StringChoices(choices=["a", ""])), "params.decoding.choice[1]"),
        (guided(format=7), "params.decoding.format"),  # type: ignore[arg-type]
        (guided(regex="[0-9]+"), "params.stopping.min_new_tokens"),
    ]
    cases[-1][0].stopping.min_new_tokens = 2
    for p, field in cases:
        for call in (stub(tiny_scheduler).Generate(batched(["hi"], p)), stream(tiny_scheduler, single("hi", p))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
            assert err.value.details().startswith(field + ":"), err.value.details()


async def test_token_logprobs_and_top_tokens_match_the_native_api(tiny_scheduler: Scheduler) -> None:
    p = params(5, generated_tokens=True, input_tokens=True, token_logprobs=True, top_n_tokens=2)
    messages = await stream(tiny_scheduler, single(PROMPTS[1], p))
    inputs = messages[0].input_tokens
    assert inputs and str(inputs[0].logprob) == "nan" and not inputs[0].top_tokens  # nothing precedes it
    assert all(t.logprob <= 0 and len(t.top_tokens) == 2 for t in inputs[1:])
    generated = [t for m in messages[1:] for t in m.tokens]
    native = await collect(tiny_scheduler.stub, request(PROMPTS[1], max_tokens=5, logprobs=2, prompt_logprobs=2))
    want = [e for m in native.messages for e in m.logprobs]
    assert [t.logprob for t in generated] == pytest.approx([e.logprob for e in want], abs=1e-6)
    assert [t.top_tokens[0].logprob for t in generated] == pytest.approx([e.top[0].logprob for e in want], abs=1e-6)
    assert [t.logprob for t in inputs[1:]] == pytest.approx(
        [e.logprob for e in native.messages[0].prompt_logprobs], abs=1e-6
    )
    batched_one = (await stub(tiny_scheduler).Generate(batched([PROMPTS[1]], p))).responses[0]
    assert [t.logprob for t in batched_one.tokens] == pytest.approx([t.logprob for t in generated], abs=1e-6)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream(tiny_scheduler, single(PROMPTS[1], params(2, generated_tokens=True, top_n_tokens=11)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_trace_headers_are_echoed(tiny_scheduler: Scheduler) -> None:
    metadata = (("x-request-id", "tgis-1"), ("x-correlation-id", "c-2"))
    call = stub(tiny_scheduler).GenerateStream(single(PROMPTS[0], params(3)), metadata=metadata)
    assert len([m async for m in call]) >= 2
    assert dict(await call.initial_metadata()) == dict(metadata)
    unary = stub(tiny_scheduler).Generate(batched(PROMPTS[:2], params(3)), metadata=metadata)
    assert len((await unary).responses) == 2
    assert dict(await unary.initial_metadata()) == dict(metadata)


async def test_unknown_adapters_prefixes_and_bad_input_are_refused(tiny_scheduler: Scheduler) -> None:
    req = single("hi", params(4))
    req.adapter_id = "my-lora"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream(tiny_scheduler, req)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "my-lora" in err.value.details()
    req = single("hi", params(4))
    req.prefix_id = "my-prompt-tuning"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream(tiny_scheduler, req)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and err.value.details().startswith("prefix_id:")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(tiny_scheduler).Generate(batched(["fine", ""], params(4)))  # one empty prompt fails the batch
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream(tiny_scheduler, single("hi", params(4, min_new_tokens=5)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_new_tokens" in err.value.details()
    # A batch larger than the queue takes is refused before a task is made per prompt.
    too_many = tiny_scheduler.engine.config.max_queue_len + 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(tiny_scheduler).Generate(batched(["a"] * too_many, params(4)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-queue-len" in err.value.details()
    assert tiny_scheduler.engine.num_requests == 0


def test_requests_map_to_the_engine_request() -> None:
    p = tgis_wire.params(
        tgis.Parameters(
            method=tgis.SAMPLE,
            sampling=tgis.SamplingParameters(top_k=5, top_p=0.9, seed=7),
            stopping=tgis.StoppingCriteria(
                max_new_tokens=30, min_new_tokens=3, stop_sequences=["\n"], time_limit_millis=1500
            ),
            decoding=tgis.DecodingParameters(repetition_penalty=1.2),
        )
    )
    req = p.generation_request([1, 2, 3], max_model_len=512, seed=7)
    assert (req.temperature, req.top_k, req.top_p, req.seed) == (1.0, 5, pytest.approx(0.9), 7)  # temperature 0 = 1.0
    assert (req.max_tokens, req.min_tokens, req.stop, req.include_stop_str_in_output) == (30, 3, ("\n",), True)
    assert req.repetition_penalty == pytest.approx(1.2) and p.time_limit == 1.5
    assert req.prompt_token_ids == (1, 2, 3) and not req.prompt
    # greedy ignores the sampling fields, as TGIS documents; a limit past the context runs to its end
    greedy = tgis_wire.params(tgis.Parameters(sampling=tgis.SamplingParameters(temperature=2.0, typical_p=0.3)))
    req = greedy.generation_request([1] * 500, max_model_len=512, seed=None)
    assert (req.temperature, req.max_tokens, greedy.max_new_tokens) == (0.0, 0, 20)
    assert greedy.generation_request([1] * 492, max_model_len=512, seed=None).max_tokens == 20
    assert req.structured_output is None


def test_guided_fields_map_to_the_engines_structured_output() -> None:
    def spec(**decoding: object) -> StructuredOutput | None:
        p = tgis_wire.params(tgis.Parameters(decoding=tgis.DecodingParameters(**decoding)))  # type: ignore[arg-type]
        return p.generation_request([1], max_model_len=64, seed=None).structured_output

    field = "params.decoding"
    assert spec(format=tgis.DecodingParameters.TEXT) is None
    assert spec(format=tgis.DecodingParameters.JSON) == StructuredOutput("json_object", field=field)
    assert spec(json_schema="{}") == StructuredOutput("json_schema", "{}", field=field)
    assert spec(regex="a+") == StructuredOutput("regex", "a+", field=field)
    assert spec(grammar='root ::= "a"') == StructuredOutput("grammar", 'root ::= "a"', field=field)
    choices = tgis.DecodingParameters.StringChoices(choices=["x", "y"])
    assert spec(choice=choices) == StructuredOutput("choice", choices=("x", "y"), field=field)


def test_stop_reasons() -> None:
    def out(reason: FinishReason | None) -> RequestOutput:
        return RequestOutput("r", [1], "x", reason, 1, 1)

    assert tgis_wire.stop_reason(out(None)) == tgis.NOT_FINISHED
    assert tgis_wire.stop_reason(out(FinishReason.LENGTH)) == tgis.MAX_TOKENS
    assert tgis_wire.stop_reason(out(FinishReason.STOP)) == tgis.EOS_TOKEN
    assert tgis_wire.stop_reason(out(FinishReason.STOP_SEQUENCE)) == tgis.STOP_SEQUENCE
    assert tgis_wire.stop_reason(out(FinishReason.CONTEXT_LENGTH)) == tgis.TOKEN_LIMIT
    assert tgis_wire.stop_reason(out(FinishReason.ABORTED)) == tgis.CANCELLED
    assert tgis_wire.stop_reason(tgis_wire.TimeLimit(3)) == tgis.TIME_LIMIT


# ---- tokenize, model info, reflection ----


async def test_tokenize_counts_tokens_and_offsets_with_truncation(tiny_scheduler: Scheduler) -> None:
    backend = tiny_scheduler.engine.tokenizer.backend
    reply = await stub(tiny_scheduler).Tokenize(
        tgis.BatchedTokenizeRequest(
            requests=[tgis.TokenizeRequest(text=t) for t in PROMPTS], return_tokens=True, return_offsets=True
        )
    )
    for text, r in zip(PROMPTS, reply.responses):
        enc = backend.encode(text, add_special_tokens=True)
        assert r.token_count == len(enc.ids) == len(tiny_scheduler.engine.tokenizer.encode(text))
        assert list(r.tokens) == enc.tokens
        assert [(o.start, o.end) for o in r.offsets] == enc.offsets
    short = await stub(tiny_scheduler).Tokenize(
        tgis.BatchedTokenizeRequest(requests=[tgis.TokenizeRequest(text=PROMPTS[0])], truncate_input_tokens=3)
    )
    assert short.responses[0].token_count == 3 and not short.responses[0].tokens


async def test_model_info(tiny_scheduler: Scheduler) -> None:
    info = await stub(tiny_scheduler).ModelInfo(tgis.ModelInfoRequest(model_id="whatever"))
    max_len = tiny_scheduler.engine.limits.max_model_len
    assert info.model_kind == tgis.ModelInfoResponse.DECODER_ONLY
    assert (info.max_sequence_length, info.max_new_tokens) == (max_len, max_len - 1)


async def grpcurl(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        GRPCURL, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_grpcurl_sees_the_tgis_service_through_reflection(tiny_scheduler: Scheduler) -> None:
    address = f"127.0.0.1:{tiny_scheduler.port}"
    assert "fmaas.GenerationService" in (await grpcurl("-plaintext", address, "list")).split()
    described = await grpcurl("-plaintext", address, "describe", "fmaas.GenerationService")
    assert (
        "rpc GenerateStream ( .fmaas.SingleGenerationRequest ) returns ( stream .fmaas.GenerationResponse );"
        in described
    )
    info = json.loads(await grpcurl("-plaintext", "-d", "{}", address, "fmaas.GenerationService/ModelInfo"))
    assert int(info["max_sequence_length"]) == tiny_scheduler.engine.limits.max_model_len


# ---- the real TGIS client stack ----


@pytest.fixture(scope="session")
def tgis_client_python() -> Path:
    """Python of the caikit-tgis-backend venv, created on first use (~30 s) and cached.

    CI runs this test, so an install failure fails it (with pip's output) instead of skipping.
    """
    import subprocess

    venv = cache_root() / "tgis-venv"
    proc = subprocess.run(
        ["bash", str(CLIENT_DIR / "setup_venv.sh"), str(venv), sys.executable],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        pytest.fail(f"could not create the TGIS client venv at {venv}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return venv / "bin" / "python"


async def test_caikit_tgis_backend_client_streams_what_the_native_api_generates(
    tgis_client_python: Path, tiny_scheduler: Scheduler
) -> None:
    prompt = PROMPTS[1]
    proc = await asyncio.create_subprocess_exec(
        str(tgis_client_python),
        str(CLIENT_DIR / "stream.py"),
        "--address",
        f"127.0.0.1:{tiny_scheduler.port}",
        "--prompt",
        prompt,
        "--max-new-tokens",
        "12",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, err.decode()[-5000:]
    got = json.loads(out)

    native = await collect(tiny_scheduler.stub, request(prompt, max_tokens=12))
    assert native.text
    assert got["stream_text"] == native.text
    head, *body, last = got["stream"]
    assert int(head["input_token_count"]) == native.final.prompt_tokens
    assert len(head["input_tokens"]) == native.final.prompt_tokens
    assert [t["text"] for m in body + [last] for t in m["tokens"]] == token_texts(tiny_scheduler, native.token_ids)
    assert last["stop_reason"] in ("MAX_TOKENS", "EOS_TOKEN")
    assert int(last["generated_token_count"]) == len(native.token_ids)
    unary = got["generate"]["responses"][0]
    assert unary["text"] == native.text and unary["stop_reason"] == last["stop_reason"]
    assert int(got["tokenize"]["responses"][0]["token_count"]) == native.final.prompt_tokens
    assert int(got["model_info"]["max_sequence_length"]) == tiny_scheduler.engine.limits.max_model_len

    # The generation.proto caikit-tgis-backend was built from is ours, field for field.
    theirs = descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(got["descriptor"]))
    ours = descriptor_pb2.FileDescriptorProto.FromString(tgis.DESCRIPTOR.serialized_pb)
    assert (ours.name, theirs.name) == ("fmaas/generation.proto", "generation.proto")
    theirs.name = ours.name
    assert ours == theirs
