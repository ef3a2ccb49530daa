"""What a worker reports at the handshake: the model it serves and the KV capacity it holds,
and the bounds any report must keep before the scheduler sizes anything by it."""

from __future__ import annotations

from dataclasses import dataclass

# The scheduler keeps a list entry per KV block (reference counts, hashes, the free queue), built
# on its event loop when a group connects: 2^22 blocks is 64 Mi tokens at block size 16, far
# past any device's cache, and a few hundred MiB of lists at most.
MAX_KV_BLOCKS = 1 << 22
# CacheConfig's block sizes (common/config.py).
BLOCK_SIZES = (8, 16, 32, 64, 128)
# LoRA slots and tensor-parallel ranks of one group; strings that end up in logs.
MAX_LORA_SLOTS = 1024
MAX_WORLD_SIZE = 64
MAX_NAME_LENGTH = 256


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
    # Pipeline stages of the group: rank r computes stage r // (world_size // pipeline_stages).
    pipeline_stages: int = 1
    # Speculative decoding: the draft model's name ("" = none), which proposes draft tokens.
    draft_model: str = ""

    @property
    def driver_rank(self) -> int:
        """The rank whose result is the group's: the last stage's first (it samples)."""
        return self.world_size - self.world_size // self.pipeline_stages


def out_of_bounds(info: WorkerInfo) -> str | None:
    """Why `info` cannot come from a sane worker (the field and its bound), or None.

    Checked before the scheduler builds anything from it, so that a broken or hostile worker
    cannot make it allocate without bound; whether the worker fits this scheduler (its model,
    vocabulary, block size) is the fleet's question, asked after this one.
    """
    if not 1 <= info.num_gpu_blocks <= MAX_KV_BLOCKS:
        return f"worker reports {info.num_gpu_blocks} KV blocks, want between 1 and {MAX_KV_BLOCKS}"
    if not 0 <= info.num_cpu_blocks <= MAX_KV_BLOCKS:
        return f"worker reports {info.num_cpu_blocks} swap blocks, want at most {MAX_KV_BLOCKS}"
    if info.block_size not in BLOCK_SIZES:
        return f"worker reports KV blocks of {info.block_size} tokens, want one of {', '.join(map(str, BLOCK_SIZES))}"
    if info.max_model_len < 1:
        return f"worker reports a context of {info.max_model_len} tokens"
    if not 1 <= info.world_size <= MAX_WORLD_SIZE or not 0 <= info.rank < info.world_size:
        return f"worker reports rank {info.rank} of a group of {info.world_size} (at most {MAX_WORLD_SIZE} ranks)"
    if not 1 <= info.pipeline_stages <= info.world_size or info.world_size % info.pipeline_stages:
        return f"worker reports {info.pipeline_stages} pipeline stages in a group of {info.world_size} ranks"
    if not 0 <= info.max_loras <= MAX_LORA_SLOTS:
        return f"worker reports {info.max_loras} LoRA slots, want at most {MAX_LORA_SLOTS}"
    if info.block_bytes < 0 or info.max_lora_rank < 0:
        return "worker reports a negative block size in bytes or LoRA rank"
    for field in ("model_name", "dtype", "device", "draft_model"):
        if len(getattr(info, field)) > MAX_NAME_LENGTH:
            return f"worker reports a {field} of more than {MAX_NAME_LENGTH} characters"
    return None
