"""Speculative decoding end to end: the offline LLM with n-gram drafts over a real worker
process gives transformers' greedy tokens, on prompts that repeat themselves (drafts kept)
and on ones that do not, and sampled requests run with drafts too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams
from tests.conftest import transformers_greedy

NEW_TOKENS = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = {"dtype": "float32", "device": "cpu", "num_gpu_blocks": 256, "max_num_seqs": 8}


def prompts() -> list[list[int]]:
    rng = torch.Generator().manual_seed(3)
    passage = torch.randint(3, 49152, (40,), generator=rng).tolist()
    return [
        passage + passage[:25],  # a passage quoted again: what follows is in the prompt
        [17, 18, 19] * 12,
        torch.randint(3, 49152, (30,), generator=rng).tolist(),  # nothing repeats
    ]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[list[int]]:
    return transformers_greedy(tiny_model_dir, prompts(), NEW_TOKENS)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    with LLM(str(tiny_model_dir), speculative_config=SPEC, **ENGINE) as llm:
        yield llm


def test_greedy_with_drafts_equals_transformers(llm: LLM, reference: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    scheduler = llm._engine.engine.replicas[0].scheduler
    assert scheduler is not None and scheduler.drafter is not None
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_sampled_requests_run_with_drafts(llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=NEW_TOKENS, ignore_eos=True, seed=7)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    # Drafts are a pure function of the tokens, and every draw of (seed, position): a seeded
    # request repeats exactly.
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]


COPY_TEXT = (
    "Rules of the library: return books within fourteen days, keep your voice down in the reading room, "
    "and never eat near the rare manuscripts. "
)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_smollm2_copying_keeps_drafts_and_equals_transformers(smollm2_dir: Path, method: str) -> None:
    """A text quoted again: SmolLM2 continues the quote, prompt lookup drafts it, most drafts
    are kept, and greedy float32 still equals transformers token for token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(smollm2_dir))(COPY_TEXT * 3 + "Rules of the library:")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        run = model.generate(
            torch.tensor([ids]),
            do_sample=False,
            max_new_tokens=40,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    want = run.sequences[0, len(ids) :]
    want_lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(run.scores, want.tolist())]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    stop = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=["voice"])
    with LLM(str(smollm2_dir), speculative_config={**SPEC, "method": method}, **ENGINE) as llm:
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        drafter = llm._engine.engine.replicas[0].scheduler.drafter  # type: ignore[union-attr]
        stopped = llm.generate([{"prompt_token_ids": ids}], stop, use_tqdm=False)[0].outputs[0]
        assert drafter is not None
        kept = drafter.accepted_total
        # logprobs=0, each chosen token's log-probability without alternatives: it drafts too,
        # each kept draft with its own log-probability.
        scored = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
        with_lps = llm.generate([{"prompt_token_ids": ids}], scored, use_tqdm=False)[0].outputs[0]
        assert drafter.accepted_total >= kept + 15
    assert list(with_lps.token_ids) == want.tolist() and with_lps.logprobs is not None
    got_lps = [entry[t].logprob for entry, t in zip(with_lps.logprobs, with_lps.token_ids)]
    assert got_lps == pytest.approx(want_lps, abs=1e-3)
    # A stop string inside a step's kept drafts ends the output there, tokens and text alike.
    assert stopped.finish_reason == "stop" and stopped.text == out.text[: out.text.index("voice")]
    assert (
        len(stopped.token_ids) < len(out.token_ids)
        and list(stopped.token_ids) == want.tolist()[: len(stopped.token_ids)]
    )
    assert list(out.token_ids) == want.tolist()
    assert drafter is not None and drafter.accepted_total >= 15  # of 40 tokens
    assert drafter.accepted_total > 0.5 * drafter.drafted_total


ITEMS_SCHEMA = {
    "type": "array",
    "minItems": 4,
    "maxItems": 4,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "city": {"type": "string", "maxLength": 12}},
        "required": ["name", "city"],
        "additionalProperties": False,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_structured_output_drafts_within_its_grammar(smollm2_dir: Path, temperature: float) -> None:
    """A JSON schema whose keys recur: the grammar spells them and the n-gram drafts propose
    them again, cut where the grammar stops allowing them and each verified position masked.
    Greedy float32: the same tokens as without drafts; sampled: the output still follows the
    schema. Every draft kept, every block back."""
    import json

    import jsonschema

    from llmserve import StructuredOutputsParams

    prompt = "List four people and the city each lives in, as JSON:"
    so = StructuredOutputsParams(json=ITEMS_SCHEMA)
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=160, structured_outputs=so)
    outputs = {}
    for spec in (None, {**SPEC, "num_speculative_tokens": 6}):
        with LLM(str(smollm2_dir), speculative_config=spec, **ENGINE) as llm:
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            scheduler = llm._engine.engine.replicas[0].scheduler
            assert scheduler is not None
            assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
            outputs[spec is not None] = out.outputs[0]
            if spec is not None:
                drafter = scheduler.drafter
                assert drafter is not None and drafter.accepted_total >= 10
    for out in outputs.values():
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), ITEMS_SCHEMA)
    if temperature == 0:
        assert list(outputs[True].token_ids) == list(outputs[False].token_ids)
