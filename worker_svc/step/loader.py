"""Loading a Hugging Face checkpoint (config.json + safetensors) into our model.

No hub access: the path must be a local directory. Every checkpoint tensor is handed to
`CausalLM.load_weights` as a lazy safetensors slice, and the parameter's weight_loader reads
only the rows or columns its tensor-parallel rank keeps: no rank ever materialises a full
weight it does not hold, and peak memory stays near one copy of the rank's shard.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open
from transformers import AutoConfig

from kernels.limits import max_tokens_per_step
from worker_svc.device.cpu_features import cpu_has_fast_bf16
from worker_svc.device.parallel import SINGLE, ParallelGroup
from worker_svc.device.pipeline import PipelineStage
from worker_svc.layers.replicated import Loaded
from worker_svc.models.decoder import CausalLM
from worker_svc.models.registry import build_model

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """The device a worker runs on, always with an index on CUDA: torch.cuda.set_device and
    the per-device caches (kernels/workspace.py) refuse or miss a bare "cuda"."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        # The first visible GPU, as a bare "cuda" means to torch in a fresh process.
        return torch.device("cuda", 0)
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 where the hardware computes it fast, float32 elsewhere."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def head_dim_of(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def load_config(model_dir: str | Path) -> Any:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a model directory (no config.json)")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors files")
    return files


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, Loaded]]:
    """(name, lazy slice) of every checkpoint tensor; a slice reads from disk only what is
    indexed, and is valid until the next item (its file stays open until then)."""
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_slice(name)


def triton_token_limit(hf_config: Any) -> int:
    """kernels.limits.max_tokens_per_step for a checkpoint's whole shape (a rank's share
    only raises the limit, so the whole model's is safe for every tensor-parallel size)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(text.num_attention_heads)
    return max_tokens_per_step(
        hidden_size=int(text.hidden_size),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim_of(hf_config),
        intermediate_size=int(text.intermediate_size),
    )


def resolve_attention_backend(
    backend: str, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> str:
    """'auto' is triton on CUDA; on the CPU (where Triton only has its slow interpreter) it is
    our C++ kernels when they build here and support the dtype and head size, else torch."""
    if backend == "torch" and device.type == "cuda":
        # The reference path copies every decoding sequence's whole context each layer: slow,
        # and the memory profile reserves room for the widest such decode (runner.py).
        log.warning("torch_attention_on_cuda", reason="reference path; its decode gathers each context")
    if backend != "auto":
        return backend
    if device.type == "cuda":
        return "triton"
    from kernels.cpu_library import CpuKernelsUnavailable
    from kernels.cpu_ops import ATTENTION_HEAD_DIMS, CPU_DTYPES, cpu_kernels

    if dtype not in (None, *CPU_DTYPES) or head_dim not in (None, *ATTENTION_HEAD_DIMS):
        return "torch"

    try:
        cpu_kernels()
    except CpuKernelsUnavailable as error:
        log.warning("cpu_kernels_unavailable", reason=str(error), fallback="torch")
        return "torch"
    return "cpu"


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    attention_backend: str = "torch",
    group: ParallelGroup = SINGLE,
    stage: PipelineStage | None = None,
) -> CausalLM:
    """This rank's shard of the model (the whole model for a group of one), of its pipeline
    stage's layers only."""
    config = load_config(model_dir)
    with torch.device(device):
        model = build_model(config, dtype, max_positions, attention_backend, group, stage)
    model.load_weights(iter_weights(model_dir))
    model.eval()
    if attention_backend == "cpu":
        model.pack_linear_weights()
    log.info(
        "model_loaded",
        path=str(model_dir),
        architecture=model.shape.architecture,
        layers=model.shape.num_layers,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        attention_backend=attention_backend,
        tp_rank=group.rank,
        tp_size=group.world_size,
        pp_stage=model.stage.stage,
        stage_layers=f"{model.stage.layers.start}-{model.stage.layers.stop - 1}",
        parameters=sum(p.numel() for p in model.parameters()),
    )
    return model
