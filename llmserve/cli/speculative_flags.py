"""Speculative decoding's flags: vLLM's `--speculative-config JSON`, and the two settings most
runs change as flags of their own."""

from __future__ import annotations

import argparse
import dataclasses
import json

from common.speculative_config import METHOD_ALIASES, SPECULATIVE_METHODS, SpeculativeConfig


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 32, "min_acceptance_rate": 0.2} '
        "(default: off)",
    )
    p.add_argument(
        "--speculative-method",
        choices=SPECULATIVE_METHODS,
        default=None,
        help="draft tokens for the workers to verify: ngram = prompt lookup in the request's own tokens, suffix = "
        "frequent continuations of its tokens and earlier outputs, draft = a smaller model (--speculative-model) "
        "(default: off)",
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="draft tokens per sequence and step (default 4)"
    )


def add_draft_model_flag(p: argparse.ArgumentParser) -> None:
    """A worker's: `up` and the offline LLM pass it on to the workers they start."""
    p.add_argument(
        "--speculative-model",
        default=None,
        help="speculative decoding's draft model (a directory; same vocabulary): the worker runs it beside the "
        "model, with a KV cache of as many blocks, and proposes each drafting sequence's next drafts with it",
    )


def draft_model_dir(a: argparse.Namespace) -> str | None:
    """The draft model the workers load: the speculative settings' (`up`, the offline LLM),
    else a lone worker's --speculative-model."""
    if hasattr(a, "speculative_config"):
        config = speculative_config(a)
        return config.model if config is not None else None
    return getattr(a, "speculative_model", None)


def speculative_config(a: argparse.Namespace) -> SpeculativeConfig | None:
    """None when neither flag asks for drafts; ValueError for a malformed or unknown setting."""
    settings: dict[str, object] = {}
    if a.speculative_config:
        try:
            settings = json.loads(a.speculative_config)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not JSON: {error}") from None
        if not isinstance(settings, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
    if a.speculative_method:
        settings["method"] = a.speculative_method
    draft_model = getattr(a, "speculative_model", None)  # a worker flag: `scheduler` has none
    if draft_model:
        settings["model"] = draft_model
    if "model" in settings:
        settings.setdefault("method", "draft")  # vLLM infers it from the model too
    method = settings.get("method")
    if isinstance(method, str):
        settings["method"] = METHOD_ALIASES.get(method, method)
    if a.num_speculative_tokens is not None:
        settings["num_speculative_tokens"] = a.num_speculative_tokens
    if not settings:
        return None
    try:
        return SpeculativeConfig(**settings)  # type: ignore[arg-type]
    except TypeError as error:
        raise ValueError(f"--speculative-config: {error}") from None
