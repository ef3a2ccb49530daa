"""The offline API (`from llmserve import LLM, SamplingParams`) over a real worker process and
the tiny random Llama: outputs against transformers, every prompt and parameter form, and
that closing (or forgetting) an LLM leaves no process and no directory behind."""

from __future__ import annotations

import gc
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import psutil
import pytest

from llmserve import LLM, CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams
from tests.test_structured_output import PROMPT as GUIDED_PROMPT
from tests.test_structured_output import SCHEMAS

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
ENGINE = {"dtype": "float32", "device": "cpu", "num_gpu_blocks": 128, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with SmolLM2's chat template, for chat()."""
    out = tmp_path_factory.mktemp("offline") / "tiny-chat"
    shutil.copytree(tiny_model_dir, out)
    shutil.copy(smollm2_dir / "chat_template.jinja", out / "chat_template.jinja")
    return out


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(str(model_dir), **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(model_dir: Path):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def test_greedy_equals_transformers_generate(llm: LLM, hf) -> None:  # type: ignore[no-untyped-def]
    import torch

    model, tok = hf
    # min_tokens as min_new_tokens: both ban eos until then, so every output has 12 tokens.
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12), use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    assert len({o.request_id for o in outs}) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt).input_ids
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        (completion,) = out.outputs
        assert completion.token_ids == want[0, len(ids) :].tolist(), prompt
        assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
        assert (completion.index, completion.finish_reason, completion.stop_reason) == (0, "length", None)
        assert out.finished and completion.finished() and completion.logprobs is None and out.prompt_logprobs is None


def test_every_prompt_form_gives_the_same_greedy_output(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    (by_text,) = llm.generate(PROMPTS[0], GREEDY)  # one string; the bar is on by default
    assert "Processed prompts" in capsys.readouterr().err
    ids = by_text.prompt_token_ids
    outs = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    (by_dict,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert outs[0].prompt == PROMPTS[0] and outs[1].prompt is None and by_dict.prompt is None
    for out in [*outs, by_dict]:
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == by_text.outputs[0].token_ids
    # A repeated prompt's full blocks (16 tokens each) come from the prefix cache.
    long = {"prompt_token_ids": list(range(1000, 1040))}
    first, second = (llm.generate(long, GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    with pytest.raises(ValueError, match="prompts\\[0\\]"):
        llm.generate([{"text": "x"}], GREEDY, use_tqdm=False)


def test_params_per_prompt(llm: LLM) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    ]
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="2 given for 3 prompts"):
        llm.generate(PROMPTS, params, use_tqdm=False)


def test_n_samples_are_distinct_and_seeded(llm: LLM) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    first, again = llm.generate([PROMPTS[0], PROMPTS[0]], params, use_tqdm=False)
    assert [c.index for c in first.outputs] == [0, 1]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in first.outputs)
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]  # same seed
    (best,) = llm.generate(
        PROMPTS[0], SamplingParams(n=1, best_of=3, temperature=1.0, seed=3, max_tokens=4), use_tqdm=False
    )
    assert len(best.outputs) == 1 and len(best.outputs[0].token_ids) <= 4


def test_logprobs_shape(llm: LLM) -> None:
    (out,) = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=2), use_tqdm=False
    )
    (completion,) = out.outputs
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids) == 5
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert token in position and len(position) == 3  # greedy: the chosen token is the best one
        assert position[token].rank == 1 and position[token].decoded_token is not None
        assert sorted(p.rank for p in position.values()) == [1, 2, 3]
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs)), rel=1e-4
    )
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    for token, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert position is not None and token in position and 2 <= len(position) <= 3
        assert all(math.isfinite(p.logprob) and p.logprob <= 0 for p in position.values())


def test_chat_renders_the_models_template(llm: LLM, hf) -> None:  # type: ignore[no-untyped-def]
    _, tok = hf
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    (out,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert out.prompt == tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == tok(out.prompt, add_special_tokens=False).input_ids
    (same,) = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    two = llm.chat([conversation, [{"role": "user", "content": "Bye"}]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="text only"):
        llm.chat([{"role": "user", "content": [{"type": "image"}]}], use_tqdm=False)


def test_stop_strings_and_stop_token_ids(llm: LLM) -> None:
    (free,) = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    text, tokens = free.outputs[0].text, free.outputs[0].token_ids
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    (stopped,) = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, stop=stop), use_tqdm=False)
    completion = stopped.outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (text[:cut], "stop", stop)
    (kept,) = llm.generate(
        PROMPTS[2],
        SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept.outputs[0].text == text[: cut + len(stop)]
    at = tokens.index(tokens[3])  # its first occurrence ends the output
    (by_id,) = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[tokens[3]]), use_tqdm=False
    )
    completion = by_id.outputs[0]
    assert completion.token_ids == tokens[: at + 1]  # the stop token is returned, not shown
    assert (completion.finish_reason, completion.stop_reason) == ("stop", tokens[3])


