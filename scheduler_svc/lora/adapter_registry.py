"""The LoRA adapters requests may name, checked against the model before any worker sees them.

An adapter is a PEFT directory: adapter_config.json and adapter_model.safetensors, whose tensors
are named `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`, A of
shape [r, in] and B of [out, r]. Only the header of the safetensors file is read here (its JSON
names every tensor's shape), so the scheduler still imports no torch. Everything a worker would
trip over is refused here with INVALID_ARGUMENT: a worker that fails a step loses its group.

With a root (`--lora-root`), an adapter's directory and the two files in it must resolve,
links followed, to inside it; a relative path is the root's. Whatever else a path is (missing,
outside, unreadable, a file) it gets the same refusal, `OUTSIDE_ROOT`, so that a caller cannot
probe the server's file system through the answers. Each registration is a new identity
(`version`): an adapter unloaded and loaded again under its name shares no slot and no cached
prefix block with its predecessor, whose requests in flight keep theirs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import AlreadyExists, InvalidArgument, NotFound
from common.lora_format import MLP_MODULES, MODULES, TENSOR_NAME, UNSUPPORTED, lora_scale

MAX_NAME_LENGTH = 128
_HEADER_LIMIT = 100 << 20  # a safetensors header is JSON; a bigger one is not a LoRA adapter
_versions = itertools.count(1)  # one per registration in this process (workers key host copies by it)
_FILES = ("adapter_config.json", "adapter_model.safetensors")
OUTSIDE_ROOT = "not an adapter directory inside this server's LoRA root (--lora-root)"


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    version: int
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    target_modules: tuple[str, ...]

    @property
    def cache_salt(self) -> int:
        """Starts the prefix-cache hash chain of this adapter's sequences: its KV differs from
        the base model's (and any other adapter's) for the same tokens."""
        # A digest, not hash(): str hashes change with every process, and tests replay chains.
        digest = hashlib.blake2b(f"{self.name}\0{self.version}\0{self.path}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True) | 1  # never 0, the base model's


class AdapterRegistry:
    def __init__(self, model_dir: str, max_lora_rank: int, enabled: bool, root: str | None = None) -> None:
        self.model_dir = model_dir
        self.max_lora_rank = max_lora_rank
        self.enabled = enabled
        self.root = None if root is None else Path(root).resolve()  # None: adapters from anywhere
        self._adapters: dict[str, Adapter] = {}
        self._shapes: dict[str, tuple[int, int]] | None = None  # module -> (in, out), read on first load

    def get(self, name: str) -> Adapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise NotFound(f"adapter_id: adapter {name!r} is not loaded (ListAdapters names those that are)")
        return adapter

    def list(self) -> list[Adapter]:
        return list(self._adapters.values())

    def unload(self, name: str) -> Adapter:
        adapter = self.get(name)
        del self._adapters[name]
        return adapter

    def load(self, name: str, path: str) -> Adapter:
        """Check and register, on the calling thread."""
        return self.add(self.check(name, path))

    def check(self, name: str, path: str) -> Adapter:
        """The adapter at `path`, its files read and checked, not registered yet: this reads
        files and may run in a thread (nothing here changes the registry)."""
        if not self.enabled:
            raise InvalidArgument("name", "LoRA adapters are off: start the server with --enable-lora")
        if not 1 <= len(name) <= MAX_NAME_LENGTH or not all(" " < c <= "~" for c in name):
            raise InvalidArgument(
                "name", f"1-{MAX_NAME_LENGTH} printable ASCII characters without spaces, got {name!r}"
            )
        self._check_free(name)
        if self.root is not None:
            path = str(_inside(self.root, path))
        else:
            # Workers open the path themselves: a relative one would name their working directory.
            path = os.path.abspath(path)
            if not Path(path).is_dir():
                raise InvalidArgument("path", f"{path} is not a directory (a PEFT adapter's)")
        rank, scale = self._check_config(Path(path))
        targets = self._check_tensors(Path(path), rank)
        return Adapter(name, path, next(_versions), rank, scale, targets)

    def add(self, adapter: Adapter) -> Adapter:
        """Register a checked adapter; requests may name it from now on."""
        self._check_free(adapter.name)  # again: another load may have taken the name meanwhile
        self._adapters[adapter.name] = adapter
        return adapter

    def _check_free(self, name: str) -> None:
        if name in self._adapters:
            raise AlreadyExists(f"name: adapter {name!r} is already loaded; unload it first")

    def _check_config(self, path: Path) -> tuple[int, float]:
        file = path / "adapter_config.json"
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as error:
            raise InvalidArgument("path", f"{file} is not a readable PEFT adapter config: {error}") from error
        if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
            raise InvalidArgument("path", f"{file}: only LoRA adapters are served (peft_type LORA)")
        rank = config.get("r")
        if not isinstance(rank, int) or rank < 1:
            raise InvalidArgument("path", f"{file}: r must be a positive integer, got {rank!r}")
        if rank > self.max_lora_rank:
            raise InvalidArgument("path", f"rank {rank} exceeds --max-lora-rank {self.max_lora_rank}")
        for key, what in UNSUPPORTED.items():
            if config.get(key):
                raise InvalidArgument("path", f"{file}: {what} is not supported")
        if config.get("bias", "none") != "none":
            raise InvalidArgument("path", f"{file}: trained biases (bias {config['bias']!r}) are not supported")
        alpha = config.get("lora_alpha", rank)
        if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise InvalidArgument("path", f"{file}: lora_alpha must be a number, got {alpha!r}")
        return rank, lora_scale(rank, float(alpha), bool(config.get("use_rslora")))

    def _check_tensors(self, path: Path, rank: int) -> tuple[str, ...]:
        file = path / "adapter_model.safetensors"
        header, data_size = _safetensors_header(file)
        shapes = self._model_shapes()
        text = _text_config(self.model_dir)
        layers = int(text["num_hidden_layers"])
        # A mixture-of-experts model's MLPs are experts, which no slot adapts.
        moe = bool(text.get("num_experts") or text.get("num_local_experts"))
        targets: set[str] = set()
        parts: dict[tuple[int, str], set[str]] = {}
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            match = TENSOR_NAME.match(key)
            module = match.group(3) if match else ""
            if match is None or module not in MODULES:
                what = "an expert of a mixture-of-experts layer" if ".experts." in key else "a module"
                raise InvalidArgument(
                    "path", f"{file}: tensor {key} adapts {what} no slot holds (only {', '.join(MODULES)})"
                )
            if moe and module in MLP_MODULES:
                raise InvalidArgument("path", f"{file}: tensor {key} adapts an MLP of a mixture-of-experts model")
            layer, part = int(match.group(1)), match.group(4)
            if layer >= layers:
                raise InvalidArgument("path", f"{file}: tensor {key} names layer {layer}; the model has {layers}")
            if entry.get("dtype") not in ("F32", "F16", "BF16"):
                raise InvalidArgument("path", f"{file}: tensor {key} has dtype {entry.get('dtype')}")
            offsets = entry.get("data_offsets")
            if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1] <= data_size):
                raise InvalidArgument("path", f"{file}: tensor {key} lies outside the file (truncated?)")
            features_in, features_out = shapes[module]
            want = [rank, features_in] if part == "A" else [features_out, rank]
            if entry.get("shape") != want:
                raise InvalidArgument(
                    "path", f"{file}: tensor {key} has shape {entry.get('shape')}, this model and r={rank} want {want}"
                )
            targets.add(module)
            parts.setdefault((layer, module), set()).add(part)
        lone = sorted(f"layer {i} {m}" for (i, m), p in parts.items() if p != {"A", "B"})
        if lone:
            raise InvalidArgument("path", f"{file}: lora_A without lora_B or the reverse at {', '.join(lone[:4])}")
        if not targets:
            raise InvalidArgument("path", f"{file} holds no LoRA tensors")
        return tuple(sorted(targets))

    def _model_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each adaptable module of the whole (unsharded) model."""
        if self._shapes is None:
            text = _text_config(self.model_dir)
            hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
            kv_heads = int(text.get("num_key_value_heads") or heads)
            head_dim = int(text.get("head_dim") or hidden // heads)
            inter = int(text["intermediate_size"])
            q, kv = heads * head_dim, kv_heads * head_dim
            self._shapes = {
                "q_proj": (hidden, q),
                "k_proj": (hidden, kv),
                "v_proj": (hidden, kv),
                "o_proj": (q, hidden),
                "gate_proj": (hidden, inter),
                "up_proj": (hidden, inter),
                "down_proj": (inter, hidden),
            }
        return self._shapes


def _inside(root: Path, path: str) -> Path:
    """`path` (a relative one is the root's) resolved, when it and its files lie inside `root`."""
    try:
        real = (root / path).resolve(strict=True)
        # A file may be missing (the checks after this one say so), not a link out of the root.
        inside = real.is_dir() and all(p.is_relative_to(root) for p in (real, *((real / f).resolve() for f in _FILES)))
    except (OSError, RuntimeError, ValueError):  # missing, unreadable, a loop of links, a NUL byte
        inside = False
    if not inside:
        raise InvalidArgument("path", OUTSIDE_ROOT)  # the caller knows which path it sent
    return real


def _text_config(model_dir: str) -> dict[str, Any]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file (8 bytes of little-endian length, then the JSON)
    and the size of the tensor data after it."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _HEADER_LIMIT:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
            data_size = os.fstat(f.fileno()).st_size - 8 - length
    except (OSError, ValueError, struct.error) as error:
        raise InvalidArgument("path", f"{file} is not a readable safetensors file: {error}") from error
    if not isinstance(header, dict):
        raise InvalidArgument("path", f"{file} is not a safetensors file")
    return header, data_size
