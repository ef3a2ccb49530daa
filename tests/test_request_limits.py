"""Every RequestLimits bound: accepted at the limit, refused just over it with INVALID_ARGUMENT
(or RESOURCE_EXHAUSTED) naming the limit and the flag that raises it; and the grammar
compiler's process: timeouts, cancels, the byte-bounded cache, the token-mask budget.

tests/test_hostile_input.py sends the same kinds of input to a real scheduler over gRPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from common.config import SchedulerConfig
from common.errors import InvalidArgument, ResourceExhausted
from common.model_spec import ModelSpec
from common.request_limits import RequestLimits
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.request import GenerationRequest, Limits, check_fields
from scheduler_svc.lora.adapter_registry import MAX_NAME_LENGTH
from scheduler_svc.text.grammar import MAX_WAITING_COMPILES, GrammarCompiler
from scheduler_svc.text.grammar_cache import GrammarCache
from scheduler_svc.text.grammar_matcher import MASK_BUDGET_S, fill_masks
from scheduler_svc.text.input_limits import flag_of
from scheduler_svc.text.structured_output import StructuredOutput, json_depth
from scheduler_svc.text.tokenizer import Tokenizer

VOCAB = 49152
SMALL = RequestLimits(
    max_prompt_bytes=100,
    max_tokenize_bytes=50,
    max_detokenize_tokens=10,
    max_stop_string_length=8,
    max_stop_token_ids=3,
    max_logit_bias=4,
    max_grammar_bytes=200,
    max_grammar_depth=5,
)


def limits(**request: int) -> Limits:
    return Limits(vocab_size=VOCAB, max_model_len=512, request=dataclasses.replace(SMALL, **request))


def req(**fields: object) -> GenerationRequest:
    return GenerationRequest(**{"request_id": "r", "prompt": "hi", **fields})  # type: ignore[arg-type]


def refused(fields: dict[str, object], name: str, field: str, lim: Limits | None = None) -> None:
    with pytest.raises(InvalidArgument) as error:
        check_fields(req(**fields), lim or limits())
    assert error.value.field == field and name in str(error.value) and flag_of(name) in str(error.value)


# ---- request fields ----


def test_prompt_bytes_count_utf8_of_the_text_and_of_the_whole_conversation() -> None:
    check_fields(req(prompt="a" * 100), limits())
    refused({"prompt": "a" * 101}, "max_prompt_bytes", "prompt")
    check_fields(req(prompt="é" * 50), limits())  # 2 bytes each: 100
    refused({"prompt": "é" * 50 + "a"}, "max_prompt_bytes", "prompt")
    check_fields(req(prompt="", messages=(("user", "a" * 46), ("assistant", "b" * 41))), limits())  # 4+46+9+41
    refused({"prompt": "", "messages": (("user", "a" * 46), ("assistant", "b" * 42))}, "max_prompt_bytes", "messages")


def test_stop_strings_each_within_max_stop_string_length() -> None:
    check_fields(req(stop=("x" * 8, "y")), limits())
    refused({"stop": ("y", "x" * 9)}, "max_stop_string_length", "stopping.stop[1]")


def test_stop_token_ids_and_logit_bias_are_counted_before_they_are_walked() -> None:
    check_fields(req(stop_token_ids=(1, 2, 3)), limits())
    refused({"stop_token_ids": (1, 2, 3, 4)}, "max_stop_token_ids", "stopping.stop_token_ids")
    refused({"stop_token_ids": (1,)}, "max_stop_token_ids", "stopping.stop_token_ids", limits(max_stop_token_ids=0))
    # Counted first: a million ids is refused on its count, not id by id.
    refused({"stop_token_ids": tuple(range(10**6))}, "max_stop_token_ids", "stopping.stop_token_ids")
    check_fields(req(logit_bias=tuple((t, 1.0) for t in range(4))), limits())
    refused({"logit_bias": tuple((t, 1.0) for t in range(5))}, "max_logit_bias", "sampling.logit_bias")


def test_prompt_token_ids_beyond_the_context_are_refused_on_their_count() -> None:
    ids = tuple(range(511))
    check_fields(req(prompt="", prompt_token_ids=ids), limits())
    with pytest.raises(InvalidArgument, match="leave no room") as error:
        check_fields(req(prompt="", prompt_token_ids=(*ids, 10**9)), limits())  # the bad id is never reached
    assert error.value.field == "prompt"
    with pytest.raises(InvalidArgument, match=r"prompt_token_ids\[1\]: token id 49152"):
        check_fields(req(prompt="", prompt_token_ids=(1, VOCAB)), limits())


def test_an_adapter_name_is_short() -> None:
    check_fields(req(adapter_id="a" * MAX_NAME_LENGTH), limits())  # the longest a LoadAdapter takes
    with pytest.raises(InvalidArgument, match=f"adapter_id: at most {MAX_NAME_LENGTH} characters"):
        check_fields(req(adapter_id="a" * (4 << 20)), limits())


# ---- structured outputs, before any compiler ----


def _schema_of_size(size: int) -> str:
    """A valid JSON schema of exactly `size` bytes."""
    head = '{"type": "string", "description": "'
    return head + "x" * (size - len(head) - 2) + '"}'


def _nested(depth: int) -> str:
    """A schema nesting objects `depth` deep: arrays of arrays, `{}` innermost."""
    return '{"items": ' * (depth - 1) + "{}" + "}" * (depth - 1)


def test_grammar_text_within_max_grammar_bytes_whatever_its_kind() -> None:
    lim = limits(max_grammar_bytes=200).request
    StructuredOutput("json_schema", _schema_of_size(200)).check(lim)
    for so in (
        StructuredOutput("json_schema", _schema_of_size(201)),
        StructuredOutput("regex", "a" * 201),
        StructuredOutput("grammar", 'root ::= "' + "a" * 190 + '"'),
        StructuredOutput("choice", choices=("a" * 100, "b" * 101)),
    ):
        with pytest.raises(InvalidArgument) as error:
            so.check(lim)
        assert error.value.field == f"structured_output.{so.kind}"
        assert "max_grammar_bytes (200)" in str(error.value) and "--max-grammar-bytes" in str(error.value)
    StructuredOutput("choice", choices=("a" * 100, "b" * 100)).check(lim)


def test_json_schema_depth_within_max_grammar_depth_without_recursion() -> None:
    lim = RequestLimits(max_grammar_depth=5)
    assert json_depth(json.loads(_nested(5))) == 5 and json_depth(7) == 0 and json_depth({}) == 1
    StructuredOutput("json_schema", _nested(5)).check(lim)
    with pytest.raises(InvalidArgument, match="nested 6 levels deep exceed max_grammar_depth \\(5\\)") as error:
        StructuredOutput("json_schema", _nested(6)).check(lim)
    assert "--max-grammar-depth" in str(error.value)
    # 2,000 deep used to be INTERNAL (RecursionError in json.loads); 100,000 deep too, with
    # room for its bytes.
    deep = RequestLimits(max_grammar_bytes=2 << 20)
    for depth in (2_000, 100_000):
        with pytest.raises(InvalidArgument, match="max_grammar_depth") as error:
            StructuredOutput("json_schema", _nested(depth)).check(deep)
        assert error.value.field == "structured_output.json_schema"


def test_the_limits_travel_with_the_request_to_the_structured_output() -> None:
    so = StructuredOutput("json_schema", _nested(6))
    refused({"structured_output": so}, "max_grammar_depth", "structured_output.json_schema")
    check_fields(req(structured_output=so), limits(max_grammar_depth=6))


def test_limits_of_a_config_carry_its_request_limits(tiny_model_dir: Path) -> None:
    config = SchedulerConfig(limits=SMALL)
    assert Limits.of(ModelSpec.from_dir(tiny_model_dir), config).request is SMALL


# ---- the tokenizer, off the event loop ----


@pytest.fixture
def engine(tiny_model_dir: Path) -> Engine:
    spec = ModelSpec.from_dir(tiny_model_dir)
    return Engine(spec, Tokenizer(tiny_model_dir), SchedulerConfig(limits=SMALL), None)


async def test_prompt_text_is_refused_before_any_tokenizer_call(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    encode = engine.tokenizer.encode

    def counted(text: str, add_special_tokens: bool = True) -> list[int]:
        calls.append(text)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(engine.tokenizer, "encode", counted)
    assert await engine.prompt_tokens("a" * 100, (), ()) == encode("a" * 100)
    with pytest.raises(InvalidArgument, match="--max-prompt-bytes"):
        await engine.prompt_tokens("a" * 101, (), ())
    # Tokenize's own limit, for a text or a conversation.
    with pytest.raises(InvalidArgument, match="max_tokenize_bytes \\(50\\)"):
        await engine.prompt_tokens("", (), (("user", "a" * 47),), limit="max_tokenize_bytes")
    assert calls == ["a" * 100]


async def test_tokenize_and_detokenize_limits(tiny_model_dir: Path) -> None:
    tok = Tokenizer(tiny_model_dir)
    assert await tok.encode_within("text", "a" * 50, True, SMALL) == tok.encode("a" * 50)
    with pytest.raises(InvalidArgument, match="text: 51 bytes exceed max_tokenize_bytes \\(50\\)"):
        await tok.encode_within("text", "a" * 51, True, SMALL)
    ids = tok.encode("hello world, how are you", add_special_tokens=False)[:10]
    assert await tok.decode_within(ids + [5] * (10 - len(ids)), True, SMALL, VOCAB) == tok.decode(
        ids + [5] * (10 - len(ids))
    )
    with pytest.raises(InvalidArgument, match="token_ids: 11 tokens exceed max_detokenize_tokens") as error:
        await tok.decode_within([5] * 11, True, SMALL, VOCAB)
    assert "--max-detokenize-tokens" in str(error.value)
    with pytest.raises(InvalidArgument, match=r"token_ids\[2\]: token id 49152 is outside"):
        await tok.decode_within([1, 2, VOCAB], True, SMALL, VOCAB)


async def test_a_long_tokenization_leaves_the_event_loop_free(tiny_model_dir: Path) -> None:
    """tokenizers holds the GIL through `encode`; the batch form used here does not."""
    tok = Tokenizer(tiny_model_dir)
    text = "the quick brown fox jumps over the lazy dog " * 12_000  # 528 KB: 0.3 s on one core
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    ticker = asyncio.create_task(tick())
    loop = asyncio.get_running_loop()
    start = loop.time()
    ids = await tok.encode_off_loop(text)
    took = loop.time() - start
    ticker.cancel()
    assert len(ids) > 100_000
    # Held GIL: no tick at all while it ran. Free: about took / 5 ms of them.
    assert ticks >= took / 0.005 / 4, (ticks, took)


# ---- the grammar compiler ----


@pytest.fixture(scope="module")
def compiler(smollm2_dir: Path) -> Iterator[GrammarCompiler]:
    gc = GrammarCompiler(str(smollm2_dir), VOCAB, frozenset({2}), 4)
    yield gc
    gc.close()


MAX_LENGTH = StructuredOutput("json_schema", json.dumps({"type": "string", "maxLength": 100_000}))


def test_a_compile_past_its_timeout_is_refused_and_the_next_one_works(compiler: GrammarCompiler) -> None:
    compiler.compile(StructuredOutput("regex", "[0-9]+"))  # the child has started
    with pytest.raises(ResourceExhausted) as error:
        compiler.compile(MAX_LENGTH, RequestLimits(grammar_compile_timeout=0.2))  # 1.8 s of CPU
    assert str(error.value) == (
        "structured_output.json_schema: grammar compile took longer than 0.2 s; raise --grammar-compile-timeout"
    )
    assert compiler.compile(StructuredOutput("regex", "[a-f]+"), RequestLimits(grammar_compile_timeout=60))


async def test_a_cancelled_request_ends_its_compile(compiler: GrammarCompiler) -> None:
    compiler.compile(StructuredOutput("regex", "[0-9]+"))
    process = compiler._process  # noqa: SLF001
    assert process is not None
    first = process.pid
    spec = StructuredOutput("json_schema", json.dumps({"type": "string", "maxLength": 100_001}))
    task = asyncio.create_task(compiler.grammar_off_loop(spec, RequestLimits()))
    await asyncio.sleep(0.5)  # compiling by now (no wait for a start: it was ready)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if process.pid != first:
            break
        await asyncio.sleep(0.02)
    assert process.pid != first  # killed, and another started
    assert compiler.cache.get(spec.digest) is None
    assert await compiler.grammar_off_loop(StructuredOutput("regex", "[g-k]+"), RequestLimits())


async def _until(condition: Callable[[], bool], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_slow_compile_leaves_a_bounded_queue_and_cached_grammars_are_served(
    compiler: GrammarCompiler,
) -> None:
    """One compile at a time: behind a slow one, MAX_WAITING_COMPILES new grammars wait and the
    next is refused at once (a client sending many slow grammars used to queue everyone's new
    ones behind his, forever); a cached grammar is served meanwhile, a grammar already waiting
    rides along, and a cancelled waiter leaves the queue."""
    assert MAX_WAITING_COMPILES == 64
    cached = StructuredOutput("regex", "[0-9]+")
    compiler.compile(cached)
    compiler.compile(StructuredOutput("regex", "[q-u]+"))  # new: the child has started
    lane, process = compiler._lane, compiler._process  # noqa: SLF001
    assert process is not None
    slow = StructuredOutput("json_schema", json.dumps({"type": "string", "maxLength": 100_002}))  # 1.8 s of CPU
    patient = RequestLimits(grammar_compile_timeout=60)
    holder = asyncio.create_task(compiler.grammar_off_loop(slow, patient))
    await _until(lambda: process._running is not None)  # noqa: SLF001 - in the child: a cancel kills it
    assert lane.busy
    tasks = [
        asyncio.create_task(compiler.grammar_off_loop(StructuredOutput("regex", f"w{i}[a-z]+"), patient))
        for i in range(MAX_WAITING_COMPILES)
    ]
    try:
        await _until(lambda: lane.waiting == MAX_WAITING_COMPILES)
        start = time.monotonic()
        with pytest.raises(ResourceExhausted) as error:
            await asyncio.wait_for(compiler.grammar_off_loop(StructuredOutput("regex", "one[a-z]+more"), patient), 20)
        assert time.monotonic() - start < 1.0  # at once, not after the slow compile
        assert str(error.value) == "structured_output.regex: 64 grammar compiles are already waiting; retry later"
        with pytest.raises(ResourceExhausted, match="64 grammar compiles are already waiting"):
            compiler.compile(StructuredOutput("grammar", 'root ::= "x"'), patient)  # the blocking form too
        assert await compiler.grammar_off_loop(cached, patient) and compiler.compile(cached, patient)
        tasks.append(asyncio.create_task(compiler.grammar_off_loop(StructuredOutput("regex", "w0[a-z]+"), patient)))
        # A cancelled waiter leaves the queue at once, and its place is free.
        tasks[3].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[3]
        assert lane.waiting == MAX_WAITING_COMPILES - 1
        tasks[3] = asyncio.create_task(compiler.grammar_off_loop(StructuredOutput("regex", "late[a-z]+"), patient))
        await _until(lambda: lane.waiting == MAX_WAITING_COMPILES)
        assert lane.busy and not holder.done() and not any(t.done() for t in tasks)  # all behind the slow one
    finally:
        holder.cancel()  # its child is killed: the waiters go on with the next one
    with pytest.raises(asyncio.CancelledError):
        await holder
    assert all(await asyncio.gather(*tasks))
    assert lane.waiting == 0 and not lane.busy and compiler.cache.get(slow.digest) is None
    assert compiler.cache.get(StructuredOutput("regex", "w3[a-z]+").digest) is None  # the cancelled one never ran


async def test_a_compile_that_waits_past_the_timeout_is_refused(compiler: GrammarCompiler) -> None:
    compiler.compile(StructuredOutput("regex", "[0-9]+"))
    lane = compiler._lane  # noqa: SLF001
    held = object()  # the lane taken as a slow compile takes it, for as long as the test likes
    assert lane.join(held, b"held", lambda turn: True) and lane.busy
    spec = StructuredOutput("regex", "[l-p]+")
    try:
        start = time.monotonic()
        with pytest.raises(ResourceExhausted) as error:
            await asyncio.wait_for(compiler.grammar_off_loop(spec, RequestLimits(grammar_compile_timeout=0.3)), 20)
        assert 0.3 <= time.monotonic() - start < 10
        assert str(error.value) == (
            "structured_output.regex: waited 0.3 s (--grammar-compile-timeout) for other grammar compiles to end; "
            "retry later"
        )
        with pytest.raises(ResourceExhausted, match="waited 0.2 s"):
            compiler.compile(spec, RequestLimits(grammar_compile_timeout=0.2))  # the blocking form too
        assert lane.waiting == 0 and lane.busy
    finally:
        lane.release(held)
    assert await compiler.grammar_off_loop(spec, RequestLimits()) and not lane.busy


def test_the_cache_is_bounded_in_bytes_and_keyed_by_a_hash() -> None:
    cache = GrammarCache()
    cache.put(b"a", "A", 40, budget=100)
    cache.put(b"b", "B", 60, budget=100)  # exactly the budget: both kept
    assert (len(cache), cache.size_bytes) == (2, 100)
    assert cache.get(b"a") == "A"  # now the most recent
    cache.put(b"c", "C", 1, budget=100)  # one over: the least recent (b) goes
    assert cache.get(b"b") is None and cache.get(b"a") == "A" and cache.get(b"c") == "C"
    cache.put(b"d", "D", 101, budget=100)  # bigger than the whole budget: not kept
    assert cache.get(b"d") is None and cache.size_bytes == 41
    so = StructuredOutput("regex", "x" * 1000)
    assert len(so.digest) == 32 and so.digest == StructuredOutput("regex", "x" * 1000, field="other").digest


def test_a_compiled_grammar_over_an_eighth_of_the_cache_is_refused(compiler: GrammarCompiler) -> None:
    spec = StructuredOutput("json_schema", '{"type": "object", "properties": {"n": {"type": "integer"}}}')
    size = int(compiler.compile(spec).memory_size_bytes)
    assert 100_000 < size < 8 << 20  # a small schema: its token-mask cache, about 1.4 MB
    compiler.cache.clear()
    assert compiler.compile(spec, RequestLimits(grammar_cache_bytes=8 * size))  # exactly the share
    compiler.cache.clear()
    with pytest.raises(ResourceExhausted, match="over 1/8 of --grammar-cache-mb"):
        compiler.compile(spec, RequestLimits(grammar_cache_bytes=8 * size - 8))
    assert compiler.cache.size_bytes == 0


def test_a_grammar_whose_masks_grow_too_slow_fails_and_normal_ones_do_not(compiler: GrammarCompiler) -> None:
    """An ambiguous regex costs ~15 ms more per token of mask: it fails at the first mask over
    the budget; JSON schemas beside it take well under a millisecond."""
    normal = [
        compiler.grammar(StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "string"}}}'))
        for _ in range(8)
    ]
    bad = compiler.grammar(StructuredOutput("regex", "([a-z]{0,1000}){0,1000}"))
    rng = np.random.default_rng(0)
    for _ in range(60):
        live = [g for g in [*normal, bad] if g.failure is None and not g.terminated]
        masks = fill_masks(live)
        for g, row in zip(live, masks, strict=True):
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB])
            choices = allowed[allowed != 2]
            g.accept(int(rng.choice(choices if len(choices) else allowed)))
        if bad.failure is not None:
            break
    assert bad.failure is not None and "over the 50 ms a step may spend on one" in str(bad.failure)
    assert not bad.accept(ord("a")) and all(g.failure is None for g in normal)
    assert MASK_BUDGET_S == 0.05
