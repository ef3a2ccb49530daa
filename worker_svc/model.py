"""A Llama-family decoder over the paged KV cache (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2).

Written to read like the reference: per layer, x -> RMSNorm -> attention -> + x -> RMSNorm
-> SwiGLU MLP -> + x. Tokens of every sequence of the step are flattened into one batch
([tokens, hidden]); the attention backend is the only place that knows about sequences.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker_svc.attention import PagedAttentionBackend, TorchPagedAttention
from worker_svc.cpu_attention import CpuPagedAttention
from worker_svc.layers import KERNELS, Loaded, RMSNorm, SiluAndMul, cpu_kernels_for
from worker_svc.parallel import SINGLE, ParallelGroup, check_splittable
from worker_svc.rotary import RotaryEmbedding
from worker_svc.tp_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    can_pack_for_cpu,
    kv_head_range,
)
from worker_svc.triton_attention import TritonPagedAttention

ATTENTION_BACKENDS = KERNELS
Backend = PagedAttentionBackend
# Metadata of whichever backend built it; layers pass it through untouched.
AttentionMetadata = Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# Checkpoint tensors that fill one fused parameter: (fused name, checkpoint name, shard id).
_FUSED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", "gate"),
    (".gate_up_proj.", ".up_proj.", "up"),
)


@dataclass(frozen=True)
class ModelShape:
    """The numbers that define the network, read once from the HF config.

    Under tensor parallelism (`tp_size` > 1) `num_heads` and `num_kv_heads` are this rank's
    share, because that is what the KV cache and the attention backends hold and compute;
    `total_num_heads` / `total_num_kv_heads` are the checkpoint's. Every other number is
    the checkpoint's: each TP layer divides its own widths (vocab, intermediate size).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotation (Qwen3)
    tp_size: int = 1
    total_num_heads: int = 0  # 0: same as num_heads
    total_num_kv_heads: int = 0  # 0: same as num_kv_heads

    def __post_init__(self) -> None:
        if not self.total_num_heads:
            object.__setattr__(self, "total_num_heads", self.num_heads)
        if not self.total_num_kv_heads:
            object.__setattr__(self, "total_num_kv_heads", self.num_kv_heads)

    @classmethod
    def from_config(cls, config: Any, tp_size: int = 1) -> ModelShape:
        """The shape one rank of a group of `tp_size` sees; refuses a size the model cannot split."""
        archs = getattr(config, "architectures", None) or []
        arch = archs[0] if archs else "LlamaForCausalLM"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if arch == "MistralForCausalLM" and getattr(text, "sliding_window", None) not in (None, 0):
            if text.sliding_window < text.max_position_embeddings:
                raise ValueError("Mistral with a sliding window shorter than the context is not supported")
        if arch == "Qwen3ForCausalLM" and getattr(text, "use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window is not supported")
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        check_splittable(tp_size, heads, kv_heads, text.intermediate_size)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(getattr(text, "attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_layers=text.num_hidden_layers,
            num_heads=heads // tp_size,
            num_kv_heads=kv_head_range(kv_heads, ParallelGroup(0, tp_size))[1],
            head_dim=head_dim,
            rms_norm_eps=text.rms_norm_eps,
            max_position_embeddings=text.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 has biases on q, k, v only; Llama's attention_bias covers o_proj as well.
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tp_size=tp_size,
            total_num_heads=heads,
            total_num_kv_heads=kv_heads,
        )


class Attention(nn.Module):
    """This rank's heads: qkv_proj yields its query heads and their KV heads, o_proj sums the ranks."""

    def __init__(
        self,
        shape: ModelShape,
        rotary: RotaryEmbedding,
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
        self.rotary = rotary
        self.backend = backend
        # Qwen3: RMSNorm over each head's query and key before the rotation; one weight of
        # head_dim shared by every head, so every rank holds all of it.
        self.q_norm = RMSNorm(d, shape.rms_norm_eps, kernels, dtype) if shape.qk_norm else None
        self.k_norm = RMSNorm(d, shape.rms_norm_eps, kernels, dtype) if shape.qk_norm else None

    def forward(
        self, rope: Any, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
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
        q, k = self.rotary.rotate(rope, q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta)  # [tokens, heads, head_dim]
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, kernels: str, group: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        inter = shape.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            shape.hidden_size, inter, group, bias=shape.mlp_bias, dtype=dtype
        )
        self.down_proj = RowParallelLinear(inter, shape.hidden_size, group, bias=shape.mlp_bias, dtype=dtype)
        self.act = SiluAndMul(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        shape: ModelShape,
        rotary: RotaryEmbedding,
        backend: Backend,
        kernels: str,
        group: ParallelGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, kernels, dtype)
        self.self_attn = Attention(shape, rotary, backend, group, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, kernels, dtype)
        self.mlp = MLP(shape, kernels, group, dtype)

    def forward(
        self,
        rope: Any,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        shape: ModelShape,
        rotary: RotaryEmbedding,
        backend: Backend,
        kernels: str,
        group: ParallelGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, group, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(shape, rotary, backend, kernels, group, dtype) for _ in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, kernels, dtype)


class CausalLM(nn.Module):
    """The decoder plus its LM head; `forward` returns hidden states, `compute_logits` logits.

    `attention_backend` "triton" runs attention, the KV store, RMSNorm, rotary and SiLU-and-mul
    through our Triton kernels (matmuls stay with cuBLAS); "cpu" runs them through our C++
    kernels (matmuls with oneDNN, see `pack_linear_weights`); "torch" keeps everything in torch.

    `group` is this process's tensor-parallel group: the model holds that rank's shard and
    its forward calls the group's collectives (every rank of the group must run it).

    Every parameter and buffer is made in `dtype` on the ambient device (build it under
    `torch.device(...)`): loading never holds a float32 copy of a bfloat16 model.
    """

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        max_positions: int | None = None,
        attention_backend: str = "torch",
        group: ParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {attention_backend!r}"
            )
        shape = ModelShape.from_config(config, group.world_size)
        self.shape = shape
        self.group = group
        self.rotary = RotaryEmbedding(
            config.get_text_config() if hasattr(config, "get_text_config") else config,
            shape.head_dim,
            max_positions or shape.max_position_embeddings,
            dtype,
            attention_backend,
        )
        scale = shape.head_dim**-0.5
        self.attention: Backend
        if attention_backend == "cpu":
            self.attention = CpuPagedAttention(
                shape.num_heads, shape.num_kv_heads, shape.head_dim, scale, cpu_kernels_for("cpu")
            )
        else:
            backend_cls = TritonPagedAttention if attention_backend == "triton" else TorchPagedAttention
            self.attention = backend_cls(shape.num_heads, shape.num_kv_heads, shape.head_dim, scale)
        self.model = DecoderModel(shape, self.rotary, self.attention, attention_backend, group, dtype)
        # A tied head reads the embedding's shard: no second copy, and no lm_head in the checkpoint.
        tied = self.model.embed_tokens if shape.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(shape.vocab_size, shape.hidden_size, group, tied, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [tokens, hidden]
        rope = self.rotary.lookup(positions)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(rope, x, residual, kv_cache, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def pack_linear_weights(self) -> None:
        """Hand every linear weight to oneDNN in its GEMM layout, once (CPU, bfloat16)."""
        for module in self.modules():
            pack = getattr(module, "pack_for_cpu", None)
            weight = getattr(module, "weight", None)
            if pack is not None and isinstance(weight, torch.Tensor) and can_pack_for_cpu(weight):
                pack()

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] (the full vocabulary, on every rank): float32, or in the
        model's dtype without `upcast`."""
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Hand every checkpoint tensor to its parameter's weight_loader; refuse gaps and strays.

        A tensor may be a lazy safetensors slice: the weight_loader reads only this rank's part.
        """
        params = dict(self.named_parameters())
        expected = {(name, shard) for name, p in params.items() for shard in getattr(p, "shard_ids", ("",))}
        loaded: set[tuple[str, str]] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name.startswith("lm_head.") and self.shape.tie_word_embeddings):
                continue
            shard = None
            for fused, original, shard_id in _FUSED:
                if original in name:
                    name, shard = name.replace(original, fused), shard_id
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name} has no place in {self.shape.architecture}")
            param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
            loaded.add((name, shard or ""))
        missing = sorted(f"{name}[{shard}]" if shard else name for name, shard in expected - loaded)
        if missing:
            raise ValueError(
                f"checkpoint lacks weights for: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
            )
