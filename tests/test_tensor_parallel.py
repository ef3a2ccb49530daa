"""Tensor parallelism on CPU with gloo: tp = 2 and 4 give the logits of tp = 1.

One group of 4 spawned rank processes serves every case: tp = 4 runs on the world group,
tp = 2 on a subgroup of ranks 0-1 (ranks 2-3 sit that task out). Each rank loads its shard
of a random-weight checkpoint through the real loader and runs the steps of
tests/test_model_forward.py (prefill chunks, then decodes) through ModelRunner; rank 0 sends
back the logits, which must equal the single-process runner's within 1e-5 in float32.

Loading and shapes need no collectives, so those tests build a rank's shard in-process.
"""

from __future__ import annotations

import queue
import socket
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
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
from tests.plans import Feed, make_plan
from worker_svc.device.parallel import ParallelGroup
from worker_svc.models.registry import build_model, model_shape
from worker_svc.step import loader

WORLD = 4
BLOCK = 8
BASE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
)
# KV heads vs group sizes 2 and 4: fewer (replicated), equal, more (split).
CASES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "kv2-untied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "kv4-tied": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "kv8-untied-o-and-mlp-bias": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(num_key_value_heads=8, attention_bias=True, mlp_bias=True),
    ),
    # 509 is prime: the vocab-parallel layers pad it on every group size.
    "kv1-tied-odd-vocab": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(num_key_value_heads=1, vocab_size=509, tie_word_embeddings=True),
    ),
    "qwen2-qkv-bias": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "qwen3-qk-norm": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=24, tie_word_embeddings=False)),
    "mistral-sliding-window": (MistralConfig, MistralForCausalLM, dict(sliding_window=6)),
    # Fused q/k/v and gate/up in the checkpoint: each rank reads its rows of every part.
    "phi3-fused-longrope": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(
            pad_token_id=0,
            eos_token_id=1,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.5, 2.0, 2.5],
                "long_factor": [3.0, 3.5, 4.0, 4.5],
            },
        ),
    ),
    # Phi-4-mini's shape: 3/4 of each head rotates (in torch, whatever the kernels); a window
    # on every layer.
    "phi4-partial-rotary": (
        Phi3Config,
        Phi3ForCausalLM,
        dict(pad_token_id=0, eos_token_id=1, partial_rotary_factor=0.75, sliding_window=6, tie_word_embeddings=True),
    ),
    # Experts sharded along their intermediate width: every rank holds every expert's slice.
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1]),
    ),
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6, attn_logit_softcapping=0.8),
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    ),
}
STEPS = [  # (seq, start, count) fed per step, as in test_model_forward
    [(0, 0, 13), (1, 0, 7)],
    [(0, 13, 1), (1, 7, 11), (2, 0, 9)],
    [(1, 18, 5)],
    [(0, 14, 1), (2, 9, 1)],
]
TABLES = {0: [7, 3, 12, 1], 1: [2, 9, 5, 14, 4, 11, 8], 2: [6, 13, 10]}
LENGTHS = {0: 15, 1: 23, 2: 10}


def save_checkpoint(path: Path, case: str, **overrides: Any) -> Path:
    config_cls, model_cls, extra = CASES[case]
    extra = extra | overrides
    torch.manual_seed(0)
    ref = model_cls(config_cls(**(BASE | extra))).float()
    with torch.no_grad():  # biases start at zero; a bias added tp times or dropped must show
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):  # a per-head norm weight sliced by rank must show
                p.normal_(1, 0.1)
            elif name.endswith(".gate.weight"):  # a router: no near-tie for a reduction order to flip
                p.normal_(0, 1.0)
    ref.save_pretrained(str(path))
    return path


