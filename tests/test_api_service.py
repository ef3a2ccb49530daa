"""The public API beyond plain Generate, through the real services on real ports: the extra
RPCs, request ids in metadata, logprobs, logit processing and stopping options, and their
errors. After each test every KV block is back in the free pool (the fixture checks)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import grpc
import pytest

from common.pb.llmserve.v1 import generation_pb2 as pb
from tests.conftest import Scheduler, collect, request


async def greedy(s: Scheduler, ids: list[int], n: int = 6, **fields: object) -> list[int]:
    return (await collect(s.stub, request(ids=ids, max_tokens=n, ignore_eos=True, **fields))).token_ids


async def test_abort_rpc_cancels_a_stream_and_is_idempotent(tiny_scheduler: Scheduler) -> None:
    call = tiny_scheduler.stub.Generate(
        pb.GenerateRequest(
            request_id="long-1",
            prompt_token_ids=[5, 6, 7],
            stopping=pb.StoppingCriteria(max_tokens=450, ignore_eos=True),
        )
    )
    first = await call.read()
    assert first.request_id == "long-1"
    reply = await tiny_scheduler.stub.Abort(pb.AbortRequest(request_ids=["long-1", "nobody"]))
    assert list(reply.aborted) == ["long-1"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while True:
            msg = await call.read()
            assert msg is not grpc.aio.EOF, "the stream ended normally instead of CANCELLED"
    assert err.value.code() == grpc.StatusCode.CANCELLED
    again = await tiny_scheduler.stub.Abort(pb.AbortRequest(request_ids=["long-1"]))
    assert list(again.aborted) == []
    await tiny_scheduler.wait_idle()


async def test_tokenize_and_detokenize_round_trip(tiny_scheduler: Scheduler) -> None:
    stub = tiny_scheduler.stub
    tok = await stub.Tokenize(pb.TokenizeRequest(text="Hello world, again"))
    assert len(tok.token_ids) == len(tok.tokens) > 0
    text = await stub.Detokenize(pb.DetokenizeRequest(token_ids=tok.token_ids))
    assert text.text == "Hello world, again"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Detokenize(pb.DetokenizeRequest(token_ids=[10**7]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[0]" in (err.value.details() or "")
    # The tiny test model ships no chat template: messages are refused, naming the field.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="hi")]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat template" in (err.value.details() or "")


async def test_model_info_and_load(tiny_scheduler: Scheduler) -> None:
    stub = tiny_scheduler.stub
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_name == "tiny-llama" and info.vocab_size == 49152 and info.max_model_len == 512
    assert list(info.eos_token_ids) == [2] and info.block_size == 16 and not info.has_chat_template
    assert (info.limits.max_logprobs, info.limits.max_n, info.limits.max_stop_strings) == (20, 16, 16)
    call = stub.Generate(request(ids=[9, 9, 9], max_tokens=300, ignore_eos=True))
    await call.read()
    busy = await stub.GetLoad(pb.GetLoadRequest())
    assert busy.running == 1 and busy.groups[0].free_gpu_blocks < busy.groups[0].num_gpu_blocks
    call.cancel()
    await tiny_scheduler.wait_idle()
    idle = await stub.GetLoad(pb.GetLoadRequest())
    assert (idle.running, idle.waiting, idle.swapped) == (0, 0, 0)
    assert idle.groups[0].free_gpu_blocks == idle.groups[0].num_gpu_blocks
    await collect(stub, request(ids=[9, 9, 9], max_tokens=8, ignore_eos=True))
    await tiny_scheduler.wait_idle()
    measured = (await stub.GetLoad(pb.GetLoadRequest())).groups[0]
    assert measured.tokens_per_second > 0 and measured.running == 0  # kept while the group idles


async def test_request_id_metadata_is_echoed_and_never_a_key(tiny_scheduler: Scheduler) -> None:
    metadata = (("x-request-id", "abc-123"), ("x-correlation-id", "corr-9"))
    # Two calls may share a trace id: both are served.
    calls = [tiny_scheduler.stub.Generate(request(ids=[3, 4], max_tokens=2), metadata=metadata) for _ in range(2)]
    for call in calls:
        messages = [m async for m in call]
        headers = dict(await call.initial_metadata())
        assert headers["x-request-id"] == "abc-123" and headers["x-correlation-id"] == "corr-9"
        assert sum(len(m.token_ids) for m in messages) == 2 and messages[0].request_id  # a server-assigned request id
    assert (await calls[0].initial_metadata()) == (await calls[1].initial_metadata())
    # Without the header, the request's own id is echoed.
    call = tiny_scheduler.stub.Generate(
        pb.GenerateRequest(request_id="mine", prompt_token_ids=[3, 4], stopping=pb.StoppingCriteria(max_tokens=1))
    )
    assert [m.request_id async for m in call] == ["mine"]
    assert dict(await call.initial_metadata())["x-request-id"] == "mine"


async def test_logprobs_come_with_each_token(tiny_scheduler: Scheduler) -> None:
    gen = await collect(tiny_scheduler.stub, request(ids=[11, 12, 13], max_tokens=4, ignore_eos=True, logprobs=3))
    entries = [lp for m in gen.messages for lp in m.logprobs]
    assert [e.token_id for e in entries] == gen.token_ids
    for e in entries:
        assert len(e.top) == 3 and e.top[0].token_id == e.token_id  # greedy: the best one
        assert math.isclose(e.top[0].logprob, e.logprob, rel_tol=1e-6) and e.logprob <= 0
        assert e.top[0].logprob >= e.top[1].logprob >= e.top[2].logprob
    assert math.isclose(gen.final.cumulative_logprob, sum(e.logprob for e in entries), rel_tol=1e-5)
    plain = await collect(tiny_scheduler.stub, request(ids=[11, 12, 13], max_tokens=2))
    assert all(not m.logprobs for m in plain.messages)


async def test_logit_bias_steers_greedy_and_penalties_push_back(tiny_scheduler: Scheduler) -> None:
    """Exact values are checked against references in test_logits_processing; here, that each
    option reaches the worker and acts on the right tokens."""
    s = tiny_scheduler
    base = await greedy(s, [20, 21, 22], n=8)
    assert await greedy(s, [20, 21, 22], n=3, logit_bias={777: 100.0}) == [777, 777, 777]
    banned = await greedy(s, [20, 21, 22], n=8, logit_bias={base[0]: -100.0})
    assert banned[0] != base[0]
    # +100 keeps 777 on top until frequency (2 per occurrence) and presence (2) eat the bias.
    pushed = await greedy(s, [20, 21, 22], n=60, logit_bias={777: 100.0}, frequency_penalty=2.0, presence_penalty=2.0)
    first_other = next(i for i, t in enumerate(pushed) if t != 777)
    assert 10 < first_other < 50, pushed
    assert pushed == await greedy(
        s, [20, 21, 22], n=60, logit_bias={777: 100.0}, frequency_penalty=2.0, presence_penalty=2.0
    )
    # A repetition penalty divides the (biased, positive) logit of a token already in the prompt.
    assert (await greedy(s, [777, 777, 777], n=1, logit_bias={777: 100.0}))[0] == 777
    assert (await greedy(s, [777, 777, 777], n=1, logit_bias={777: 100.0}, repetition_penalty=1000.0))[0] != 777


async def test_min_tokens_bans_stop_tokens_until_reached(tiny_scheduler: Scheduler) -> None:
    s = tiny_scheduler
    base = await greedy(s, [30, 31, 32], n=4)
    stopped = await collect(s.stub, request(ids=[30, 31, 32], max_tokens=4, stop_token_ids=[base[0]]))
    assert stopped.token_ids == base[:1] and stopped.final.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.final.stop_token_id == base[0]
    held = await collect(s.stub, request(ids=[30, 31, 32], max_tokens=4, stop_token_ids=[base[0]], min_tokens=2))
    assert held.token_ids[0] != base[0] and len(held.token_ids) >= 2


async def test_include_stop_str_in_output_and_the_matched_stop(tiny_scheduler: Scheduler) -> None:
    s = tiny_scheduler
    plain = await collect(s.stub, request(ids=[40, 41], max_tokens=12, ignore_eos=True))
    stop = plain.text.strip()[2:5]
    assert stop, "the tiny model's text is too short for this test"
    cut = await collect(s.stub, request(ids=[40, 41], max_tokens=12, ignore_eos=True, stop=[stop]))
    kept = await collect(
        s.stub, request(ids=[40, 41], max_tokens=12, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    )
    assert cut.final.finish_reason == kept.final.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert cut.final.stop_sequence == kept.final.stop_sequence == stop
    assert not cut.text.endswith(stop) and kept.text == cut.text + stop


@pytest.mark.parametrize(
    ("fields", "code", "where"),
    [
        ({"min_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.min_p"),
        ({"presence_penalty": 3.0}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.presence_penalty"),
        ({"frequency_penalty": -2.5}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.frequency_penalty"),
        ({"logprobs": 21}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.logprobs"),
        ({"logit_bias": {10**7: 1.0}}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.logit_bias"),
        ({"logit_bias": {5: 500.0}}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.logit_bias"),
        ({"min_tokens": 9}, grpc.StatusCode.INVALID_ARGUMENT, "stopping.min_tokens"),
        ({"prompt_logprobs": 21}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.prompt_logprobs"),
        ({"beam_width": 2, "logprobs": 1}, grpc.StatusCode.UNIMPLEMENTED, "sampling.logprobs"),
        ({"beam_width": 2, "min_tokens": 2}, grpc.StatusCode.UNIMPLEMENTED, "stopping.min_tokens"),
        ({"beam_width": 2, "repetition_penalty": 1.2}, grpc.StatusCode.UNIMPLEMENTED, "sampling.repetition_penalty"),
        ({"beam_width": 2, "logit_bias": {5: 1.0}}, grpc.StatusCode.UNIMPLEMENTED, "sampling.logit_bias"),
    ],
)
async def test_bad_processing_options_are_refused(
    tiny_scheduler: Scheduler, fields: dict, code: grpc.StatusCode, where: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(tiny_scheduler.stub, request(ids=[5, 6], max_tokens=8, **fields))
    assert err.value.code() == code and where in (err.value.details() or "")


async def test_messages_and_prompt_are_exclusive(tiny_scheduler: Scheduler) -> None:
    req = request("hello", max_tokens=2)
    req.messages.append(pb.ChatMessage(role="user", content="hi"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(tiny_scheduler.stub, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exactly one" in (err.value.details() or "")


def test_chat_template_renders_like_transformers(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    from scheduler_svc.text.chat_template import ChatTemplate

    template = ChatTemplate.from_dir(smollm2_dir)
    assert template is not None
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    for conversation in (
        [("user", "What is 2+2?")],
        [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")],
    ):
        want = tok.apply_chat_template(
            [{"role": r, "content": c} for r, c in conversation], tokenize=False, add_generation_prompt=True
        )
        assert template.render(conversation) == want


async def test_concurrent_aborts_leave_nothing_behind(tiny_scheduler: Scheduler) -> None:
    stub = tiny_scheduler.stub
    calls = [
        stub.Generate(
            pb.GenerateRequest(
                request_id=f"c{i}",
                prompt_token_ids=[7, 8, 9 + i],
                stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True),
            )
        )
        for i in range(6)
    ]
    await asyncio.gather(*(c.read() for c in calls))
    reply = await stub.Abort(pb.AbortRequest(request_ids=[f"c{i}" for i in range(6)]))
    assert sorted(reply.aborted) == [f"c{i}" for i in range(6)]
    for c in calls:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await c.read() is not grpc.aio.EOF:
                pass
        assert err.value.code() == grpc.StatusCode.CANCELLED
    await tiny_scheduler.wait_idle()


async def test_seeded_sampling_is_the_same_alone_and_among_16_others(tiny_scheduler: Scheduler) -> None:
    stub = tiny_scheduler.stub
    seeded = request(
        ids=[50, 51, 52, 53], max_tokens=12, ignore_eos=True, temperature=1.0, seed=4242, top_k=50, min_p=0.01
    )
    alone = await collect(stub, seeded)
    others = [
        request(
            ids=[60 + i, 61, 62],
            max_tokens=12 + i,
            ignore_eos=True,
            temperature=1.0 + i / 10,
            seed=i,
            top_p=0.9,
            presence_penalty=0.5,
        )
        for i in range(16)
    ]
    together = await asyncio.gather(collect(stub, seeded), *(collect(stub, r) for r in others))
    assert together[0].token_ids == alone.token_ids and together[0].text == alone.text
    assert len({tuple(g.token_ids) for g in together}) == 17  # and everyone drew their own


async def test_prompt_logprobs_match_transformers(tiny_model_dir: Path, tiny_worker) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import start_scheduler, stop_scheduler

    prompt = [300 + (17 * k) % 500 for k in range(37)]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)  # [37, vocab]
    # A 16-token budget splits the prompt into chunks: the scores must cross chunk boundaries.
    s = await start_scheduler(tiny_model_dir, tiny_worker.address, max_num_batched_tokens=16)
    try:
        await s.wait_ready()
        for _ in range(2):  # the second run would be a prefix-cache hit; scores need the whole prompt
            gen = await collect(s.stub, request(ids=prompt, max_tokens=3, ignore_eos=True, prompt_logprobs=2))
            entries = gen.messages[0].prompt_logprobs
            assert [e.token_id for e in entries] == prompt[1:]
            for pos, e in enumerate(entries, start=1):
                assert abs(e.logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
                values, ids = ref[pos - 1].topk(2)
                assert [t.token_id for t in e.top] == ids.tolist()
                assert all(abs(t.logprob - v) < 1e-4 for t, v in zip(e.top, values.tolist()))
            assert all(not m.prompt_logprobs for m in gen.messages[1:])
        await s.wait_idle()
    finally:
        await stop_scheduler(s)
