"""The numbers and switches that define a network, read once from its Hugging Face config.

Every family (worker_svc/models/<family>.py) turns its config into one `ModelShape`; the
shared layers (worker_svc/models/decoder.py) read nothing else. A switch a family does not
use keeps its default, which is the Llama behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from worker_svc.device.parallel import ParallelGroup, check_splittable
from worker_svc.layers.tp_layers import kv_head_range

# transformers' names of the feed-forward activations we run (gate_proj's output goes through
# it, then times up_proj's).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# The rope of a model with one set of rope parameters for every layer.
DEFAULT_ROPE = "default"


@dataclass(frozen=True)
class ModelShape:
    """Under tensor parallelism (`tp_size` > 1) `num_heads` and `num_kv_heads` are this rank's
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
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotation (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # one of ACTIVATIONS
    # Per layer: how many positions a query sees (itself included); 0 = every earlier one.
    # Empty: 0 for every layer.
    layer_windows: tuple[int, ...] = ()
    # Per layer: which of the config's rope parameter sets it rotates with (Gemma 3 gives
    # sliding layers their own base); empty: the config's one set for every layer.
    layer_rope: tuple[str, ...] = ()
    attn_softcap: float = 0.0  # scores become cap * tanh(score / cap) (Gemma 2); 0: off
    final_softcap: float = 0.0  # the same on the logits
    attn_scale: float = 0.0  # 0: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    norm_offset: float = 0.0  # norms apply (offset + w): checkpoints of Gemma store w - 1
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden), in the model dtype)
    # Mixture of experts (0 experts: every layer dense).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # each expert's width
    renormalize_top_k: bool = True  # the chosen experts' weights rescaled to sum to one
    # Per layer: whether its feed-forward is the experts (True) or a dense MLP; empty: all
    # sparse when there are experts.
    sparse_layers: tuple[bool, ...] = ()
    tp_size: int = 1
    total_num_heads: int = 0  # 0: same as num_heads
    total_num_kv_heads: int = 0  # 0: same as num_kv_heads

    def __post_init__(self) -> None:
        if not self.total_num_heads:
            object.__setattr__(self, "total_num_heads", self.num_heads)
        if not self.total_num_kv_heads:
            object.__setattr__(self, "total_num_kv_heads", self.num_kv_heads)
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if self.num_experts and self.hidden_act != "silu":
            raise ValueError(f"experts with activation {self.hidden_act!r} are not supported (SiLU only)")
        for name in ("layer_windows", "layer_rope", "sparse_layers"):
            got = getattr(self, name)
            if got and len(got) != self.num_layers:
                raise ValueError(f"{name} has {len(got)} entries for {self.num_layers} layers")

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_kind(self, layer: int) -> str:
        return self.layer_rope[layer] if self.layer_rope else DEFAULT_ROPE

    def is_sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.sparse_layers[layer] if self.sparse_layers else True)

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5


def architecture(config: Any) -> str:
    """config.json's first architecture; a config without one is read as Llama."""
    archs = getattr(config, "architectures", None) or ["LlamaForCausalLM"]
    return str(archs[0])


def text_config(config: Any) -> Any:
    """The language model's part of a config (a multimodal config nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def sliding_windows(text: Any) -> tuple[int, ...]:
    """Per-layer windows from `layer_types` where the config has them ("sliding_attention"
    layers take `sliding_window`), else `sliding_window` for every layer; () without one."""
    window = getattr(text, "sliding_window", None) or 0
    if not window or window >= text.max_position_embeddings:  # a window no sequence can outgrow
        return ()
    types = getattr(text, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window,) * text.num_hidden_layers


def base_shape(config: Any, tp_size: int, **features: Any) -> ModelShape:
    """The shape every family shares, read from `config`; `features` set the family's switches.

    Refuses a group size the heads or the feed-forward width cannot be split into.
    """
    text = text_config(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    check_splittable(tp_size, heads, kv_heads, text.intermediate_size)
    shape = ModelShape(
        architecture=architecture(config),
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_layers=text.num_hidden_layers,
        num_heads=heads // tp_size,
        num_kv_heads=kv_head_range(kv_heads, ParallelGroup(0, tp_size))[1],
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(text, "attention_bias", False)),
        o_bias=bool(getattr(text, "attention_bias", False)),
        mlp_bias=bool(getattr(text, "mlp_bias", False)),
        layer_windows=sliding_windows(text),
        tp_size=tp_size,
        total_num_heads=heads,
        total_num_kv_heads=kv_heads,
    )
    shape = replace(shape, **features)
    if shape.num_experts:  # each expert's width is split like the dense MLP's
        check_splittable(tp_size, heads, kv_heads, shape.moe_intermediate_size)
    return shape
