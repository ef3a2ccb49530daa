"""What the scheduler must know about a model, read from its files without torch.

The scheduler service imports no torch, and transformers' config and tokenizer classes pull
torch in, so config.json and generation_config.json are read here as plain JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _as_id_set(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    return frozenset(int(v) for v in value)


def _optional_id(value: Any) -> int | None:
    """A single token id; None when unset or given as a list (some configs list several)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# Rope types whose config already states the extended length in max_position_embeddings.
_STATED_LENGTH = ("default", "llama3", "longrope", "su", "mrope")


def context_limit(max_position_embeddings: int, rope: Any) -> int:
    """The longest context the model's positions allow. A linear or yarn scaling stretches the
    positions it was trained on by its factor (from `original_max_position_embeddings` where the
    config gives it), which configs often leave out of max_position_embeddings; llama3 and
    longrope configs state the extended length there already (vLLM reads them the same way)."""
    params = dict(rope or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in _STATED_LENGTH or not isinstance(params.get("factor"), (int, float)):
        return max_position_embeddings
    base = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    return max(max_position_embeddings, int(base * float(params["factor"])))


def served_context(config: Any, asked: int) -> int:
    """The context a worker serves for a transformers config: `asked` (--max-model-len; 0 = all
    the positions allow), refused past that limit."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    limit = context_limit(int(text.max_position_embeddings), rope)
    if asked > limit:
        raise ValueError(
            f"--max-model-len {asked} is beyond this model's {limit} positions (max_position_embeddings, stretched "
            "by its rope scaling); lower it, or serve a config with more positions or a rope scaling such as yarn"
        )
    return asked or limit


@dataclass(frozen=True)
class ModelSpec:
    path: str
    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    # Reported to gateways (GetModelInfo); nothing here acts on them.
    architectures: tuple[str, ...] = ()
    model_type: str = ""
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # The name clients see (GetModelInfo, metrics, messages); `name`, the directory's, is the
    # one workers must report. Empty: `name`. Set by --served-model-name (`served_as`).
    served_name: str = ""

    @property
    def public_name(self) -> str:
        return self.served_name or self.name

    def served_as(self, name: str | None) -> ModelSpec:
        """This model under the client-facing `name` (None: as it was)."""
        return self if not name else replace(self, served_name=name)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        root = Path(path)
        config = _load_json(root / "config.json")
        if not config:
            raise ValueError(f"{root} has no config.json: not a Hugging Face model directory")
        text_config = config.get("text_config", config)
        generation = _load_json(root / "generation_config.json")
        # generate() stops on generation_config's eos ids when it has them; follow it so greedy
        # outputs match transformers.
        eos = _as_id_set(generation.get("eos_token_id")) or _as_id_set(text_config.get("eos_token_id"))
        return cls(
            path=str(root),
            name=root.name,
            vocab_size=int(text_config["vocab_size"]),
            max_model_len=context_limit(
                int(text_config.get("max_position_embeddings", 2048)),
                text_config.get("rope_parameters") or text_config.get("rope_scaling"),
            ),
            eos_token_ids=eos,
            architectures=tuple(str(a) for a in config.get("architectures") or ()),
            model_type=str(text_config.get("model_type") or config.get("model_type") or ""),
            bos_token_id=_optional_id(text_config.get("bos_token_id")),
            pad_token_id=_optional_id(text_config.get("pad_token_id")),
        )