def run_steps(model_dir: str, group: ParallelGroup, vocab: int, backend: str = "torch") -> torch.Tensor:
    """float32 logits [fed tokens of every step, vocab] of the fixed step sequence."""
    from worker_svc.step.runner import ModelRunner

    runner = ModelRunner(
        WorkerConfig(
            model=model_dir,
            dtype="float32",
            device="cpu",
            attention_backend=backend,
            cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=0),
        ),
        group,
    )
    assert runner.attention_backend == backend
    g = torch.Generator().manual_seed(1)
    seqs = {i: torch.randint(0, vocab, (n,), generator=g).tolist() for i, n in LENGTHS.items()}
    out = []
    for step_id, step in enumerate(STEPS):
        feeds = [Feed(i, seqs[i][start : start + count], start, TABLES[i]) for i, start, count in step]
        out.append(runner.logits(make_plan(step_id, feeds)))
    return torch.cat(out)


def collectives(group: ParallelGroup) -> dict[str, Any]:
    """Each helper of ParallelGroup on a rank-dependent tensor; rank 0 reports what it got."""
    x = torch.full((2, 3), float(group.rank + 1))
    return {
        "all_reduce": group.all_reduce(x.clone()),
        "all_gather": group.all_gather(x, -1),
        "gather": group.gather(x, 0),
    }


def _rank_main(rank: int, init_method: str, tasks: list[Any], results: Any) -> None:
    """One rank: join the world, build the tp=2 subgroup, then run tasks until None."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
        subgroups = {WORLD: None, 2: dist.new_group([0, 1])}  # every rank creates every group
        while (task := tasks[rank].get()) is not None:
            model_dir, tp, vocab, backend = task
            if rank >= tp:
                continue
            group = ParallelGroup(rank, tp, subgroups[tp])
            try:
                out = run_steps(model_dir, group, vocab, backend) if model_dir else collectives(group)
                if rank == 0:
                    results.put(("ok", out))
            except Exception:  # noqa: BLE001 (reported to the test, which fails with it)
                results.put(("error", f"rank {rank}: {traceback.format_exc()}"))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


class SpawnedRanks:
    def __init__(self, tmp: Path) -> None:
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.tasks = [ctx.Queue() for _ in range(WORLD)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_rank_main, args=(r, f"tcp://127.0.0.1:{port}", self.tasks, self.results), daemon=True)
            for r in range(WORLD)
        ]
        for p in self.procs:
            p.start()

    def run(self, model_dir: Path | str, tp: int, vocab: int, backend: str = "torch") -> Any:
        """Rank 0's answer: the logits of the model in `model_dir`, or (no dir) collectives()."""
        for q in self.tasks:
            q.put((str(model_dir), tp, vocab, backend))
        try:
            status, value = self.results.get(timeout=120)
        except queue.Empty:
            raise AssertionError(f"tp={tp}: no result within 120 s") from None
        assert status == "ok", value
        return value

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpawnedRanks]:
    group = SpawnedRanks(tmp_path_factory.mktemp("tp"))
    yield group
    group.close()


def test_collectives_on_subgroups(ranks: SpawnedRanks) -> None:
    for tp in (2, 4):
        got = ranks.run("", tp, 0)
        n = tp * (tp + 1) / 2
        assert torch.equal(got["all_reduce"], torch.full((2, 3), n))
        assert torch.equal(got["all_gather"], torch.cat([torch.full((2, 3), r + 1.0) for r in range(tp)], -1))
        assert torch.equal(got["gather"], torch.cat([torch.full((2, 3), r + 1.0) for r in range(tp)], 0))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_single_process(ranks: SpawnedRanks, tmp_path: Path, case: str) -> None:
    model_dir = save_checkpoint(tmp_path, case)
    vocab = (BASE | CASES[case][2])["vocab_size"]
    want = run_steps(str(model_dir), ParallelGroup(), vocab)
    assert want.shape == (sum(c for step in STEPS for _, _, c in step), vocab)
    for tp in (2, 4):
        got = ranks.run(model_dir, tp, vocab)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m, tp=tp: f"tp={tp}: {m}")


