"""Our decoder over the paged cache against transformers' logits, on random-weight configs.

Three sequences run through mixed steps (fresh prefill, a later chunk, decode) and a step of
decodes only, with permuted block tables; every fed token's logits must match the reference's at that position within
1e-4 in float32.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from common.config import CacheConfig, WorkerConfig
from tests.conftest import KERNEL_DEVICE
from tests.plans import Feed, make_plan
from worker_svc.step.runner import ModelRunner

BASE: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def longrope(head_dim: int) -> dict[str, Any]:
    half = head_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.3 * i for i in range(half)],
        "long_factor": [2.0 + 0.5 * i for i in range(half)],
    }


CASES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama-gqa-untied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "llama-mha-tied": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-mqa-headdim": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(num_attention_heads=8, num_key_value_heads=1, head_dim=16),
    ),
    # More KV heads than the block-diagonal decode path takes: the per-head path.
    "llama-mha-16-kv-heads": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=16, num_key_value_heads=16)),
    "llama-attention-bias": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True)),
    "llama2-linear-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    ),
    "llama3-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    ),
    "qwen2-qkv-bias": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    # Per-head q/k RMSNorm, and a head size that is not hidden / heads.
    "qwen3-qk-norm": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
    # Sliding windows shorter than every prompt and not a multiple of the block size (8): on
    # every layer (Mistral), on the layers past max_window_layers (Qwen2, Qwen3).
    "mistral-sliding-window": (MistralConfig, MistralForCausalLM, dict(sliding_window=6)),
    "qwen2-sliding-window": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "qwen3-sliding-window": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(head_dim=32, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    # Phi-3: q/k/v and gate/up fused in the checkpoint, LongRoPE (the prompts stay below the
    # original length: the short factors, and the attention factor of max / original).
    "phi3-longrope": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(
            pad_token_id=0,
            eos_token_id=1,
            original_max_position_embeddings=64,
            rope_parameters=longrope(16),
        ),
    ),
    # Phi-4-mini's shape: half of each head rotates; and a sliding window on every layer.
    "phi4-partial-rotary": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(pad_token_id=0, eos_token_id=1, partial_rotary_factor=0.5, sliding_window=6, tie_word_embeddings=True),
    ),
    # Mixture of experts: top-2 of 8 renormalised (Mixtral, with a sliding window), top-3 of 6
    # not renormalised with a dense first layer (Qwen3-MoE).
    "mixtral-sliding-window": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=6),
    ),
    "qwen3-moe-dense-first": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            head_dim=32,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[0],
            tie_word_embeddings=False,
        ),
    ),
    # Sandwich norms, (1 + w) norms, scaled embeddings, GeGLU, query_pre_attn_scalar, a sliding
    # layer then a global one, attention and final soft-capping low enough to bite.
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=6,
            attn_logit_softcapping=0.8,
            final_logit_softcapping=0.5,
            tie_word_embeddings=True,
        ),
    ),
    # Gemma 3: q/k norms, and the sliding layers rotate with a base of their own while the
    # global ones use linear scaling.
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        ),
    ),
}

BLOCK = 8


def build(
    tmp_path: Path, case: str, backend: str = "torch", dtype: str = "float32"
) -> tuple[torch.nn.Module, ModelRunner]:
    """backend "cpu" attends every query with our C++ kernel; "cpu-sdpa" sends multi-token
    queries to torch's SDPA, as a CPU with AMX does (worker_svc/layers/cpu_attention.py)."""
    config_cls, model_cls, extra = CASES[case]
    sdpa_prefills = backend == "cpu-sdpa"
    backend = "cpu" if sdpa_prefills else backend
    if backend == "cpu":
        extra = extra | {"head_dim": 64}  # the C++ attention kernel's smallest head
        if "short_factor" in extra.get("rope_parameters", {}):
            # LongRoPE's factors are sized by hidden / heads, whatever head_dim says.
            extra = {k: v for k, v in extra.items() if k != "head_dim"} | dict(
                hidden_size=256, rope_parameters=longrope(64)
            )
    torch.manual_seed(0)
    ref = model_cls(config_cls(**(BASE | extra))).float().eval()
    # Biases start at zero and norm weights at one; give them values so a dropped or
    # misplaced one shows.
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.1)
            elif name.endswith(".gate.weight"):  # a router: decisive, so no near-tie flips a choice
                p.normal_(0, 1.0)
    ref.save_pretrained(str(tmp_path))
    device = KERNEL_DEVICE if backend == "triton" else "cpu"
    runner = ModelRunner(
        WorkerConfig(
            model=str(tmp_path),
            dtype=dtype,
            device=device,
            attention_backend=backend,
            cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=40),
        )
    )
    if backend == "cpu":
        runner.model.attention.sdpa_prefills = sdpa_prefills
    return ref, runner


