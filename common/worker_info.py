"""What a worker reports at the handshake: the model it serves and the KV capacity it holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerInfo:
    model_name: str
    vocab_size: int
    max_model_len: int
    dtype: str
    device: str
    rank: int
    world_size: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_bytes: int = 0  # K and V of every layer for one block
    # LoRA: device adapter slots (0 = adapters off) and the largest rank a slot holds.
    max_loras: int = 0
    max_lora_rank: int = 0
