"""The layers every family is made of, over the paged KV cache.

Written to read like the reference: per layer, x -> RMSNorm -> attention -> + x -> RMSNorm
-> gated MLP -> + x (in SandwichDecoderLayer, Gemma's: the attention's and the MLP's outputs are
normed again before they join the residual). Tokens of every sequence of the step are
flattened into one batch ([tokens, hidden]); the attention backend is the only place that
knows about sequences. What differs between families is in `ModelShape` (see shape.py) and,
where a family's layer is built differently, in its own module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from kernels.cpu_linear import can_pack
from worker_svc.device.parallel import SINGLE, ParallelGroup
from worker_svc.device.pipeline import PipelineStage, holds_tensor
from worker_svc.layers.attention import PagedAttentionBackend, TorchPagedAttention
from worker_svc.layers.cpu_attention import CpuPagedAttention
from worker_svc.layers.moe import FusedMoE
from worker_svc.layers.replicated import KERNELS, GeluAndMul, Loaded, RMSNorm, SiluAndMul, cpu_kernels_for
from worker_svc.layers.rotary import RotaryEmbedding
from worker_svc.layers.tp_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from worker_svc.layers.triton_attention import TritonPagedAttention
from worker_svc.models.shape import DEFAULT_ROPE, ModelShape, text_config

ATTENTION_BACKENDS = KERNELS
Backend = PagedAttentionBackend
# Metadata of whichever backend built it; layers pass it through untouched.
AttentionMetadata = Any

# An expert's tensor in a checkpoint (Qwen3-MoE's names, or Mixtral's w1/w3/w2) and the part
# it fills of the stacked expert weights (worker_svc/layers/moe.py).
_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}

# Checkpoint tensors that fill one fused parameter: (fused name, checkpoint name, shard id).
_FUSED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", "gate"),
    (".gate_up_proj.", ".up_proj.", "up"),
)


def norm(shape: ModelShape, width: int, kernels: str, dtype: torch.dtype) -> RMSNorm:
    return RMSNorm(width, shape.rms_norm_eps, kernels, dtype, offset=shape.norm_offset)


class Attention(nn.Module):
    """This rank's heads: qkv_proj yields its query heads and their KV heads, o_proj sums the ranks."""

    def __init__(
        self,
        shape: ModelShape,
        layer: int,
        backend: Backend,
        group: ParallelGroup,
        dtype: torch.dtype,
        kernels: str = "torch",
    ) -> None:
        super().__init__()
        h, kvh, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.qkv_proj = QKVParallelLinear(
            shape.hidden_size,
            d,
            shape.total_num_heads,
            shape.total_num_kv_heads,
            group,
            bias=shape.qkv_bias,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            shape.total_num_heads * d, shape.hidden_size, group, bias=shape.o_bias, dtype=dtype
        )
        self.backend = backend
        self.window = shape.window(layer)
        self.softcap = shape.attn_softcap
        # Qwen3 and Gemma 3: RMSNorm over each head's query and key before the rotation; one
        # weight of head_dim shared by every head, so every rank holds all of it.
        self.q_norm = norm(shape, d, kernels, dtype) if shape.qk_norm else None
        self.k_norm = norm(shape, d, kernels, dtype) if shape.qk_norm else None

    def forward(
        self,
        rotary: RotaryEmbedding,
        rope: Any,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [tokens, (heads + 2 * kv_heads) * head_dim], this rank's heads
        q, k, v = qkv.split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1
        )
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary.rotate(rope, q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.window, self.softcap)
        return self.o_proj(out.reshape(t, -1))  # out: [tokens, heads, head_dim]


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, kernels: str, group: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        inter = shape.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            shape.hidden_size, inter, group, bias=shape.mlp_bias, dtype=dtype
        )
        self.down_proj = RowParallelLinear(inter, shape.hidden_size, group, bias=shape.mlp_bias, dtype=dtype)
        self.silu = shape.hidden_act == "silu"
        self.act: nn.Module = SiluAndMul(kernels) if self.silu else GeluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up_proj.silu_and_mul(x) if self.silu else None
        return self.down_proj(fused if fused is not None else self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm (Llama): the residual stream passes each norm, which adds and normalises in one go."""

    def __init__(
        self,
        shape: ModelShape,
        layer: int,
        backend: Backend,
        kernels: str,
        group: ParallelGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.input_layernorm = norm(shape, shape.hidden_size, kernels, dtype)
        self.self_attn = Attention(shape, layer, backend, group, dtype, kernels)
        self.post_attention_layernorm = norm(shape, shape.hidden_size, kernels, dtype)
        self.mlp: nn.Module = (
            FusedMoE(
                shape.hidden_size,
                shape.moe_intermediate_size,
                shape.num_experts,
                shape.experts_per_token,
                shape.renormalize_top_k,
                group,
                dtype,
                kernels,
            )
            if shape.is_sparse(layer)
            else MLP(shape, kernels, group, dtype)
        )

    def forward(
        self,
        rotary: RotaryEmbedding,
        rope: Any,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rotary, rope, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2 and 3: the attention's and the MLP's outputs are normed before they join the
    residual, and the MLP's input is normed on its own (pre_feedforward_layernorm).

        h = norm_post_attn(attn(norm_in(x))) ; x = x + h
        h = norm_post_ffn(mlp(norm_pre_ffn(x))) ; x = x + h

    The residual add is fused into the next norm as in DecoderLayer: the layer returns
    (the MLP's normed output, the residual before it).
    """

    def __init__(
        self,
        shape: ModelShape,
        layer: int,
        backend: Backend,
        kernels: str,
        group: ParallelGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(shape, layer, backend, kernels, group, dtype)
        self.pre_feedforward_layernorm = norm(shape, shape.hidden_size, kernels, dtype)
        self.post_feedforward_layernorm = norm(shape, shape.hidden_size, kernels, dtype)

    def forward(
        self,
        rotary: RotaryEmbedding,
        rope: Any,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h, _ = self.post_attention_layernorm(self.self_attn(rotary, rope, h, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h, _ = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        shape: ModelShape,
        layer_cls: type[DecoderLayer],
        backend: Backend,
        kernels: str,
        group: ParallelGroup,
        dtype: torch.dtype,
        stage: PipelineStage,
    ) -> None:
        super().__init__()
        # A pipeline stage builds only its part: the embedding on the first (and on the last
        # when the head is tied to it), its layers (the others hold nothing), the norm last.
        embeds = stage.is_first or (stage.is_last and shape.tie_word_embeddings)
        self.embed_tokens = (
            VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, group, dtype) if embeds else None
        )
        self.layers = nn.ModuleList(
            layer_cls(shape, i, backend, kernels, group, dtype) if stage.holds(i) else nn.Identity()
            for i in range(shape.num_layers)
        )
        self.norm = norm(shape, shape.hidden_size, kernels, dtype) if stage.is_last else None


class CausalLM(nn.Module):
    """The decoder plus its LM head; `forward` returns hidden states, `compute_logits` logits.

    `attention_backend` "triton" runs attention, the KV store, RMSNorm, rotary and SiLU-and-mul
    through our Triton kernels (matmuls stay with cuBLAS); "cpu" runs them through our C++
    kernels (matmuls on weights packed once, see `pack_linear_weights`); "torch" keeps
    everything in torch.

    `group` is this process's tensor-parallel group: the model holds that rank's shard and
    its forward calls the group's collectives (every rank of the group must run it).

    Every parameter and buffer is made in `dtype` on the ambient device (build it under
    `torch.device(...)`): loading never holds a float32 copy of a bfloat16 model.
    """

    def __init__(
        self,
        config: Any,
        shape: ModelShape,
        layer_cls: type[DecoderLayer],
        dtype: torch.dtype,
        max_positions: int | None = None,
        attention_backend: str = "torch",
        group: ParallelGroup = SINGLE,
        renames: tuple[tuple[str, str], ...] = (),
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.stage = stage or PipelineStage(layers=range(shape.num_layers))
        self.dtype = dtype
        self.renames = renames  # checkpoint name fragments and ours (Mixtral's block_sparse_moe)
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {attention_backend!r}"
            )
        self.shape = shape
        self.group = group
        positions = max_positions or shape.max_position_embeddings
        # One table per rope parameter set the layers use; most models have one ("default").
        text = text_config(config)
        self.rotaries = nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    text, shape.head_dim, positions, dtype, attention_backend, None if kind == DEFAULT_ROPE else kind
                )
                for kind in sorted({shape.rope_kind(i) for i in range(shape.num_layers)})
            }
        )
        self.attention: Backend
        if attention_backend == "cpu":
            self.attention = CpuPagedAttention(
                shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale, cpu_kernels_for("cpu")
            )
        else:
            backend_cls = TritonPagedAttention if attention_backend == "triton" else TorchPagedAttention
            self.attention = backend_cls(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale)
        self.model = DecoderModel(shape, layer_cls, self.attention, attention_backend, group, dtype, self.stage)
        # A tied head reads the embedding's shard: no second copy, and no lm_head in the checkpoint.
        tied = self.model.embed_tokens if shape.tie_word_embeddings else None
        self.lm_head = (
            ParallelLMHead(shape.vocab_size, shape.hidden_size, group, tied, dtype) if self.stage.is_last else None
        )
        # Gemma multiplies the embeddings by sqrt(hidden) rounded to the model dtype.
        self.embed_scale = float(torch.tensor(shape.embed_scale, dtype=dtype, device="cpu"))

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """[tokens, hidden]: the final norm's output; on a stage before the last, what it
        sent on (kv_caches: this stage's layers')."""
        stage = self.stage
        residual = None
        if stage.is_first:
            x = cast(nn.Module, self.model.embed_tokens)(input_ids)  # [tokens, hidden]
            if self.embed_scale != 1.0:
                x = x * self.embed_scale
        else:
            x, residual = stage.recv_hidden(input_ids.shape[0], self.shape.hidden_size, self.dtype, input_ids.device)
        ropes = {
            kind: (rotary, cast(RotaryEmbedding, rotary).lookup(positions)) for kind, rotary in self.rotaries.items()
        }
        for i, kv_cache in zip(stage.layers, kv_caches):
            rotary, rope = ropes[self.shape.rope_kind(i)]
            x, residual = self.model.layers[i](rotary, rope, x, residual, kv_cache, meta)
        if not stage.is_last:
            stage.send_hidden(x, cast(torch.Tensor, residual))
            return x
        x, _ = cast(nn.Module, self.model.norm)(x, residual)
        return x

    def pack_linear_weights(self) -> None:
        """Pack every linear weight once for the CPU's bfloat16 GEMM (kernels/cpu_linear.py)."""
        for module in self.modules():
            pack = getattr(module, "pack_for_cpu", None)
            weight = getattr(module, "weight", None)
            if pack is not None and isinstance(weight, torch.Tensor) and can_pack(weight):
                pack()

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] (the full vocabulary, on every rank): float32, or in the
        model's dtype without `upcast`; soft-capped where the family caps them (Gemma 2)."""
        logits = cast(nn.Module, self.lm_head)(hidden)
        if upcast:
            logits = logits.float()
        cap = self.shape.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Hand every checkpoint tensor to its parameter's weight_loader; refuse gaps and strays.

        A tensor may be a lazy safetensors slice: the weight_loader reads only this rank's part.
        """
        params = dict(self.named_parameters())
        expected = {(name, shard) for name, p in params.items() for shard in getattr(p, "shard_ids", ("",))}
        loaded: set[tuple[str, str]] = set()
        for name, tensor in weights:
            if not holds_tensor(self.stage, name, self.model.embed_tokens is not None):
                continue  # another pipeline stage's
            if "rotary_emb.inv_freq" in name or (name.startswith("lm_head.") and self.shape.tie_word_embeddings):
                continue
            for theirs, ours in self.renames:
                name = name.replace(theirs, ours)
            shard = None
            expert = _EXPERT.match(name)
            if expert:
                prefix, index, part = expert.groups()
                part = _EXPERT_PART[part]
                name, shard = f"{prefix}.{'w2' if part == 'down' else 'w13'}", f"{index}.{part}"
            for fused, original, shard_id in () if expert else _FUSED:
                if original in name:
                    name, shard = name.replace(original, fused), shard_id
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name} has no place in {self.shape.architecture}")
            param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
            # A fused checkpoint tensor (shard None where the parameter has parts) fills them all.
            loaded.update((name, s) for s in ((shard,) if shard else getattr(param, "shard_ids", ("",))))
        missing = sorted(f"{name}[{shard}]" if shard else name for name, shard in expected - loaded)
        if missing:
            raise ValueError(
                f"checkpoint lacks weights for: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
            )
