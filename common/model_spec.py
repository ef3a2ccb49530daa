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
            max_model_len=int(text_config.get("max_position_embeddings", 2048)),
            eos_token_ids=eos,
            architectures=tuple(str(a) for a in config.get("architectures") or ()),
            model_type=str(text_config.get("model_type") or config.get("model_type") or ""),
            bos_token_id=_optional_id(text_config.get("bos_token_id")),
            pad_token_id=_optional_id(text_config.get("pad_token_id")),
        )
