"""Draft models for speculative decoding's benchmarks and tests, made from the served model:
its first N decoder layers, with its embeddings, final norm and LM head (a self-speculative
draft, as LayerSkip drafts). Same tokenizer and vocabulary by construction, and real files
the workers load as they load any checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncated(src: Path, out: Path, layers: int) -> Path:
    """`src`'s first `layers` layers as a model directory at `out` (made once: kept if there)."""
    if (out / "config.json").exists():
        return out
    config = json.loads((src / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise ValueError(f"{src.name} has {config['num_hidden_layers']} layers, asked for the first {layers}")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                m = _LAYER.match(name)
                if m is None or int(m.group(1)) < layers:
                    tensors[name] = f.get_tensor(name)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)
    tmp.rename(out)
    return out
