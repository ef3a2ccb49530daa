"""Random-weight checkpoints the sections serve: a GPU machine has no network, and the 64 MiB
a device call carries cannot hold a real model, so everything but SmolLM2 is made here.

  llama_1b        Llama-3.2-1B's shape (llama3-scaled RoPE, 128k vocabulary): the throughput
                  and memory sections' model; its logits are flat, so it is no parity check
  tiny_family     one small model per family the worker supports, with the family's
                  features on (sliding windows shorter than the prompts, soft-capping,
                  LongRoPE, partial rotary, experts) and large weights, so that logits are
                  peaked and greedy choices do not hinge on rounding
  tp_model        a small peaked Llama that splits over 2 ranks, with a tokenizer (the
                  scheduler of `llmserve up` loads one)

tests/test_model_families_e2e.py builds the same families, but through tests/conftest.py,
which needs pytest and SmolLM2's tokenizer; the worker reads no tokenizer, so none is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 512
PROMPT_LENGTHS = (20, 9, 31)
NEW_TOKENS = 16


def families() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    """name -> (config class, model class, overrides), one per architecture of
    worker_svc.models.registry.FAMILIES; head_dim 64, which the Triton kernels and the C++
    ones both take."""
    import transformers as tf

    longest = max(PROMPT_LENGTHS) + NEW_TOKENS
    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "mistral-sliding-window": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=7)),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3-sliding-window": (
            tf.Qwen3Config,
            tf.Qwen3ForCausalLM,
            dict(
                head_dim=64, use_sliding_window=True, sliding_window=7, max_window_layers=1, tie_word_embeddings=False
            ),
        ),
        "qwen3-moe": (
            tf.Qwen3MoeConfig,
            tf.Qwen3MoeForCausalLM,
            dict(head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[0]),
        ),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(num_local_experts=8, num_experts_per_tok=2)),
        # LongRoPE within the original length: past it transformers' generate re-rotates its
        # whole cache with the long factors, where the worker rotates only what lies past it.
        "phi3-longrope": (
            tf.Phi3Config,
            tf.Phi3ForCausalLM,
            dict(
                pad_token_id=0,
                original_max_position_embeddings=longest,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0 + 0.05 * i for i in range(32)],
                    "long_factor": [2.0 + 0.1 * i for i in range(32)],
                },
            ),
        ),
        "phi4-partial-rotary": (
            tf.Phi3Config,
            tf.Phi3ForCausalLM,
            dict(pad_token_id=0, partial_rotary_factor=0.75, sliding_window=7),
        ),
        "gemma2": (
            tf.Gemma2Config,
            tf.Gemma2ForCausalLM,
            dict(head_dim=64, query_pre_attn_scalar=48, sliding_window=7, attn_logit_softcapping=4.0),
        ),
        "gemma3": (
            tf.Gemma3TextConfig,
            tf.Gemma3ForCausalLM,
            dict(
                head_dim=64,
                query_pre_attn_scalar=48,
                sliding_window=7,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
    }


def tiny_family(out: Path, name: str) -> Path:
    config_cls, model_cls, overrides = families()[name]
    params: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
    )
    params.update(overrides)
    torch.manual_seed(0)
    model_cls(config_cls(**params)).float().save_pretrained(str(out))
    return out


def llama_1b(out: Path, device: torch.device, tiny: bool) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape: dict[str, Any] = (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=TINY_VOCAB,
            max_position_embeddings=512,
        )
        if tiny
        else dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=8192,
        )
    )
    shape["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256 if tiny else 8192,
    }
    torch.manual_seed(0)
    with torch.device(device):  # a random init of 1.2B parameters takes seconds on a GPU, minutes on a CPU
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, initializer_range=0.05, **shape))
    model.bfloat16().save_pretrained(str(out))
    del model
    write_tokenizer(out, int(shape["vocab_size"]))
    return out


def tp_model(out: Path, tiny: bool) -> Path:
    """Heads and KV heads that split over 2 ranks; float32 on every device (see tensor_parallel)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, heads, kv_heads, vocab = (128, 4, 2, TINY_VOCAB) if tiny else (512, 8, 4, 4096)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2 if tiny else 4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(str(out))
    write_tokenizer(out, vocab)
    return out


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one word per id ("t0", "t1", ...): the services need a fast
    tokenizer, and a GPU machine without network access cannot download one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(str(out))
