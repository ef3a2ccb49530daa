"""LoRA slots layer by layer: each rank's share of the update against the adapter's own tensors.

Every rank of tp = 1, 2 and 4 builds its shard of a small Llama (8 query heads; 1 or 2 KV heads,
so KV heads are split, kept whole and replicated) and fills its slots from one PEFT directory.
For each adapted linear the update a rank adds must be exactly its part of the whole model's
update scale * (x A^T) B^T: a column-parallel part's output rows (k and v: the KV head its query
heads read), a row-parallel layer's partial sum from its input columns, summed over the ranks
(what the all-reduce does). The Triton path (the interpreter on a CPU, the GPU when there is one)
must give the torch path's update.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from common.config import LoraConfig
from common.lora_format import MODULES
from common.plan import AdapterLoad
from tests.conftest import skip_without_cuda
from worker_svc.device.parallel import ParallelGroup
from worker_svc.lora.lora_slots import LoraLayer, LoraSlots
from worker_svc.models.registry import build_model

HIDDEN, HEADS, HEAD_DIM, INTER, LAYERS = 64, 8, 8, 128, 2
ROW_PARALLEL = ("o_proj", "down_proj")
# Tokens of three sequences: slot 0, the base model, slot 1.
TOKEN_SLOTS = np.array([0, 0, 0, -1, -1, 1, 1, 1, 1, 0], np.int32)


def config(kv_heads: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=64,
    )


def shapes(kv_heads: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each module of the whole model."""
    q, kv = HEADS * HEAD_DIM, kv_heads * HEAD_DIM
    return {
        "q_proj": (HIDDEN, q),
        "k_proj": (HIDDEN, kv),
        "v_proj": (HIDDEN, kv),
        "o_proj": (q, HIDDEN),
        "gate_proj": (HIDDEN, INTER),
        "up_proj": (HIDDEN, INTER),
        "down_proj": (INTER, HIDDEN),
    }


def write_adapter(
    out: Path, kv_heads: int, targets: tuple[str, ...], rank: int, seed: int, rslora: bool = False
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A PEFT directory as peft writes it; returns {"{layer}.{module}": (A, B)}."""
    g = torch.Generator().manual_seed(seed)
    tensors, weights = {}, {}
    for layer in range(LAYERS):
        for module in targets:
            features_in, features_out = shapes(kv_heads)[module]
            a, b = torch.randn(rank, features_in, generator=g), torch.randn(features_out, rank, generator=g)
            block = "self_attn" if module in MODULES[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            weights[f"{layer}.{module}"] = (a, b)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    peft_config = dict(
        peft_type="LORA", r=rank, lora_alpha=16, use_rslora=rslora, bias="none", target_modules=list(targets)
    )
    (out / "adapter_config.json").write_text(json.dumps(peft_config))
    return weights


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, object]]:
    """Per KV-head count: two adapters (attention at rank 8; o_proj and the MLP at rank 4, rsLoRA)."""
    root = tmp_path_factory.mktemp("lora-layers")
    out: dict[int, dict[str, object]] = {}
    for kv in (1, 2):
        attn = write_adapter(root / f"kv{kv}-attn", kv, MODULES[:3], rank=8, seed=kv)
        rest = write_adapter(root / f"kv{kv}-rest", kv, MODULES[3:], rank=4, seed=10 + kv, rslora=True)
        out[kv] = {"dirs": (root / f"kv{kv}-attn", root / f"kv{kv}-rest"), "weights": (attn, rest)}
    return out


def rank_slots(
    kv_heads: int,
    rank: int,
    tp: int,
    dirs: tuple[Path, Path],
    device: str = "cpu",
    kernels: bool = False,
    dtype: torch.dtype = torch.float32,
) -> LoraSlots:
    """Rank `rank` of `tp`: its shard of the model (weights left unset) with both adapters loaded."""
    model = build_model(config(kv_heads), torch.float32, group=ParallelGroup(rank, tp))
    slots = LoraSlots(model, LoraConfig(max_loras=2, max_lora_rank=8), dtype, torch.device(device), kernels)
    loads = tuple(AdapterLoad(s, f"adapter{s}", str(d), 1) for s, d in enumerate(dirs))
    slots.apply(slots.prepare(loads))
    slots.begin_step(TOKEN_SLOTS)
    return slots


def expected_update(x: torch.Tensor, weights: tuple[dict, dict], key: str) -> torch.Tensor:
    """The whole model's update [tokens, out] from the adapters' own tensors (float64)."""
    scales = (16 / 8, 16 / 4**0.5)  # lora_alpha / r; the second adapter is rsLoRA
    out_features = next(w[key][1].shape[0] for w in weights if key in w)
    delta = torch.zeros(x.shape[0], out_features, dtype=torch.float64)
    for slot, w in enumerate(weights):
        rows = torch.from_numpy(np.flatnonzero(TOKEN_SLOTS == slot))
        if key in w:
            a, b = (t.double() for t in w[key])
            delta[rows] = scales[slot] * (x[rows].double() @ a.t()) @ b.t()
    return delta


def rank_update(slots: LoraSlots, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
    """What the rank's linear adds for `module` to an output of zeros, given its input."""
    holder, part = slots.layers[(layer, module)]
    width = max(p.columns.stop for p in holder.parts)
    out = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
    holder.add(x.to(out.device).contiguous(), out)
    return out[:, part.columns].cpu().double()


def kept_rows(module: str, rank: int, tp: int, kv_heads: int) -> slice:
    """Output rows a column-parallel rank keeps, from what its query heads read: its run of
    query heads, and for k and v the KV head(s) of their GQA group(s)."""
    heads = HEADS // tp
    if module == "q_proj":
        return slice(rank * heads * HEAD_DIM, (rank + 1) * heads * HEAD_DIM)
    if module in ("k_proj", "v_proj"):
        group = HEADS // kv_heads  # query heads per KV head
        first, last = rank * heads // group, ((rank + 1) * heads - 1) // group
        return slice(first * HEAD_DIM, (last + 1) * HEAD_DIM)
    per = INTER // tp
    return slice(rank * per, (rank + 1) * per)


@pytest.mark.parametrize(("kv_heads", "tp"), [(1, 1), (2, 2), (1, 2), (2, 4)])
def test_each_rank_adds_its_part_of_the_update(adapters: dict[int, dict], kv_heads: int, tp: int) -> None:
    dirs, weights = adapters[kv_heads]["dirs"], adapters[kv_heads]["weights"]
    ranks = [rank_slots(kv_heads, r, tp, dirs) for r in range(tp)]
    g = torch.Generator().manual_seed(tp)
    for layer in range(LAYERS):
        for module in MODULES:
            features_in, _ = shapes(kv_heads)[module]
            x = torch.randn(TOKEN_SLOTS.size, features_in, generator=g)
            want = expected_update(x, weights, f"{layer}.{module}")
            if module in ROW_PARALLEL:  # each rank's input columns; the all-reduce sums the parts
                per = features_in // tp
                got = sum(rank_update(s, layer, module, x[:, r * per : (r + 1) * per]) for r, s in enumerate(ranks))
            else:
                got = torch.cat([rank_update(s, layer, module, x) for s in ranks], 1)
                want = torch.cat([want[:, kept_rows(module, r, tp, kv_heads)] for r in range(tp)], 1)
            assert isinstance(got, torch.Tensor)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, msg=f"layer {layer} {module} tp={tp}")
            assert not got[TOKEN_SLOTS == -1].any()  # base rows untouched


