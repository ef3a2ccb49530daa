"""`--pp-layer-split auto`: each stage measures its device, and the layers go where they run soonest.

Stages need not run on equal devices (another GPU model, a smaller card, a busier host), and an
even split then leaves the fast stages idle while the slowest one sets the pace. Before any
weight is loaded, every rank times the matrix products of one decoder layer of this model, at
this dtype and this tensor-parallel width, on PROBE_ROWS rows, and, on the last stage, those of
the LM head; it also reads the memory it has free. The ranks exchange what they measured
(the slowest and the least free rank speaks for its stage), and each stage gets n_s layers so
that every stage's time per step comes out alike:

    n_s * layer_s + head_s = T  for every stage s,   sum n_s = num_layers
    =>  T = (num_layers + sum head_s / layer_s) / sum (1 / layer_s)

rounded to whole layers (at least one each), with no stage given more layers than 90% of its
free memory holds; what a full stage cannot take goes to the others, by speed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger(__name__)

PROBE_ROWS = 128  # tokens of the timed products: a decode batch's worth
MEMORY_SHARE = 0.9  # of a stage's free memory its layers' weights may take


@dataclass(frozen=True)
class StageProbe:
    layer_s: float  # one decoder layer's products, seconds
    head_s: float  # the LM head's (0 but on the last stage)
    free_bytes: int


def layer_shapes(hf_config: Any, tp: int) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears on one of `tp` ranks (MoE: every expert)."""
    h = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    d = getattr(hf_config, "head_dim", None) or h // heads
    inter = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 1
    qkv = (heads + 2 * kv) * d // tp
    return [(h, qkv), (heads * d // tp, h), *[(h, 2 * inter // tp), (inter // tp, h)] * experts]


def layer_bytes(hf_config: Any, tp: int, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return sum(i * o for i, o in layer_shapes(hf_config, tp)) * size


def measure(hf_config: Any, tp: int, dtype: torch.dtype, device: torch.device, last: bool) -> StageProbe:
    """Time this rank's share of one layer (and of the head on the last stage)."""
    layer = [
        (torch.randn(PROBE_ROWS, i, dtype=dtype, device=device), torch.randn(i, o, dtype=dtype, device=device))
        for i, o in layer_shapes(hf_config, tp)
    ]
    layer_s = _best_of(layer, device)
    head_s = 0.0
    if last:  # the head's weight is the largest probe tensor: only the stage that runs it makes one
        vocab = -(-hf_config.vocab_size // tp)
        rows = layer[0][0]  # PROBE_ROWS x hidden, the first product's input
        head_s = _best_of([(rows, torch.randn(hf_config.hidden_size, vocab, dtype=dtype, device=device))], device)
    return StageProbe(layer_s, head_s, free_memory(device))


def _best_of(products: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, reps: int = 5) -> float:
    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for a, b in products:
            torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    once()  # warm-up: kernels chosen, pages touched
    return min(once() for _ in range(reps))


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62  # not Linux: no cap


def exchange(mine: StageProbe, num_stages: int, tp: int) -> list[StageProbe]:
    """Every rank's probe, then each stage's: its slowest and least free rank (a collective)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    stages = []
    for s in range(num_stages):
        ranks = everyone[s * tp : (s + 1) * tp]
        stages.append(
            StageProbe(max(p.layer_s for p in ranks), max(p.head_s for p in ranks), min(p.free_bytes for p in ranks))
        )
    return stages


def auto_split(stages: list[StageProbe], num_layers: int, bytes_per_layer: int) -> tuple[int, ...]:
    """Layers per stage (see the module's docstring); ValueError if the stages cannot hold them."""
    n = len(stages)
    if n > num_layers:
        raise ValueError(f"--pp {n} is more stages than the model's {num_layers} layers")
    caps = [max(int(p.free_bytes * MEMORY_SHARE) // max(bytes_per_layer, 1), 0) for p in stages]
    if min(caps) < 1 or sum(caps) < num_layers:
        short = ", ".join(f"stage {s}: {c} layers of {bytes_per_layer / 2**20:.0f} MiB" for s, c in enumerate(caps))
        raise ValueError(
            f"--pp-layer-split auto: the stages' free memory holds too few of {num_layers} layers ({short})"
        )
    counts = [1] * n
    open_stages = set(range(n))
    while sum(counts) < num_layers:
        # Whole layers one at a time, each to the stage that would finish soonest with it.
        s = min(open_stages, key=lambda s: ((counts[s] + 1) * stages[s].layer_s + stages[s].head_s, s))
        counts[s] += 1
        if counts[s] >= caps[s]:
            open_stages.discard(s)
    return tuple(counts)


def step_times(stages: list[StageProbe], counts: tuple[int, ...]) -> list[float]:
    """Each stage's predicted time per step under `counts`."""
    return [c * p.layer_s + p.head_s for p, c in zip(stages, counts, strict=True)]


def choose_split(
    hf_config: Any, num_stages: int, tp: int, stage: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, ...]:
    """Measure, exchange, split: the same counts on every rank (call it on all of them)."""
    mine = measure(hf_config, tp, dtype, device, last=stage == num_stages - 1)
    stages = exchange(mine, num_stages, tp)
    counts = auto_split(stages, hf_config.num_hidden_layers, layer_bytes(hf_config, tp, dtype))
    times = step_times(stages, counts)
    log.info(
        "pp_layer_split_auto",
        split=",".join(map(str, counts)),
        layer_ms=[round(p.layer_s * 1e3, 3) for p in stages],
        head_ms=[round(p.head_s * 1e3, 3) for p in stages],
        predicted_step_ms=[round(t * 1e3, 3) for t in times],
        spread=round(max(times) / min(times), 3) if min(times) > 0 else math.inf,
    )
    return counts