@pytest.mark.parametrize("case", ["gemma2", "mixtral", "qwen3-qk-norm"])
def test_logits_equal_single_process_on_the_cpu_kernels(ranks: SpawnedRanks, tmp_path: Path, case: str) -> None:
    """tp = 2 through our C++ kernels (the "cpu" backend: packed linears, norms, paged attention
    over each rank's KV heads) against tp = 1 through them; head_dim 64, their smallest."""
    model_dir = save_checkpoint(tmp_path, case, head_dim=64)
    vocab = (BASE | CASES[case][2])["vocab_size"]
    want = run_steps(str(model_dir), ParallelGroup(), vocab, "cpu")
    got = ranks.run(model_dir, 2, vocab, "cpu")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


class RecordingSlice:
    """A safetensors slice that counts the elements each read returns."""

    def __init__(self, inner: Any, reads: dict[str, int], name: str) -> None:
        self.inner, self.reads, self.name = inner, reads, name

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        t = self.inner[index]
        self.reads[self.name] = self.reads.get(self.name, 0) + t.numel()
        return t


@pytest.mark.parametrize("rank", [1, 3])
def test_each_rank_loads_only_its_slice(tmp_path: Path, rank: int) -> None:
    """tp=4 over 8 query heads, 2 KV heads (replicated pairwise), vocab 509 (padded to 4 x 128)."""
    model_dir = save_checkpoint(tmp_path, "kv2-untied")
    (tmp_path / "config.json").write_text(
        (tmp_path / "config.json").read_text().replace('"vocab_size": 512', '"vocab_size": 509')
    )
    full = load_file(str(tmp_path / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        full[name] = full[name][:509].contiguous()
    save_file(full, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    group = ParallelGroup(rank, 4)
    model = build_model(loader.load_config(model_dir), torch.float32, group=group)
    reads: dict[str, int] = {}
    model.load_weights((n, RecordingSlice(s, reads, n)) for n, s in loader.iter_weights(model_dir))

    assert (model.shape.num_heads, model.shape.num_kv_heads) == (2, 1)
    params = dict(model.named_parameters())
    d, kv_head = 8, rank // 2
    expect = {
        "model.embed_tokens.weight": (128, 64),
        "lm_head.weight": (128, 64),
        "model.layers.0.self_attn.qkv_proj.weight": ((2 + 1 + 1) * d, 64),
        "model.layers.0.self_attn.o_proj.weight": (64, 2 * d),
        "model.layers.0.mlp.gate_up_proj.weight": (2 * 32, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 32),
        "model.layers.0.input_layernorm.weight": (64,),
    }
    for name, shape in expect.items():
        assert tuple(params[name].shape) == shape, name
    # Elements read per checkpoint tensor: this rank's part, never a whole sharded weight.
    vocab_rows = min(128, 509 - rank * 128)
    for name, tensor in full.items():
        if "norm" in name:
            want = tensor.numel()  # replicated
        elif "k_proj" in name or "v_proj" in name:
            want = tensor.numel() // 2  # 1 of 2 KV heads
        elif "embed" in name or "lm_head" in name:
            want = vocab_rows * 64
        else:
            want = tensor.numel() // 4
        assert reads[name] == want, name
    # The values are the right slices.
    layer = "model.layers.0"
    qkv = params[f"{layer}.self_attn.qkv_proj.weight"]
    torch.testing.assert_close(
        qkv[: 2 * d], full[f"{layer}.self_attn.q_proj.weight"][rank * 2 * d : (rank + 1) * 2 * d]
    )
    torch.testing.assert_close(
        qkv[2 * d : 3 * d], full[f"{layer}.self_attn.k_proj.weight"][kv_head * d : (kv_head + 1) * d]
    )
    torch.testing.assert_close(qkv[3 * d :], full[f"{layer}.self_attn.v_proj.weight"][kv_head * d : (kv_head + 1) * d])
    torch.testing.assert_close(
        params[f"{layer}.self_attn.o_proj.weight"],
        full[f"{layer}.self_attn.o_proj.weight"][:, rank * 2 * d : (rank + 1) * 2 * d],
    )
    gate_up = params[f"{layer}.mlp.gate_up_proj.weight"]
    torch.testing.assert_close(gate_up[32:], full[f"{layer}.mlp.up_proj.weight"][rank * 32 : (rank + 1) * 32])
    embed = params["model.embed_tokens.weight"]
    torch.testing.assert_close(
        embed[:vocab_rows], full["model.embed_tokens.weight"][rank * 128 : rank * 128 + vocab_rows]
    )
    assert not embed[vocab_rows:].any()  # padding rows of the last rank


def test_tied_head_shares_the_embedding_shard(tmp_path: Path) -> None:
    model_dir = save_checkpoint(tmp_path, "kv4-tied")
    model = build_model(loader.load_config(model_dir), torch.float32, group=ParallelGroup(1, 2))
    model.load_weights(loader.iter_weights(model_dir))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tuple(model.lm_head.weight.shape) == (256, 64)
    assert "lm_head.weight" not in dict(model.named_parameters())


def smollm2_like(**overrides: int) -> LlamaConfig:
    params = (
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=1,
            num_attention_heads=9,
            num_key_value_heads=3,
        )
        | overrides
    )
    return LlamaConfig(**params)


@pytest.mark.parametrize(
    ("config", "tp", "message"),
    [
        (smollm2_like(), 2, "tp=2 cannot split 9 attention heads; sizes that work: 1, 3"),
        (smollm2_like(), 9, "tp=9 cannot split an MLP intermediate size of 1536; sizes that work: 1, 3"),
        (
            smollm2_like(num_attention_heads=12, num_key_value_heads=3, hidden_size=768),
            4,
            r"tp=4 cannot split 3 KV heads \(nor replicate them evenly\); sizes that work: 1, 3, 6, 12",
        ),
        (
            Qwen3MoeConfig(
                **(BASE | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20)),
                architectures=["Qwen3MoeForCausalLM"],
            ),
            8,
            "tp=8 cannot split an MLP intermediate size of 20; sizes that work: 1, 2, 4",
        ),
    ],
)
def test_unsplittable_sizes_are_refused(config: LlamaConfig, tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        model_shape(config, tp)
    with pytest.raises(ValueError, match=message):
        build_model(config, torch.float32, group=ParallelGroup(0, tp))


def test_splittable_smollm2_shape_is_per_rank() -> None:
    shape = model_shape(smollm2_like(), 3)
    assert (shape.num_heads, shape.num_kv_heads, shape.total_num_heads, shape.total_num_kv_heads) == (3, 1, 9, 3)
    assert shape.vocab_size == 49152 and shape.intermediate_size == 1536  # the checkpoint's


def test_a_fused_checkpoint_tensor_fills_every_part_of_this_ranks_rows() -> None:
    from worker_svc.layers.tp_layers import QKVParallelLinear

    # 4 query heads and 2 KV heads of 3: rank 1 of 2 keeps query heads 2-3 and KV head 1.
    layer = QKVParallelLinear(5, 3, 4, 2, ParallelGroup(1, 2), dtype=torch.float32)
    fused = torch.arange(8 * 3 * 5, dtype=torch.float32).view(24, 5)  # q 12 rows, k 6, v 6
    layer.weight_loader(layer.weight, fused)
    q, k, v = fused[:12], fused[12:18], fused[18:]
    assert torch.equal(layer.weight, torch.cat([q[6:12], k[3:6], v[3:6]]))
    with pytest.raises(ValueError, match="fused weight: checkpoint tensor has 23 rows, the model wants 24"):
        layer.weight_loader(layer.weight, fused[:23])
