"""What GetModelInfo and GetLoad report: plain values the wire module turns into messages."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.engine.request import Limits
from scheduler_svc.lora.adapter_registry import Adapter


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int  # 0 while no worker has reported one
    has_chat_template: bool
    limits: Limits
    max_queue_len: int
    adapters: tuple[Adapter, ...] = ()  # LoRA adapters requests may name


@dataclass(frozen=True)
class GroupLoad:
    """KV usage of one worker group (cached prefix blocks count as free: they are evicted on demand)."""

    name: str
    address: str
    num_gpu_blocks: int
    free_gpu_blocks: int
    num_cpu_blocks: int
    free_cpu_blocks: int
    running: int
    waiting: int
    swapped: int
    tokens_per_second: float = 0.0  # group_speed.GroupSpeed


@dataclass(frozen=True)
class GroupActivity:
    """A group's load as a gateway balancing engines weighs it, beyond queue lengths.

    Kept apart from GroupLoad, which maps field for field onto `llmserve.v1.WorkerGroupLoad`.
    """

    load: GroupLoad
    block_size: int
    max_running: int  # --max-num-seqs
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache, since the group started
    prefix_hit_tokens: int  # of which found there
    output_tokens_per_s: float  # over the current stats interval (engine_stats.INTERVAL_S)
    waiting_uncached_tokens: int  # prompt tokens of queued requests their prefix cache lacks


@dataclass(frozen=True)
class Load:
    running: int
    waiting: int
    swapped: int
    groups: tuple[GroupLoad, ...]
