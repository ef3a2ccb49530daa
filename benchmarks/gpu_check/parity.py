"""Our engine against transformers on the same device, the same weights and the same dtype.

float32: greedy tokens must be equal, and the logits of a teacher-forced pass (the prompt and
the reference's tokens in one prompt step) within FP32_REL_TOL of the reference's, relative
to its largest logit.

bfloat16: two correct implementations round differently, so greedy outputs may part where
the best two tokens are nearly tied. At the first divergence of each sequence the reference
is asked, over the common prefix, in bfloat16 and in float32: a divergence is a near-tie when
the float32 reference's gap between its bf16 twin's token and ours is within twice what bf16
rounding moves the reference's own logits there (the largest shift over the vocabulary), or
when float32 prefers our token outright. One on a clearer margin than that needs a look; the
float32 check is the one that proves the implementation.

SmolLM2 (a real model, --model-dir) and one tiny random model per family
(gpu_check.checkpoints): the families are where features differ (windows, soft-capping,
LongRoPE, experts), SmolLM2 is where real logits are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gpu_check.context import Context, Skip
from gpu_check.engine import build_runner, run_requests, teacher_forced_logits

FP32_REL_TOL = 1e-3
TEXT_PROMPTS = ("The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def smollm2(ctx: Context) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    directory = ctx.model_dir
    if not (directory / "config.json").is_file():
        raise Skip(f"no model at {directory}: pass --model-dir DIR (docs/benchmarks.md, the GPU check)")
    prompts = _text_prompts(directory)
    result = compare(ctx, directory, AutoModelForCausalLM, prompts, 4 if ctx.tiny else 32)
    result["summary"] = _line(result, ctx.dry)
    return result


def families(ctx: Context) -> dict[str, Any]:
    from gpu_check import checkpoints

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, checkpoints.TINY_VOCAB, (n,), generator=g).tolist() for n in checkpoints.PROMPT_LENGTHS]
    new_tokens = 4 if ctx.tiny else checkpoints.NEW_TOKENS
    result: dict[str, Any] = {}
    for name, (_, model_cls, _) in checkpoints.families().items():
        try:
            directory = checkpoints.tiny_family(ctx.workdir / f"family-{name}", name)
            result[name] = compare(ctx, directory, model_cls, prompts, new_tokens)
        except Exception as error:  # noqa: BLE001 - one family's failure is its own, the others still run
            result[name] = {"passed": False, "error": f"{type(error).__name__}: {error}"}
        print(f"   {name}: {_line(result[name], ctx.dry)}", flush=True)
        ctx.release()
    checked = [r for r in result.values() if "passed" in r]
    good = sum(r["passed"] for r in checked)
    bad = [name for name, r in result.items() if r.get("passed") is False]
    summary = f"built {len(result)} families" if ctx.dry else f"{good}/{len(checked)} families pass"
    return {
        "families": result,
        "passed": not bad,
        "failing": bad,
        "summary": summary + (f"; failing: {', '.join(bad)}" if bad else ""),
    }


def compare(ctx: Context, directory: Path, model_cls: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Both dtypes (float32 first: its reference stays loaded, the bf16 divergences' yardstick)."""
    result: dict[str, Any] = {"prompts": len(prompts), "new_tokens": new_tokens}
    exact = None
    for dtype, torch_dtype in DTYPES.items():
        runner = build_runner(ctx, str(directory), dtype, max_num_seqs=4, cache={"num_gpu_blocks": 256})
        reference = model_cls.from_pretrained(str(directory), dtype=torch_dtype).to(ctx.device).eval()
        if ctx.dry:
            result[dtype] = {"constructed": True}
            del runner, reference
            continue
        ours = run_requests(runner, [(p, new_tokens) for p in prompts]).outputs
        theirs = [_generate(reference, p, new_tokens, ctx.device) for p in prompts]
        same = sum(a == b for a, b in zip(ours, theirs))
        entry: dict[str, Any] = {"greedy_equal": f"{same}/{len(prompts)}"}
        with torch.inference_mode():
            if dtype == "float32":
                entry.update(_logit_diff(runner, reference, prompts, theirs, ctx.device))
                entry["passed"] = same == len(prompts) and entry["max_rel_logit_diff"] <= FP32_REL_TOL
                exact = reference
            else:
                entry["divergences"] = _divergences(reference, exact, prompts, ours, theirs, ctx.device)
                entry["passed"] = all(d["near_tie"] for d in entry["divergences"])
        result[dtype] = entry
        del runner
        if dtype != "float32":
            del reference
        ctx.release()
    del exact
    if not ctx.dry:
        result["passed"] = all(result[d]["passed"] for d in DTYPES)
    return result