def test_structured_outputs_follow_a_schema_choices_a_regex_or_a_grammar(llm: LLM) -> None:
    regex = r"[a-f]{3}-[0-9]{2,3}"
    choices = ["alpha", "beta", "gamma delta"]
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [1-9]'
    schemas = [SCHEMAS[i] for i in (3, 13, 17, 23)]
    cases: list[tuple[object, StructuredOutputsParams, dict[str, object]]] = [
        # A schema as a dict and as its JSON text (vLLM takes both).
        *((s, StructuredOutputsParams(json=s), {}) for s in schemas),
        *((s, StructuredOutputsParams(json=json.dumps(s)), {"temperature": 1.0, "seed": 3}) for s in schemas),
        (choices, StructuredOutputsParams(choice=choices), {"temperature": 1.0, "seed": 4}),
        (regex, StructuredOutputsParams(regex=regex), {"temperature": 1.0, "seed": 5}),
        ("grammar", StructuredOutputsParams(grammar=grammar), {}),
        # Keys and strings are free: a bias on the closing quote and brace ends them sooner.
        (dict, StructuredOutputsParams(json_object=True), {"logit_bias": {18: 8.0, 109: 8.0}}),
    ]
    params = [
        SamplingParams(**{"temperature": 0.0, "max_tokens": 160, **kw}, structured_outputs=so) for _, so, kw in cases
    ]  # type: ignore[arg-type]
    outs = llm.generate([GUIDED_PROMPT] * len(cases), params, use_tqdm=False)
    for (want, _, _), out in zip(cases, outs):
        got = out.outputs[0]
        assert got.finish_reason == "stop", (want, got.text)
        if isinstance(want, dict):
            jsonschema.validate(json.loads(got.text), want)
        elif want is dict:
            assert isinstance(json.loads(got.text), dict), got.text
        elif isinstance(want, list):
            assert got.text in want, got.text
        elif want == "grammar":
            assert re.fullmatch(r"\([1-9](\+[1-9])*\)", got.text), got.text
        else:
            assert re.fullmatch(str(want), got.text), got.text


def test_structured_outputs_params_are_checked(llm: LLM) -> None:
    for kwargs, match in (
        ({}, "StructuredOutputsParams: set exactly one .* got none"),
        ({"json": {"type": "integer"}, "regex": "a+"}, "got json, regex"),
        ({"json_object": False}, "got none"),
        ({"json": "{not json"}, "StructuredOutputsParams.json: not valid JSON"),
        ({"json": 5}, "StructuredOutputsParams.json: want a dict"),
        ({"choice": []}, "StructuredOutputsParams.choice: want a non-empty list"),
        ({"choice": "ab"}, "StructuredOutputsParams.choice: want a non-empty list"),
        ({"choice": ["a", ""]}, r"StructuredOutputsParams.choice\[1\]"),
        ({"regex": ""}, "StructuredOutputsParams.regex: must be a non-empty string"),
    ):
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="SamplingParams.min_tokens: cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs: want StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
    # The compiler's refusal, from the engine.
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "no-such-type"}))
    with pytest.raises(ValueError, match="structured_outputs.json_schema: cannot be compiled: .*no-such-type"):
        llm.generate(PROMPTS[0], bad, use_tqdm=False)


def test_invalid_input_is_a_value_error(llm: LLM, model_dir: Path) -> None:
    for bad in (
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"n": 0},
        {"max_tokens": 0},
        {"stop": [""]},
        {"min_tokens": 5, "max_tokens": 2},
        {"presence_penalty": 3.0},
        {"truncate_prompt_tokens": 0},
    ):
        with pytest.raises(ValueError, match=f"SamplingParams.{next(iter(bad))}"):
            SamplingParams(**bad)  # type: ignore[arg-type]
    # The engine's own checks, with the message a gRPC client would get.
    with pytest.raises(ValueError, match="sampling.logprobs: at most 20"):
        llm.generate(PROMPTS, SamplingParams(logprobs=50), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([PROMPTS[0], {"prompt_token_ids": [1, 10**7]}], use_tqdm=False)
    with pytest.raises(TypeError, match="bogus_option"):
        LLM(str(model_dir), bogus_option=1)
    with pytest.raises(ValueError, match="block_size: invalid int value"):
        LLM(str(model_dir), block_size="big")
    with pytest.raises(ValueError, match="attention_backend: invalid choice"):
        LLM(str(model_dir), attention_backend="fast")
    # A refused batch aborted whatever it had queued: the engine still serves.
    (out,) = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=2), use_tqdm=False
    )
    assert (
        len(out.prompt_token_ids) == 2
        and isinstance(out, RequestOutput)
        and isinstance(out.outputs[0], CompletionOutput)
    )


def test_close_and_finalizer_leave_no_process_and_no_directory(model_dir: Path) -> None:
    before = _descendants()
    with LLM(str(model_dir), **ENGINE) as llm:
        pids, sockdir = llm.worker_pids, llm._engine.sockdir
        assert pids and set(pids) <= _descendants() and os.path.isdir(sockdir)
        assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    assert not any(psutil.pid_exists(p) for p in pids) and not os.path.exists(sockdir)
    assert _descendants() <= before
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("Hi", use_tqdm=False)
    llm.close()  # again: nothing to do

    forgotten = LLM(str(model_dir), **ENGINE)
    pids, sockdir = forgotten.worker_pids, forgotten._engine.sockdir
    del forgotten
    gc.collect()
    assert not any(psutil.pid_exists(p) for p in pids) and not os.path.exists(sockdir)
    assert _descendants() <= before


def test_a_worker_that_cannot_start_is_an_error_and_leaves_nothing(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, broken / name)
    # The engine's private directory goes into a temp dir of this test's own (short, for the
    # unix sockets in it): an LLM another test process makes meanwhile cannot count as left over.
    own = Path(tempfile.mkdtemp(prefix="t"))
    monkeypatch.setattr(tempfile, "tempdir", str(own))
    before, dirs = _descendants(), set(own.glob("llmserve-llm-*"))
    with pytest.raises(RuntimeError, match="worker exited with code 2 before it was ready"):
        LLM(str(broken), **ENGINE)
    assert _descendants() <= before
    assert set(own.glob("llmserve-llm-*")) <= dirs
    own.rmdir()
