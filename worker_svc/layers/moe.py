"""A mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE): a router and top-k experts.

Router: logits = x W_g^T over the experts, softmax in float32, the top_k of them, renormalised
to sum to one where the family does (Mixtral always, Qwen3-MoE with `norm_topk_prob`).
Experts: each a SiLU-gated MLP; a token's output is the routing-weighted sum of its top_k
experts' outputs.

Tensor parallelism shards every expert's intermediate width across the ranks (as
MergedColumnParallelLinear / RowParallelLinear do for a dense MLP): each rank holds all the
experts, rows [r*I/tp, (r+1)*I/tp) of each one's gate and up and those columns of its down,
computes its partial sums, and one all-reduce adds them. Every rank routes identically (the
router is replicated and sees the same input).

Weights are stacked: w13 [experts, 2 * I/tp, hidden] (the rank's gate rows, then its up
rows), w2 [experts, hidden, I/tp]; the checkpoint's per-expert tensors are loaded into their
slices, shard id "<expert>.gate" / ".up" / ".down".

Paths: "triton" runs kernels/fused_moe.py (grouped GEMMs over tokens sorted by expert); the
others run the same sort in torch and one pair of matmuls per chosen expert (a loop over
experts, never over tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused_moe import fused_moe
from worker_svc.device.parallel import ParallelGroup
from worker_svc.layers.replicated import Loaded, copy_checked, load_replicated, loaded_shape

EXPERT_PARTS = ("gate", "up", "down")


class FusedMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        group: ParallelGroup,
        dtype: torch.dtype | None = None,
        kernels: str = "torch",
    ) -> None:
        super().__init__()
        if intermediate_size % group.world_size:
            raise ValueError(f"tp={group.world_size} cannot split an expert intermediate size of {intermediate_size}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        self.group = group
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.inter = intermediate_size // group.world_size  # this rank's share of each expert
        self.inter_start = group.rank * self.inter
        self.intermediate_size = intermediate_size
        self.kernels = kernels
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)  # the router, replicated
        self.gate.weight.requires_grad_(False)
        self.gate.weight.weight_loader = load_replicated  # type: ignore[attr-defined]
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter, dtype=dtype), requires_grad=False)
        for param, parts in ((self.w13, ("gate", "up")), (self.w2, ("down",))):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            param.shard_ids = tuple(f"{e}.{p}" for e in range(num_experts) for p in parts)  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str | None = None) -> None:
        expert, _, part = (shard_id or "").partition(".")
        if not expert.isdigit() or int(expert) >= self.num_experts or part not in EXPERT_PARTS:
            raise ValueError(f"unknown expert shard {shard_id!r} ({self.num_experts} experts, parts {EXPERT_PARTS})")
        e, a, b = int(expert), self.inter_start, self.inter_start + self.inter
        shape = loaded_shape(loaded)
        hidden = self.w2.shape[1]
        what = f"expert {e} {part}"
        if part == "down":
            if shape != (hidden, self.intermediate_size):
                raise ValueError(
                    f"{what}: checkpoint tensor has shape {shape}, the model wants {(hidden, self.intermediate_size)}"
                )
            copy_checked(param.data[e], loaded[:, a:b], what)
            return
        if shape != (self.intermediate_size, hidden):
            raise ValueError(
                f"{what}: checkpoint tensor has shape {shape}, the model wants {(self.intermediate_size, hidden)}"
            )
        rows = slice(0, self.inter) if part == "gate" else slice(self.inter, 2 * self.inter)
        copy_checked(param.data[e, rows], loaded[a:b], what)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights, expert ids), both [tokens, top_k]."""
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.kernels == "triton":
            out = fused_moe(x.contiguous(), self.w13, self.w2, weights, ids)
        else:
            out = self._experts(x, weights, ids)
        return self.group.all_reduce(out)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The torch path: (token, choice) pairs sorted by expert, one matmul pair per expert."""
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weights = weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // self.top_k
            gate, up = F.linear(x[tokens], self.w13[expert]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.w2[expert])
            out.index_add_(0, tokens, (h * pair_weights[pairs, None]).to(x.dtype))
        return out
