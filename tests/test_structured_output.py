"""Structured outputs through the real services: a JSON schema, any JSON object, a regex, a
list of choices or an EBNF grammar constrains every sampled token.

The tiny random-weight model would write nothing parseable on its own, so every valid output
here is the grammar's doing: each is checked with `jsonschema`, `re.fullmatch`, membership or
the grammar's own parser, greedy and sampled at temperature 1 with several seeds, and every KV
block is free afterwards (the tiny_scheduler fixture checks it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import numpy as np
import pytest
import torch

from common.config import SchedulerConfig
from common.pb.llmserve.v1 import generation_pb2 as pb
from common.pb.llmserve.v1 import worker_pb2 as worker_pb
from common.plan import SamplingBatch
from scheduler_svc.text.grammar import GrammarCompiler
from scheduler_svc.text.grammar_matcher import fill_masks
from scheduler_svc.text.structured_output import StructuredOutput
from tests.conftest import Scheduler, collect, request
from tests.plans import Feed, make_plan
from worker_svc.sampling.logits_processor import process_logits, processed_rows
from worker_svc.sampling.sampler import sample

# Strings are bounded (maxLength, enum, pattern): a random model inside a free string picks
# a closing quote about once in the vocabulary's size.
SCHEMAS: list[dict[str, object]] = [
    {"type": "boolean"},
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, 2, 3, "many"]},
    {"const": "fixed"},
    {"type": "string", "maxLength": 5},
    {"type": "string", "pattern": "^[a-z]{2,4}$"},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "null"},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 2},
    {
        "type": "array",
        "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}],
        "items": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "admin": {"type": "boolean"},
        },
        "required": ["name", "admin"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "shade": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -1, "maximum": 1},
            "y": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "active": {"type": "boolean"}},
                "required": ["id", "active"],
                "additionalProperties": False,
            },
            "role": {"enum": ["admin", "guest"]},
        },
        "required": ["user", "role"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
        "required": [],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"}, "note": {"type": "null"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"q": {"type": "integer", "minimum": 1, "maximum": 5}},
                    "required": ["q"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"level": {"type": "integer", "enum": [1, 5, 10]}, "label": {"type": "string", "maxLength": 3}},
        "required": ["level", "label"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "boolean"}]},
    {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]}},
        "required": ["v"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 1},
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 100},
            "flag": {"type": "boolean"},
            "kind": {"const": "k"},
        },
        "required": ["ratio", "flag", "kind"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "deep": {
                "type": "object",
                "properties": {
                    "deeper": {
                        "type": "object",
                        "properties": {"z": {"type": "boolean"}},
                        "required": ["z"],
                        "additionalProperties": False,
                    }
                },
                "required": ["deeper"],
                "additionalProperties": False,
            }
        },
        "required": ["deep"],
        "additionalProperties": False,
    },
]

# A text prompt: the output's text then starts at a character boundary (random prompt ids may
# end inside a multi-byte character, which the first output text would show).
PROMPT = "Answer in the required format:"


def constrained(
    structured: pb.StructuredOutput, temperature: float = 0.0, seed: int = 0, **kw: object
) -> pb.GenerateRequest:
    req = request(PROMPT, max_tokens=int(kw.pop("max_tokens", 160)), temperature=temperature, seed=seed, **kw)
    req.structured_output.CopyFrom(structured)
    return req


def test_there_are_at_least_30_schemas_and_each_is_a_valid_schema() -> None:
    assert len(SCHEMAS) >= 30
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)


async def test_json_schemas_greedy_and_sampled_outputs_validate(tiny_scheduler: Scheduler) -> None:
    runs = [(i, t, seed) for i in range(len(SCHEMAS)) for t, seed in ((0.0, 0), (1.0, 1), (1.0, 2))]
    results = await asyncio.gather(
        *(
            collect(tiny_scheduler.stub, constrained(pb.StructuredOutput(json_schema=json.dumps(SCHEMAS[i])), t, seed))
            for i, t, seed in runs
        )
    )
    outputs: set[str] = set()
    for (i, t, seed), got in zip(runs, results):
        assert got.final.finish_reason == pb.FINISH_REASON_STOP, (SCHEMAS[i], t, seed, got.text)
        value = json.loads(got.text)
        jsonschema.validate(value, SCHEMAS[i])
        outputs.add(got.text)
    # The model's choice, not one fixed output per schema: sampling gives other values.
    assert len(outputs) > len(SCHEMAS)


async def test_json_object_regex_choice_and_grammar(tiny_scheduler: Scheduler) -> None:
    regex = r"[a-f]{3}-[0-9]{2,3}"
    choices = ["alpha", "beta", "gamma delta"]
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [1-9]'
    cases = []
    for t, seed in ((0.0, 0), (1.0, 3), (1.0, 4), (1.0, 5)):
        cases += [
            # Keys and string values are free here: a bias on the closing quote and brace
            # (SmolLM2's tokenizer) ends them sooner; what is valid is still the grammar's call.
            ("object", constrained(pb.StructuredOutput(json_object=True), t, seed, logit_bias={18: 8.0, 109: 8.0})),
            ("regex", constrained(pb.StructuredOutput(regex=regex), t, seed)),
            ("choice", constrained(pb.StructuredOutput(choice=pb.Choices(choices=choices)), t, seed)),
            ("grammar", constrained(pb.StructuredOutput(grammar=grammar), t, seed)),
        ]
    results = await asyncio.gather(*(collect(tiny_scheduler.stub, r) for _, r in cases))
    for (kind, _), got in zip(cases, results):
        assert got.final.finish_reason == pb.FINISH_REASON_STOP, (kind, got.text)
        if kind == "object":
            assert isinstance(json.loads(got.text), dict)
        elif kind == "regex":
            assert re.fullmatch(regex, got.text), got.text
        elif kind == "choice":
            assert got.text in choices
        else:
            assert re.fullmatch(r"\([1-9](\+[1-9])*\)", got.text), got.text


async def test_n_samples_each_follow_the_grammar(tiny_scheduler: Scheduler) -> None:
    schema = SCHEMAS[17]
    got = await collect(
        tiny_scheduler.stub, constrained(pb.StructuredOutput(json_schema=json.dumps(schema)), 1.0, 7, n=3)
    )
    texts: dict[int, str] = {}
    for m in got.messages:
        texts[m.index] = texts.get(m.index, "") + m.text
    assert sorted(texts) == [0, 1, 2]
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)


async def test_a_tiny_pool_preempts_constrained_sequences_and_they_stay_valid(tiny_scheduler: Scheduler) -> None:
    """24 long constrained outputs on the 64-block pool: they preempt one another (swap or
    recompute) mid-grammar, and each resumes where its matcher stood."""
    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 100, "maximum": 999},
        "minItems": 30,
        "maxItems": 30,
    }
    reqs = []
    for i in range(24):
        req = request(f"{PROMPT} {i} " + "numbers " * 30, max_tokens=400, temperature=1.0, seed=i)
        req.structured_output.CopyFrom(pb.StructuredOutput(json_schema=json.dumps(schema)))
        reqs.append(req)
    before = sum(r.scheduler.queues.num_preemptions for r in tiny_scheduler.engine.replicas)
    results = await asyncio.gather(*(collect(tiny_scheduler.stub, r) for r in reqs))
    assert sum(r.scheduler.queues.num_preemptions for r in tiny_scheduler.engine.replicas) > before
    for got in results:
        jsonschema.validate(json.loads(got.text), schema)


@pytest.mark.parametrize(
    ("structured", "field"),
    [
        (pb.StructuredOutput(json_schema="{not json"), "structured_output.json_schema"),
        (pb.StructuredOutput(json_schema='{"type": "no-such-type"}'), "structured_output.json_schema"),
        (pb.StructuredOutput(regex="(unclosed"), "structured_output.regex"),
        (pb.StructuredOutput(grammar="root ::= undefined_rule"), "structured_output.grammar"),
        (pb.StructuredOutput(choice=pb.Choices()), "structured_output.choice"),
        (pb.StructuredOutput(choice=pb.Choices(choices=["a", ""])), "structured_output.choice[1]"),
    ],
)
async def test_invalid_constraints_are_refused_with_the_reason(
    tiny_scheduler: Scheduler, structured: pb.StructuredOutput, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(tiny_scheduler.stub, constrained(structured))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.value.details() or ""
    assert details.startswith(field), details
    assert not re.search(r"\.cc:\d+", details), details  # xgrammar's source location is dropped


async def test_beam_search_and_min_tokens_with_a_constraint_are_refused(tiny_scheduler: Scheduler) -> None:
    """Refused before anything compiles (the first compile costs seconds)."""
    cache = tiny_scheduler.engine._grammars.cache  # noqa: SLF001
    compiled = (cache.hits, cache.misses, len(cache))
    so = pb.StructuredOutput(json_schema='{"type": "integer", "minimum": 17}')
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(tiny_scheduler.stub, constrained(so, beam_width=2))
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(tiny_scheduler.stub, constrained(so, min_tokens=2))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in (error.value.details() or "")
    assert (cache.hits, cache.misses, len(cache)) == compiled
    with pytest.raises(ValueError, match="json_max_whitespace"):
        SchedulerConfig(json_max_whitespace=0)  # xgrammar takes no 0: every JSON constraint would fail


# ---- the pieces, without services ----


def _packed(allowed: list[list[int]], vocab: int) -> np.ndarray:
    """int32 [rows, ceil(vocab / 32)] with exactly `allowed[r]` set in row r."""
    bits = np.zeros((len(allowed), -(-vocab // 32) * 32), np.uint8)
    for r, tokens in enumerate(allowed):
        bits[r, tokens] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_masks_apply_after_the_bias_and_only_to_their_rows() -> None:
    vocab = 40
    masks = _packed([[3, 7, 39], [0]], vocab)
    s = SamplingBatch(
        temperature=np.zeros(3, np.float32),
        top_p=np.ones(3, np.float32),
        top_k=np.zeros(3, np.int32),
        seed=np.zeros(3, np.int64),
        output_position=np.zeros(3, np.int32),
        # Row 0 pushes token 5 far up, which its mask does not allow.
        bias_offsets=np.array([0, 1, 1, 1], np.int32),
        bias_token_ids=np.array([5], np.int32),
        bias_values=np.array([100.0], np.float32),
        mask_rows=np.array([0, -1, 1], np.int32),
        token_masks=masks,
    )
    logits = torch.randn(3, vocab)
    out = process_logits(logits, s, np.arange(3))
    assert torch.isinf(out[0]).sum() == vocab - 3 and torch.equal(out[0, [3, 7, 39]], logits[0, [3, 7, 39]])
    assert torch.equal(out[1], logits[1])  # unconstrained row untouched
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [0]
    greedy = sample(out, s.temperature, s.top_p, s.top_k, s.seed, s.output_position).tolist()
    assert greedy[0] == [3, 7, 39][int(logits[0, [3, 7, 39]].argmax())] and greedy[2] == 0
    assert processed_rows(s, np.arange(3)).tolist() == [True, False, True]


def test_masks_travel_through_both_wires_and_bad_ones_are_refused() -> None:
    from common import worker_wire

    plan = make_plan(4, [Feed(1, [5, 6], 0, [0]), Feed(2, [7], 3, [1]), Feed(3, [8], 2, [2])])
    masks = _packed([[1, 2], [49154]], 49155)
    plan = dataclasses.replace(
        plan, sampling=dataclasses.replace(plan.sampling, mask_rows=np.array([1, -1, 0], np.int32), token_masks=masks)
    )
    plan.validate()
    back = worker_wire.decode_plan(worker_pb.StepPlan.FromString(worker_wire.encode_plan(plan).SerializeToString()))
    assert np.array_equal(back.sampling.mask_rows, [1, -1, 0]) and np.array_equal(back.sampling.token_masks, masks)
    for rows in ([0, 0, -1], [0, -1, -1], [-2, 0, 1], [0, 1], [1, -1, 5]):
        bad = dataclasses.replace(plan, sampling=dataclasses.replace(plan.sampling, mask_rows=np.array(rows, np.int32)))
        with pytest.raises(ValueError, match="mask_rows"):
            bad.validate()
    no_sample = dataclasses.replace(plan, sample=np.array([1, 1, 0], np.uint8))
    with pytest.raises(ValueError, match="samples nothing"):
        no_sample.validate()
    # A sequence verifying a draft (its second token) has a mask for each of its 2 positions.
    drafting = dataclasses.replace(plan, draft_lens=np.array([1, 0, 0], np.int32))
    masks = _packed([[1], [2], [3]], 49155)
    for rows, ok in (([1, -1, 0], True), ([0, -1, 2], True), ([0, -1, 1], False), ([2, -1, 0], False)):
        case = dataclasses.replace(
            drafting,
            sampling=dataclasses.replace(plan.sampling, mask_rows=np.array(rows, np.int32), token_masks=masks),
        )
        if ok:
            case.validate()
            back = worker_wire.decode_plan(
                worker_pb.StepPlan.FromString(worker_wire.encode_plan(case).SerializeToString())
            )
            assert np.array_equal(back.sampling.token_masks, masks)
        else:
            with pytest.raises(ValueError, match="mask_rows"):
                case.validate()


def test_a_draft_is_cut_where_its_grammar_stops_allowing_it_and_each_position_masked(smollm2_dir: Path) -> None:
    """Speculative decoding under a grammar: the scheduler keeps the drafts the grammar allows
    (short of the stop token that would complete it) and sends a mask for each position the
    worker verifies; the matcher ends where it began."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    a, b, one = (tok.token_to_id(t) for t in ("a", "b", "1"))
    grammar = GrammarCompiler(str(smollm2_dir), 49152, frozenset({2}), 4).grammar(StructuredOutput("regex", "ab[0-9]"))
    assert grammar.allowed_prefix([a, b, a, one]) == 2  # a letter after "ab" is refused
    assert grammar.allowed_prefix([a, b, one, 2]) == 3  # the stop token that completes it is cut
    assert grammar.allowed_prefix([one]) == 0
    before = fill_masks([grammar])
    masks = fill_masks([grammar], [[a, b, one]])

    def allowed(row: np.ndarray) -> set[int]:
        return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:49152]).tolist())

    assert masks.shape == (4, before.shape[1]) and np.array_equal(masks[0], before[0])
    assert a in allowed(masks[0]) and b not in allowed(masks[0])
    assert b in allowed(masks[1]) and a not in allowed(masks[1])
    assert one in allowed(masks[2]) and a not in allowed(masks[2])
    assert allowed(masks[3]) == {2}  # complete: only its stop token
    assert np.array_equal(fill_masks([grammar]), before) and grammar.accept(a)  # not moved
    # Two grammars, one drafting: the other's single row follows the first's four.
    other = GrammarCompiler(str(smollm2_dir), 49152, frozenset({2}), 4).grammar(StructuredOutput("regex", "[0-9]+"))
    both = fill_masks([other, grammar], [[], [b, one]])
    assert both.shape[0] == 4 and one in allowed(both[0]) and allowed(both[3]) == {2}


