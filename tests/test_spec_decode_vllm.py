"""benchmarks/spec_decode_vllm.py, the parts that need no vLLM: the prompts it hands vLLM are
the ids our server makes of the same requests, its n-gram settings are ours, and the ratios it
adds to a point."""

from __future__ import annotations

from pathlib import Path

from benchmarks import spec_decode_vllm, spec_workloads
from common.speculative_config import SpeculativeConfig
from scheduler_svc.text.chat_template import ChatTemplate
from scheduler_svc.text.tokenizer import Tokenizer


def test_vllm_gets_the_prompt_ids_our_server_makes(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ours, template = Tokenizer(smollm2_dir), ChatTemplate.from_dir(smollm2_dir)
    assert template is not None
    for workload in ("copy", "json", "random", "schema"):
        for r in spec_workloads.build_requests(workload, 3, 0, 1, hf, None):
            assert bool(r.json_schema) == (workload == "schema")
            ids = spec_decode_vllm.token_ids(r, hf)
            if r.messages:
                assert ids == ours.encode(template.render(list(r.messages)), False)
            else:
                assert ids == list(r.token_ids) and ids


def test_the_schema_workload_asks_for_objects_with_the_keys_it_names(smollm2_dir: Path) -> None:
    import json

    import jsonschema
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    for r in spec_workloads.build_requests("schema", 4, 0, 4, hf, None):
        schema = json.loads(r.json_schema)
        jsonschema.Draft202012Validator.check_schema(schema)
        keys = schema["items"]["required"]
        assert schema["minItems"] == schema["maxItems"] and all(k in r.messages[0][1] for k in keys)
        assert r.max_tokens == spec_workloads.JSON_MAX_TOKENS and r.temperature == 0


def test_vllm_drafts_with_our_ngram_lengths_and_k() -> None:
    ours = SpeculativeConfig()
    modes = spec_decode_vllm.modes([2, 6])
    assert modes["vllm-off"] is None
    assert modes["vllm-ngram-k6"] == {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "prompt_lookup_min": ours.prompt_lookup_min,
        "prompt_lookup_max": ours.prompt_lookup_max,
    }
    assert list(modes) == ["vllm-off", "vllm-ngram-k2", "vllm-ngram-k6"]


def test_ours_over_vllm_is_against_its_faster_mode() -> None:
    points = [
        {
            "workload": "copy",
            "concurrency": 4,
            "modes": {"off": {"output_tokens_per_s": 100.0}, "ngram-k4": {"output_tokens_per_s": 240.0}},
        }
    ]
    vllm = {
        "vllm-off": {"copy-c4": {"output_tokens_per_s": 80.0}},
        "vllm-ngram-k4": {"copy-c4": {"output_tokens_per_s": 160.0}},
    }
    spec_decode_vllm.compare(points, vllm)
    assert points[0]["ours_over_vllm_best"] == {"off": 100.0 / 160.0, "ngram-k4": 1.5}
    assert set(points[0]["vllm"]) == {"vllm-off", "vllm-ngram-k4"}