# The Triton path runs under the interpreter on CPU (slow), so it covers a subset of configs.
TRITON_CASES = [
    "llama-gqa-untied",
    "llama-mqa-headdim",
    "llama3-rope",
    "qwen2-qkv-bias",
    "qwen3-qk-norm",
    "mistral-sliding-window",
    "gemma2",
    "gemma3",
    "phi4-partial-rotary",
    "mixtral-sliding-window",
    "qwen3-moe-dense-first",
]


# The CPU backend with prompts on SDPA: plain, windowed and soft-capped attention.
SDPA_CASES = ["llama-gqa-untied", "qwen2-sliding-window", "mistral-sliding-window", "gemma2"]


@pytest.mark.parametrize(
    ("case", "backend"),
    [(c, "torch") for c in CASES]
    + [(c, "triton") for c in TRITON_CASES]
    + [(c, "cpu") for c in CASES]
    + [(c, "cpu-sdpa") for c in SDPA_CASES],
)
def test_logits_match_transformers(tmp_path: Path, case: str, backend: str) -> None:
    ref, runner = build(tmp_path, case, backend)
    assert runner.attention_backend == backend.removesuffix("-sdpa")
    got = _mixed_steps_logits(runner)
    g = torch.Generator().manual_seed(1)
    seqs = {i: torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for i, n in ((0, 15), (1, 23), (2, 10))}
    with torch.no_grad():
        for i, ids in seqs.items():
            want = ref(torch.tensor([ids])).logits[0]  # [len, vocab]
            mine = torch.stack([got[i][p] for p in range(len(ids))]).cpu()
            torch.testing.assert_close(mine, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["cpu", "cpu-sdpa"])
@pytest.mark.parametrize("case", ["llama-gqa-untied", "llama3-rope", "qwen2-qkv-bias"])
def test_cpu_kernels_in_bfloat16_are_as_close_to_the_reference_as_the_torch_path(
    tmp_path: Path, case: str, backend: str
) -> None:
    # The same bfloat16 weights through both paths (oneDNN-packed linears, C++ norms, rotary,
    # SiLU and paged attention, against torch's ops), each compared with the float32 model.
    ref, cpu = build(tmp_path, case, backend, "bfloat16")
    torch_path = ModelRunner(dataclasses.replace(cpu.config, attention_backend="torch"))
    assert cpu.attention_backend == "cpu" and torch_path.attention_backend == "torch"
    mine, theirs = _mixed_steps_logits(cpu), _mixed_steps_logits(torch_path)
    g = torch.Generator().manual_seed(1)
    seqs = {i: torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for i, n in ((0, 15), (1, 23), (2, 10))}
    with torch.no_grad():
        for i, ids in seqs.items():
            want = ref(torch.tensor([ids])).logits[0]
            cpu_error = (torch.stack([mine[i][p] for p in range(len(ids))]) - want).abs().max()
            torch_error = (torch.stack([theirs[i][p] for p in range(len(ids))]) - want).abs().max()
            assert cpu_error <= 1.5 * torch_error + 1e-3, f"sequence {i}: {cpu_error} vs torch path {torch_error}"


def _mixed_steps_logits(runner: ModelRunner) -> dict[int, dict[int, torch.Tensor]]:
    """Logits by (sequence, position) of three sequences fed through mixed steps."""
    g = torch.Generator().manual_seed(1)
    seqs = {i: torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for i, n in ((0, 15), (1, 23), (2, 10))}
    # Permuted, interleaved block ids; block 0 is never used, so table padding points at it.
    tables = {0: [7, 3, 12, 1], 1: [2, 9, 5, 14, 4, 11, 8], 2: [6, 13, 10]}
    steps = [  # (seq, start, count) fed per step
        [(0, 0, 13), (1, 0, 7)],
        [(0, 13, 1), (1, 7, 11), (2, 0, 9)],
        [(1, 18, 5)],
        [(0, 14, 1), (2, 9, 1)],  # decodes only: the Triton backend's split-K decode kernel
    ]
    got: dict[int, dict[int, torch.Tensor]] = {i: {} for i in seqs}
    for step_id, step in enumerate(steps):
        feeds = [Feed(i, seqs[i][start : start + count], start, tables[i]) for i, start, count in step]
        logits = runner.logits(make_plan(step_id, feeds))
        row = 0
        for i, start, count in step:
            for k in range(count):
                got[i][start + k] = logits[row]
                row += 1
    return got


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="not supported"):
        ModelRunner(
            WorkerConfig(model=str(tmp_path), dtype="float32", device="cpu", cache=CacheConfig(num_gpu_blocks=4))
        )