def _generate(model: Any, prompt: list[int], new_tokens: int, device: torch.device) -> list[int]:
    model.generation_config.eos_token_id = None  # our side runs with ignore_eos
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


def _logit_diff(
    runner: Any, reference: Any, prompts: list[list[int]], theirs: list[list[int]], device: torch.device
) -> dict[str, float]:
    worst_abs, worst_rel = 0.0, 0.0
    for prompt, tokens in zip(prompts, theirs):
        ids = prompt + tokens[:-1]
        ours = teacher_forced_logits(runner, ids).float()  # [len, vocab]
        ref = reference(torch.tensor([ids], device=device)).logits[0].float()
        diff = float((ours - ref).abs().max())
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / max(float(ref.abs().max()), 1e-6))
    return {"max_logit_diff": worst_abs, "max_rel_logit_diff": worst_rel, "tolerance_rel": FP32_REL_TOL}


def _divergences(
    reference: Any,
    exact: Any,
    prompts: list[list[int]],
    ours: list[list[int]],
    theirs: list[list[int]],
    device: torch.device,
) -> list[dict[str, Any]]:
    """Each sequence's first divergence from the bf16 reference, judged by the float32 one."""
    found = []
    for i, (prompt, mine, ref) in enumerate(zip(prompts, ours, theirs)):
        at = next((j for j, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        if at is None:
            continue
        ids = torch.tensor([prompt + ref[:at]], device=device)
        half = reference(ids).logits[0, -1].float()  # [vocab]
        full = exact(ids).logits[0, -1].float()
        pair = [ref[at], mine[at]]
        top = half.topk(2).values
        exact_gap = float(full[pair[0]] - full[pair[1]])  # < 0: float32 prefers our token
        rounding = float((half - full).abs().max())
        found.append(
            {
                "sequence": i,
                "position": at,
                "ours": mine[at],
                "reference": ref[at],
                "reference_margin": float(top[0] - top[1]),  # the bf16 reference's top1 - top2
                "reference_gap_to_ours": float(half[pair[0]] - half[pair[1]]),
                "float32_gap_to_ours": exact_gap,
                "bf16_rounding": rounding,  # how far bf16 moves any logit of the reference here
                "near_tie": exact_gap <= 2 * rounding,
            }
        )
    return found


def _text_prompts(directory: Path) -> list[list[int]]:
    """Real text through the model's own tokenizer (peaked, realistic logits); random ids when
    the directory has none."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(3)]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return [tokenizer.encode(text).ids for text in TEXT_PROMPTS]


def _line(result: dict[str, Any], dry: bool) -> str:
    if "error" in result:
        return f"FAILED {result['error'][:160]}"
    if dry:
        return "constructed (float32, bfloat16)"
    fp32, bf16 = result["float32"], result["bfloat16"]
    ties = sum(d["near_tie"] for d in bf16["divergences"])
    return (
        f"fp32 greedy {fp32['greedy_equal']}, rel logit diff {fp32['max_rel_logit_diff']:.1e}; "
        f"bf16 greedy {bf16['greedy_equal']}, {len(bf16['divergences'])} divergences ({ties} near-ties)"
    )
