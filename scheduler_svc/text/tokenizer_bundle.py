"""The model's tokenizer files as one zip archive, for gateways that tokenize themselves.

A gateway speaking `vllm.grpc.engine.VllmEngine` (smg) tokenizes prompts and detokenizes
outputs on its side, and fetches the files to do it with `GetTokenizer`: a zip of the
tokenizer and model config files, streamed in chunks, the last one carrying the archive's
SHA-256. The archive is byte-for-byte reproducible (sorted names, fixed timestamps), so the
fingerprint changes only when a file does.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

# What a Hugging Face tokenizer (and a chat template) can be built from, plus the model's
# config files, which carry the special token ids.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
)
TOKENIZER_PATTERNS = ("*.jinja", "*.tiktoken")
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip can hold


@dataclass(frozen=True)
class TokenizerBundle:
    data: bytes  # the zip archive
    sha256: str  # hex digest of `data`
    names: tuple[str, ...]  # the files it holds, sorted


def tokenizer_files(model_dir: Path) -> list[Path]:
    found = {p.name: p for p in (model_dir / n for n in TOKENIZER_FILES) if p.is_file()}
    for pattern in TOKENIZER_PATTERNS:
        found.update({p.name: p for p in model_dir.glob(pattern) if p.is_file()})
    return [found[name] for name in sorted(found)]


def build_bundle(model_dir: str | Path) -> TokenizerBundle:
    """Zip the tokenizer files of `model_dir`; a directory without any is an error."""
    files = tokenizer_files(Path(model_dir))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no tokenizer files")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            info = zipfile.ZipInfo(path.name, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    data = buf.getvalue()
    return TokenizerBundle(data, hashlib.sha256(data).hexdigest(), tuple(p.name for p in files))
