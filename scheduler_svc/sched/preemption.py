"""Swap or recompute: the cheaper way to give a preempted group's KV blocks back.

    swap       copy the group's blocks to the host pool now and back later:
               2 * blocks * block_bytes / swap_bandwidth seconds of copying
    recompute  drop the blocks and prefill the tokens again when the group resumes:
               computed_tokens / recompute_tokens_per_s seconds of forward passes

Short sequences recompute (a few hundred tokens of prefill are nearly free on a GPU); long
ones swap. If the host pool cannot take the blocks, the group recomputes: a preemption
never fails and never drops a generated token. The two constants are configuration
(`--swap-bandwidth-gbps`, `--recompute-tokens-per-s`): measure them on the deployment's
hardware, or force one mode with `--preemption-mode`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from common.config import SchedulerConfig


class PreemptionMode(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class PreemptionPolicy:
    mode: str  # "auto", "swap" or "recompute"
    block_bytes: int
    swap_bytes_per_s: float
    recompute_tokens_per_s: float

    @classmethod
    def of(cls, config: SchedulerConfig, block_bytes: int) -> PreemptionPolicy:
        return cls(
            mode=config.preemption_mode,
            block_bytes=block_bytes,
            swap_bytes_per_s=config.swap_bandwidth_gbps * 1e9,
            recompute_tokens_per_s=config.recompute_tokens_per_s,
        )

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_bytes / self.swap_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.recompute_tokens_per_s

    def choose(self, num_blocks: int, num_tokens: int, free_host_blocks: int) -> PreemptionMode:
        if num_blocks > free_host_blocks or self.mode == "recompute":
            return PreemptionMode.RECOMPUTE
        if self.mode == "swap":
            return PreemptionMode.SWAP
        if self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens):
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE
