"""The tensor-parallel group a worker process belongs to, and the collectives its layers use.

A group of `world_size` ranks runs the same step in lockstep; each rank holds a slice of
every large weight (see worker_svc/layers/tp_layers.py) and the layers meet in two collectives:

    all_reduce   row-parallel outputs and the vocab-parallel embedding: partial sums -> sum
    all_gather   the LM head: [n, vocab / tp] per rank -> [n, vocab] on every rank

With world_size 1 every collective returns its input and torch.distributed is never
initialised: the single-process worker runs exactly the code it ran before TP existed.
The group is a value passed explicitly to the layers that need it (no module-level state
besides what torch.distributed itself keeps).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroup:
    """This process's place in its tensor-parallel group.

    `process_group` is the torch.distributed group the collectives run over; None means the
    default (world) group. A group of one never touches torch.distributed, and a group whose
    collectives are never called (building and loading a rank's shard) needs no init either.
    """

    rank: int = 0
    world_size: int = 1
    process_group: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.world_size}")

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one whose sampled tokens go back to the scheduler."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the ranks, in place."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.process_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order, on every rank."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.process_group)
        return torch.cat(parts, dim)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Like all_gather, but only rank 0 receives the result; the other ranks get None."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dst = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        dist.gather(x, parts, dst=dst, group=self.process_group)
        return torch.cat(parts, dim) if parts is not None else None


SINGLE = ParallelGroup()


LOAD_TIMEOUT_S = 1800.0  # joining the group: every rank must have loaded its weights by then


def bind_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device; nothing off CUDA.

    Triton launches a kernel on the current device, not on its tensors' device, and the
    current device is per thread and starts at cuda:0 in every new thread: each thread that
    runs the model (the main one while loading, profiling and capturing graphs, the servicer's
    forward thread for every step) must call this first, or a model on cuda:N, N > 0, fails
    at its first kernel.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)


def dist_backend(backend: str, device: torch.device) -> str:
    """The torch.distributed backend a rank on `device` joins with."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"--dist-backend nccl needs CUDA, but this rank runs on {device}")
    return backend


def init_group(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float = 300.0,
    backend: str = "auto",
) -> ParallelGroup:
    """Bind this thread to the rank's device, then join the group: NCCL when the rank runs on
    CUDA, gloo on CPU. A group of one joins nothing, but is bound like any other rank.

    `init_method` is a torch.distributed rendezvous, e.g. "tcp://127.0.0.1:29500" or
    "file:///tmp/llmserve-tp". `timeout_s` bounds every collective, so a dead rank fails the
    others instead of hanging them. `backend`: "auto" (as above), "nccl" or "gloo" (which
    also runs CUDA tensors, through host copies, and so lets ranks share a GPU).
    """
    bind_device(device)
    if world_size == 1:
        return ParallelGroup(rank, world_size)
    join_world(rank, world_size, init_method, device, timeout_s, backend)
    steps = dist.new_group(ranks=list(range(world_size)), timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelGroup(rank, world_size, steps)


def join_world(
    rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float, backend: str
) -> str:
    """Join torch.distributed's world of `world_size` ranks; returns the backend it runs on.

    Ranks load their weights at different speeds (a shared disk, a large model), so the
    rendezvous and the first barrier get the load timeout; the step collectives run on groups
    the caller makes with `timeout_s`, the short timeout that detects a dead or stalled peer.
    """
    resolved = dist_backend(backend, device)
    dist.init_process_group(
        backend=resolved,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=max(timeout_s, LOAD_TIMEOUT_S)),
    )
    return resolved


# ---- which group sizes a model can be split into ----


def split_problem(tp: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> str | None:
    """Why `tp` ranks cannot split this model, or None when they can.

    The vocabulary never blocks a split: the vocab-parallel layers pad it to a multiple of tp.
    KV heads are split when tp divides them, and replicated when they divide tp (each rank then
    holds the one KV head its query heads read).
    """
    if tp < 1:
        return f"tp must be at least 1, got {tp}"
    if num_heads % tp:
        return f"tp={tp} cannot split {num_heads} attention heads"
    if num_kv_heads % tp and tp % num_kv_heads:
        return f"tp={tp} cannot split {num_kv_heads} KV heads (nor replicate them evenly)"
    if intermediate_size % tp:
        return f"tp={tp} cannot split an MLP intermediate size of {intermediate_size}"
    return None


def workable_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    """Every group size that splits the model (always includes 1)."""
    return [
        tp for tp in range(1, num_heads + 1) if split_problem(tp, num_heads, num_kv_heads, intermediate_size) is None
    ]


def check_splittable(tp: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Refuse a group size the model cannot be split into, naming the sizes that work."""
    problem = split_problem(tp, num_heads, num_kv_heads, intermediate_size)
    if problem is not None:
        sizes = ", ".join(map(str, workable_sizes(num_heads, num_kv_heads, intermediate_size)))
        raise ValueError(f"{problem}; sizes that work: {sizes}")