def test_a_forked_grammar_moves_on_its_own(smollm2_dir: Path) -> None:
    compiler = GrammarCompiler(str(smollm2_dir), 49152, frozenset({2}), 4)
    parent = compiler.grammar(StructuredOutput("choice", choices=("true", "false")))
    assert compiler.compile(StructuredOutput("choice", choices=("true", "false"))) is compiler.compile(
        StructuredOutput("choice", choices=("true", "false"), field="other")
    )  # cached by what it compiles, not by the API it came through
    child = parent.fork()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    assert child.accept(tok.token_to_id("true")) and child.accept(2) and child.terminated
    assert not parent.terminated and not parent.accept(tok.token_to_id("true") + 1_000)
    (m_parent,) = fill_masks([parent])
    allowed = np.flatnonzero(np.unpackbits(m_parent.view(np.uint8), bitorder="little")[:49152])
    assert {tok.id_to_token(int(t)) for t in allowed} >= {"true", "false"} and len(allowed) < 20


def test_a_scheduler_without_xgrammar_refuses_constraints_as_unimplemented(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slim scheduler image leaves xgrammar (and torch) out: a constrained request is then
    UNIMPLEMENTED, saying why, not a crash."""
    from common.errors import Unimplemented

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now fails as if absent
    compiler = GrammarCompiler(str(smollm2_dir), 49152, frozenset({2}), 4)
    with pytest.raises(Unimplemented, match="lacks xgrammar"):
        compiler.grammar(StructuredOutput("regex", "[a-z]+"))


def _scheduler_with_constrained_seq(smollm2_dir: Path, **config: object) -> tuple[Any, Any]:
    from tests.test_scheduler import add, make_scheduler, make_seq

    s = make_scheduler(**config)
    seq = make_seq(1, 6, max_tokens=8)
    seq.grammar = GrammarCompiler(str(smollm2_dir), 49152, frozenset({2}), 4).grammar(
        StructuredOutput("regex", "[a-z]+")
    )
    add(s, seq)
    return s, seq


def test_a_token_the_grammar_refuses_ends_the_output_without_showing_it(smollm2_dir: Path) -> None:
    """A mask that allows nothing (a grammar the vocabulary cannot spell) or a broken worker:
    the token is not appended and the event carries none, so no client sees it."""
    from common.plan import StepResult
    from scheduler_svc.sched.sequence import FinishReason

    s, seq = _scheduler_with_constrained_seq(smollm2_dir)
    plan = s.schedule()
    assert plan is not None and plan.sampling.mask_rows.tolist() == [0]
    refused = np.full(plan.num_seqs, 13, np.int32)  # a special token, outside [a-z]+
    (event,) = s.update(plan, StepResult(plan.step_id, refused))
    assert event.token_id == -1 and event.finish_reason is FinishReason.ABORTED and event.group_finished
    assert seq.output_token_ids == [] and seq.finish_reason is FinishReason.ABORTED
    s.check_integrity()
    # What reaches the caller: ABORTED saying why, then the end of the stream; no text.
    from common.errors import Aborted
    from scheduler_svc.engine.live_streams import LiveStreams
    from scheduler_svc.engine.metrics import SchedulerMetrics
    from scheduler_svc.engine.replica import Replica
    from scheduler_svc.engine.request_stream import RequestStream
    from scheduler_svc.engine.step_reporter import StepReporter
    from scheduler_svc.text.tokenizer import Tokenizer

    streams = LiveStreams()
    stream = RequestStream(event.group, Tokenizer(smollm2_dir), 1000)
    streams.add(stream, Replica("r", worker=None))  # type: ignore[arg-type]
    StepReporter(SchedulerMetrics("m"), streams).emit(s, [event])
    items = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    assert len(items) == 2 and isinstance(items[0], Aborted) and "grammar" in str(items[0]) and items[1] is None


def test_a_constrained_prompt_chunk_does_not_stop_planning_ahead(smollm2_dir: Path) -> None:
    """Only a row that samples moves its grammar: while a constrained prompt is chunked, the
    next step is still planned ahead."""
    from tests.test_scheduler import fake_execute

    # A 6-token prompt in 4-token chunks: the first chunk samples nothing.
    s, _ = _scheduler_with_constrained_seq(smollm2_dir, max_num_batched_tokens=4)
    first = s.schedule()
    assert first is not None and not first.sample.any()
    second = s.schedule()  # planned while the first is in flight
    assert second is not None and second.sample.all() and s.num_planned_ahead == 1
    assert s.schedule() is None  # the sampling row's next mask waits for its token
    s.update(first, fake_execute(first))


@pytest.mark.parametrize("words", [1, 32, 1537])
def test_mask_rows_travel_as_ids_when_narrow_and_come_back_bit_for_bit(words: int) -> None:
    from common import token_masks

    rng = np.random.default_rng(words)
    k = 9
    masks = np.zeros((k, words), np.uint32)
    for r in range(k):
        allowed = rng.choice(
            words * 32, size=min(words * 32, [0, 1, 5, 192, 193, 10_000, 3, 64, 700][r]), replace=False
        )
        np.bitwise_or.at(masks[r], allowed >> 5, np.left_shift(np.uint32(1), (allowed & 31).astype(np.uint32)))
    masks[k - 1] = 0xFFFFFFFF  # everything allowed
    masks = masks.view(np.int32)
    parts = token_masks.split(masks)
    counts = np.bitwise_count(masks.view(np.uint32)).sum(1)
    assert parts.sparse.tolist() == (counts <= token_masks.SPARSE_MAX_IDS).astype(int).tolist()
    assert parts.dense.shape == (k - int(parts.sparse.sum()), words)
    token_masks.check(parts, words)
    assert np.array_equal(token_masks.join(parts, words), masks)
    bad = parts._replace(ids=parts.ids + words * 32) if parts.ids.size else parts._replace(offsets=parts.offsets + 1)
    with pytest.raises(ValueError, match="mask_"):
        token_masks.check(bad, words)
