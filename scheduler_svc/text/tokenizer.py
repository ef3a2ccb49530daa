"""The model's tokenizer, through the `tokenizers` library (transformers would pull torch in)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HfTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json (a fast tokenizer is required)")
        self.backend = HfTokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with special tokens added the way transformers' tokenizer adds them."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The tokenizer's own string for each id (e.g. "Ġhello"), "" for an unknown id."""
        return [self.backend.id_to_token(t) or "" for t in token_ids]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens))