def triton_matches_torch(adapters: dict[int, dict], device: str, dtype: torch.dtype, atol: float) -> None:
    """Every adapted linear's update through kernels/lora.py equals the torch path's, on tp = 2."""
    dirs = adapters[1]["dirs"]
    g = torch.Generator().manual_seed(0)
    for rank in range(2):
        torch_path = rank_slots(1, rank, 2, dirs, device, kernels=False, dtype=dtype)
        kernel_path = rank_slots(1, rank, 2, dirs, device, kernels=True, dtype=dtype)
        for (layer, module), (_, part) in torch_path.layers.items():
            x = torch.randn(TOKEN_SLOTS.size, part.a.shape[2], generator=g).to(device, dtype)
            want = rank_update(torch_path, layer, module, x)
            got = rank_update(kernel_path, layer, module, x)
            torch.testing.assert_close(got, want, atol=atol, rtol=atol, msg=f"rank {rank} layer {layer} {module}")


def test_the_triton_path_adds_the_torch_paths_update_in_the_interpreter(adapters: dict[int, dict]) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs only without CUDA; test_..._on_the_gpu covers the kernels")
    triton_matches_torch(adapters, "cpu", torch.float32, 1e-4)


@skip_without_cuda()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_triton_path_adds_the_torch_paths_update_on_the_gpu(adapters: dict[int, dict], dtype: torch.dtype) -> None:
    triton_matches_torch(adapters, "cuda", dtype, 1e-4 if dtype == torch.float32 else 5e-2)


def test_a_step_without_adapted_rows_calls_nothing(adapters: dict[int, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    slots = rank_slots(2, 0, 1, adapters[2]["dirs"])
    model_linear = slots.layers[(0, "q_proj")][0]
    calls: list[int] = []
    original = LoraLayer.add
    monkeypatch.setattr(LoraLayer, "add", lambda self, x, out: calls.append(1) or original(self, x, out))
    qkv = build_model(config(2), torch.float32).model.layers[0].self_attn.qkv_proj
    qkv.weight.data.normal_()
    qkv.lora = model_linear
    x = torch.randn(TOKEN_SLOTS.size, HIDDEN)
    adapted = qkv(x)
    assert calls == [1]
    slots.begin_step(np.full(TOKEN_SLOTS.size, -1, np.int32))
    base = qkv(x)
    assert calls == [1]  # no call at all
    torch.testing.assert_close(adapted[TOKEN_SLOTS == -1], base[TOKEN_SLOTS == -1], atol=0, rtol=0)
    assert not torch.allclose(adapted[TOKEN_SLOTS == 0], base[TOKEN_SLOTS == 0])