def test_missing_weights_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    ref, _ = build(tmp_path, "llama-gqa-untied")
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj|qkv_proj.weight\[k\]"):
        ModelRunner(
            WorkerConfig(model=str(tmp_path), dtype="float32", device="cpu", cache=CacheConfig(num_gpu_blocks=4))
        )


# What each family case turns off to lose its feature: the comparison above at 1e-4 means
# something only if the feature moves the logits by far more than that.
FEATURE_OFF: dict[str, dict[str, Any]] = {
    "phi3-longrope": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "phi4-partial-rotary": dict(partial_rotary_factor=1.0, sliding_window=None),
    "mistral-sliding-window": dict(sliding_window=None),
    "qwen2-sliding-window": dict(use_sliding_window=False),
    "qwen3-sliding-window": dict(use_sliding_window=False),
    "gemma2": dict(attn_logit_softcapping=None, final_logit_softcapping=None),
    "gemma3": dict(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        }
    ),
}


@pytest.mark.parametrize("case", list(FEATURE_OFF))
def test_the_family_features_move_the_reference_logits(case: str) -> None:
    config_cls, model_cls, extra = CASES[case]
    ids = torch.randint(0, BASE["vocab_size"], (1, 23), generator=torch.Generator().manual_seed(1))
    logits = []
    for overrides in ({}, FEATURE_OFF[case]):
        torch.manual_seed(0)
        model = model_cls(config_cls(**(BASE | extra | overrides))).float().eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert (logits[0] - logits[1]).abs().max() > 1e-3  # ten times the tolerance


def test_longrope_uses_the_long_frequencies_past_the_original_length() -> None:
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from worker_svc.layers.rotary import RotaryEmbedding

    config_cls, _, extra = CASES["phi3-longrope"]
    config = config_cls(**(BASE | extra))
    ours = RotaryEmbedding(config, 16, 128, torch.float32)
    theirs = Phi3RotaryEmbedding(config)
    for positions in (torch.arange(0, 64), torch.arange(64, 128)):  # transformers: short, then long
        cos, sin = theirs(torch.zeros(1), positions[None])
        torch.testing.assert_close(ours.cos[positions], cos[0, :, :8], atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.sin[positions], sin[0, :, :8], atol=1e-6, rtol=0)


def test_gemma_norms_round_once_like_transformers_in_bfloat16() -> None:
    """(1 + w) in float32 times the normalised row, rounded once: Gemma's order, not Llama's."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from worker_svc.layers.replicated import RMSNorm

    g = torch.Generator().manual_seed(0)
    w = (0.3 * torch.randn(2304, generator=g)).to(torch.bfloat16)
    x = torch.randn(5, 2304, generator=g).to(torch.bfloat16)
    theirs = Gemma2RMSNorm(2304, eps=1e-6).to(torch.bfloat16)
    theirs.weight.data.copy_(w)
    for kernels in ("torch", "cpu"):
        ours = RMSNorm(2304, 1e-6, kernels, torch.bfloat16, offset=1.0)
        ours.weight.weight_loader(ours.weight, w)
        assert torch.equal(ours(x)[0], theirs(x)), kernels


def test_a_llama_config_with_a_stray_sliding_window_key_gets_no_window() -> None:
    from worker_svc.models.registry import model_shape

    config = LlamaConfig(**(BASE | dict(sliding_window=6)))
    assert model_shape(config).layer_windows == ()  # transformers' Llama ignores the key
    config = MistralConfig(**(BASE | dict(sliding_window=6)), architectures=["MistralForCausalLM"])
    assert model_shape(config).layer_windows == (6, 6)
