"""This process's pipeline stage: which layers it holds, and the point-to-point links to the
stages before and after it.

A worker group of pp x tp ranks is laid out stage-major: rank r is stage r // tp, tensor-
parallel rank r % tp inside it. Stage s holds layers `layers` (the first stage also the
embedding, the last the final norm and the LM head); each stage's tp ranks form their own
tensor-parallel group (worker_svc.device.parallel). Every stage gets the same plan and builds
the same step inputs, so the shapes of what passes between stages are known on both sides:

    stage s, tp rank t  --[x, residual]-->  stage s + 1, tp rank t        every step

Nothing goes back: the scheduler plans a pipeline's steps only from results it has, so no
plan names a token the first stage would have to learn from the last (no DEFERRED_INPUT).
A stage sends without waiting for the next one to take it, so that with several plans in
flight (micro-batches) it starts the next one at once: stage s + 1 receives in plan order.
Nothing is kept between steps but the sends still under way.
"""

from __future__ import annotations

import datetime
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from common.config import MAX_MICROBATCHES
from worker_svc.device.parallel import ParallelGroup, bind_device, init_group, join_world

_HIDDEN_TAG = 1
# Sends a stage may have under way before it waits for the oldest: one per plan in flight.
MAX_SENDS = MAX_MICROBATCHES


@dataclass(frozen=True)
class PipelineStage:
    """`layers`: this stage's decoder layers (global indices). `world_rank`, `tp`: where this
    rank sits in the whole group, to find its peers. `links`: the group the point-to-point
    transfers run over (the step timeout applies to them), None for a single stage."""

    stage: int = 0
    num_stages: int = 1
    layers: range = range(0)
    world_rank: int = 0
    tp: int = 1
    links: Any = None
    # Where transferred tensors must be: the device under NCCL, the host under gloo.
    link_device: torch.device = torch.device("cpu")
    # Sends under way, each with the buffer it reads from (alive until the send is done).
    _sends: deque[tuple[Any, torch.Tensor]] = field(default_factory=deque, compare=False, repr=False)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def pipelined(self) -> bool:
        return self.num_stages > 1

    def holds(self, layer: int) -> bool:
        return layer in self.layers or not self.pipelined

    def send_hidden(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """[rows, hidden] twice, to the next stage's rank of the same tp rank; returns once the
        send is under way, not done (the next stage may still be busy with an earlier plan)."""
        both = torch.stack((x, residual)).to(self.link_device)
        sends = self._sends
        while sends and sends[0][0].is_completed():
            sends.popleft()
        if len(sends) >= MAX_SENDS:  # the next stage is that many plans behind: wait for it
            sends.popleft()[0].wait()
        work = dist.isend(both, self.world_rank + self.tp, self.links, tag=_HIDDEN_TAG)
        if work is None:  # only for a rank outside the group, which this is not
            raise RuntimeError(f"rank {self.world_rank} is outside its pipeline's group")
        sends.append((work, both))

    def recv_hidden(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[2, rows, hidden]: the previous stage's (x, residual)."""
        buf = torch.empty(2, rows, hidden, dtype=dtype, device=self.link_device)
        dist.recv(buf, self.world_rank - self.tp, self.links, tag=_HIDDEN_TAG)
        return buf.to(device)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def holds_tensor(stage: PipelineStage, name: str, has_embedding: bool) -> bool:
    """Whether checkpoint tensor `name` belongs on this stage (so that the others never read it)."""
    if not stage.pipelined:
        return True
    layer = _LAYER.search(name)
    if layer is not None:
        return stage.holds(int(layer.group(1)))
    if "embed_tokens." in name:
        return has_embedding
    if name.startswith("lm_head.") or re.search(r"(?:^|\.)norm\.", name):
        return stage.is_last
    return True


def layer_split(num_layers: int, num_stages: int, split: tuple[int, ...] = ()) -> list[range]:
    """Each stage's layers: `split` gives their counts, in stage order; without it, as even as
    they go, with the remainder on the stages after the first (which also embeds) and before
    the last (which also runs the LM head), from the middle out."""
    if num_stages < 1:
        raise ValueError(f"--pp must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"--pp {num_stages} is more stages than the model's {num_layers} layers")
    if split:
        if len(split) != num_stages or min(split) < 1 or sum(split) != num_layers:
            raise ValueError(
                f"--pp-layer-split {','.join(map(str, split))}: want {num_stages} counts of at least 1 "
                f"that add up to the model's {num_layers} layers"
            )
        counts = list(split)
    else:
        base, extra = divmod(num_layers, num_stages)
        counts = [base] * num_stages
        order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), abs(2 * s - (num_stages - 1))))
        for s in order[:extra]:
            counts[s] += 1
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def join(
    rank: int,
    world_size: int,
    num_stages: int,
    num_layers: int,
    init_method: str,
    device: torch.device,
    timeout_s: float = 300.0,
    backend: str = "auto",
    split: tuple[int, ...] = (),
    choose_split: Callable[[int], tuple[int, ...]] | None = None,
) -> tuple[ParallelGroup, PipelineStage]:
    """Join a group of `world_size` ranks in `num_stages` stages: this rank's tensor-parallel
    group (of its stage) and its stage. With one stage, the stage is trivial and the
    tensor-parallel group is what parallel.init_group would make. `choose_split(stage)`, called
    on every rank once the world is joined, measures the split instead (`--pp-layer-split auto`,
    stage_probe.choose_split)."""
    if world_size % num_stages:
        raise ValueError(f"{world_size} ranks cannot form {num_stages} pipeline stages of equal width")
    tp = world_size // num_stages
    stage = rank // tp
    if num_stages == 1:
        layers = layer_split(num_layers, num_stages, split)
        return init_group(rank, world_size, init_method, device, timeout_s, backend), PipelineStage(layers=layers[0])
    bind_device(device)
    resolved = join_world(rank, world_size, init_method, device, timeout_s, backend)
    layers = layer_split(num_layers, num_stages, choose_split(stage) if choose_split is not None else split)
    step_timeout = datetime.timedelta(seconds=timeout_s)
    # Every rank creates every group, in the same order (torch.distributed's rule).
    stage_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=step_timeout) for s in range(num_stages)]
    links = dist.new_group(list(range(world_size)), timeout=step_timeout)
    group = ParallelGroup(rank % tp, tp, stage_groups[stage])
    link_device = device if resolved == "nccl" else torch.device("cpu")
    return group, PipelineStage(stage, num_stages, layers[stage], rank, tp, links, link_device)
