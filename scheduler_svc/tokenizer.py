"""The model's tokenizer, through the `tokenizers` library (transformers would pull torch in)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HfTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json (a fast tokenizer is required)")
        self.backend = HfTokenizer.from_file(str(path))
        config_path = Path(model_dir) / "tokenizer_config.json"
        self.config: dict = json.loads(config_path.read_text()) if config_path.is_file() else {}

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with special tokens added the way transformers' tokenizer adds them."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens))
