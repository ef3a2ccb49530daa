"""Decode steps through CUDA graphs: which steps replay, the padded static inputs, and (on a
GPU) replay against eager execution.

On CPU the padded inputs go through the model's Triton path in the interpreter, without a
capture, read from the static buffers DecodeGraphs.upload fills: the real rows' hidden states
must equal the eager step's, so padding rows (slot -1, one key of block 0, token 0 at
position 0) and the block ids an earlier, bigger step left past this step's disturb nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.config import CacheConfig, WorkerConfig
from common.plan import StepPlan
from tests.conftest import KERNEL_DEVICE
from tests.plans import Feed, make_plan
from worker_svc.layers.triton_attention import TritonAttentionMetadata
from worker_svc.step.cuda_graphs import DecodeGraphs, fits, stage
from worker_svc.step.runner import ModelRunner
from worker_svc.step.step_buckets import graph_buckets

BLOCK = 8


def decodes(step_id: int, contexts: list[int], tables: list[list[int]]) -> StepPlan:
    return make_plan(
        step_id, [Feed(i, [10 + i], c, t, output_position=1) for i, (c, t) in enumerate(zip(contexts, tables))]
    )


def test_which_steps_replay() -> None:
    buckets = graph_buckets(16)
    plan = decodes(0, [3, 9], [[1], [2, 3]])
    assert fits(plan, buckets, width=4) == 2
    assert fits(decodes(0, [3, 9, 4], [[1], [2, 3], [4]]), buckets, width=4) == 4
    assert fits(plan, buckets, width=1) is None  # a row longer than the graphs' width
    ragged = decodes(0, [3, 9, 200], [[1], [2, 3], list(range(4, 30))])
    assert fits(ragged, buckets, width=26) == 4 and fits(ragged, buckets, width=25) is None
    prompt = make_plan(0, [Feed(0, [1, 2, 3], 0, [1]), Feed(1, [4], 5, [2])])
    assert fits(prompt, buckets, width=4) is None  # not decode-only
    many = decodes(0, [1] * 17, [[i] for i in range(17)])
    assert fits(many, buckets, width=4) is None  # beyond the largest bucket


def test_staged_inputs_pad_inertly() -> None:
    plan = decodes(0, [3, 9, 16], [[5], [2, 7], [1, 4, 6]])
    s = stage(plan, bucket=4, width=5, block_size=BLOCK)
    assert (s.bucket, s.num_seqs) == (4, 3)
    assert s.input_ids.tolist() == [10, 11, 12, 0] and s.positions.tolist() == [3, 9, 16, 0]
    # Slot of each token: its position's block in its table; padding stores nowhere.
    assert s.slot_mapping.tolist() == [5 * 8 + 3, 7 * 8 + 1, 6 * 8 + 0, -1]
    # The plan's six ids, not 4 rows x the graphs' five; the padding row attends to block 0.
    assert s.block_ids.tolist() == [5, 2, 7, 1, 4, 6, 0]
    assert s.block_offsets.tolist() == [0, 1, 3, 6, 7]
    assert s.seq_lens.tolist() == [4, 10, 17, 1]
    assert s.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_staged_tables_follow_the_plans_blocks_not_the_graphs_width() -> None:
    """Only the plan's block ids are built and uploaded: at 256 sequences in graphs 8192 blocks
    wide, a whole-width table is 8 MiB a step; one long row beside short ones costs its own
    blocks only."""
    graphs_width = 8192
    for width in (1, 3, 64):
        plan = decodes(0, [BLOCK * width - 1] * 256, [list(range(i, i + width)) for i in range(256)])
        s = stage(plan, bucket=256, width=graphs_width, block_size=BLOCK)
        assert s.block_ids.nbytes == 256 * width * 4 and s.block_offsets.shape == (257,)
        # Each sequence's last token sits in the last block of its table.
        assert s.slot_mapping[:3].tolist() == [(i + width - 1) * BLOCK + BLOCK - 1 for i in range(3)]
    long_row = list(range(100, 100 + 4000))
    plan = decodes(0, [3, BLOCK * 4000 - 2, 5], [[7], long_row, [9]])
    s = stage(plan, bucket=4, width=graphs_width, block_size=BLOCK)
    assert s.block_ids.shape == (4000 + 2 + 1,) and s.block_offsets.tolist() == [0, 1, 4001, 4002, 4003]
    assert s.slot_mapping.tolist() == [7 * BLOCK + 3, 4099 * BLOCK + BLOCK - 2, 9 * BLOCK + 5, -1]
    # Rows holding blocks past their token's (allocated ahead) are cut to the blocks read.
    s = stage(decodes(0, [3, 9], [[5, 8, 8], [2, 7, 8]]), bucket=2, width=4, block_size=BLOCK)
    assert s.block_ids.tolist() == [5, 2, 7] and s.block_offsets.tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match="more than the graphs'"):
        stage(decodes(0, [3], [[1, 2, 3]]), bucket=1, width=2, block_size=BLOCK)


def test_upload_writes_only_the_plans_ids_and_the_buckets_offsets() -> None:
    graphs = DecodeGraphs(
        lambda *a: a[0], dict, graph_buckets(8), width=4, block_size=BLOCK, device=torch.device("cpu")
    )
    assert graphs._block_ids.shape == (8 * 4,)  # the largest bucket x the graphs' width
    wide = decodes(0, [30] * 8, [[(i + j) % 15 + 1 for j in range(4)] for i in range(8)])
    graphs.upload(stage(wide, 8, width=4, block_size=BLOCK))
    s = stage(decodes(1, [3, 12], [[5], [2, 7]]), 2, width=4, block_size=BLOCK)
    graphs.upload(s)
    assert graphs._block_ids[:3].tolist() == [5, 2, 7]
    assert graphs._block_ids[3:].tolist() == wide.block_tables.ids[3:].tolist()  # stale, never read
    assert graphs._block_offsets[:3].tolist() == [0, 1, 3]
    meta = graphs._meta(2)
    assert meta["max_blocks"] == 4 and meta["block_ids"] is graphs._block_ids
    assert meta["block_offsets"].tolist() == [0, 1, 3]


@pytest.fixture(scope="module")
def triton_runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path = tmp_path_factory.mktemp("graphs-model")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    LlamaForCausalLM(cfg).float().save_pretrained(str(path))
    return ModelRunner(
        WorkerConfig(
            model=str(path),
            dtype="float32",
            device=KERNEL_DEVICE,
            attention_backend="triton",
            cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=16),
            max_num_seqs=8,
        )
    )


def test_padded_static_inputs_give_the_eager_hidden_states(triton_runner: ModelRunner) -> None:
    runner = triton_runner
    dev = runner.device
    prompts = [[5, 17, 42], [7, 8, 9, 10, 11], [99, 3]]
    tables = [[3, 9], [4, 2], [6, 1]]
    runner.execute(make_plan(0, [Feed(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))]))
    plan = make_plan(
        1, [Feed(i, [20 + i], len(p), t, output_position=1) for i, (p, t) in enumerate(zip(prompts, tables))]
    )
    ids, positions, meta, _ = runner._inputs(plan)
    kv_before = [(k.clone(), v.clone()) for k, v in runner.kv.layers]
    eager = runner.model(ids, positions, runner.kv.layers, meta)
    kv_eager = [(k.clone(), v.clone()) for k, v in runner.kv.layers]
    for (k, v), (k0, v0) in zip(runner.kv.layers, kv_before):  # the same step again, padded
        k.copy_(k0)
        v.copy_(v0)
    buckets = graph_buckets(8)
    bucket = fits(plan, buckets, width=8)
    assert bucket == 4
    graphs = DecodeGraphs(
        lambda ids, positions, meta: runner.model(ids, positions, runner.kv.layers, meta),
        TritonAttentionMetadata,
        buckets,
        width=8,
        block_size=BLOCK,
        device=dev,
    )
    # An earlier step of longer rows leaves block ids past the ones this step writes.
    wider = decodes(0, [60] * 8, [[(i + j) % 15 + 1 for j in range(8)] for i in range(8)])
    graphs.upload(stage(wider, 8, width=8, block_size=BLOCK))
    s = stage(plan, bucket, width=8, block_size=BLOCK)
    graphs.upload(s)
    # Each row's one block its tokens are in (the second of each table is spare), then padding.
    assert graphs._block_ids[:4].tolist() == s.block_ids.tolist() == [3, 4, 6, 0]
    assert graphs._block_ids[4:].tolist() == wider.block_tables.ids[4:].tolist()  # stale, never read
    padded = runner.model(graphs._ids[:bucket], graphs._positions[:bucket], runner.kv.layers, graphs._meta(bucket))
    assert padded.shape[0] == 4
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=0)
    for (k, v), (k1, v1) in zip(runner.kv.layers, kv_eager):
        # The same K/V in the same slots, and the padding row stored nothing. (Up to a few
        # float32 ulps: the GEMM's blocking, and so its rounding, depends on the row count.)
        torch.testing.assert_close(k, k1, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, v1, atol=1e-5, rtol=0)
    assert runner._graphs is None or torch.cuda.is_available()  # captured only on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replayed_decode_steps_equal_eager_ones(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("graphs-gpu-model")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=200,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
    )
    LlamaForCausalLM(cfg).float().save_pretrained(str(path))
    config = WorkerConfig(
        model=str(path),
        dtype="float32",
        device="cuda",
        attention_backend="triton",
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=64, num_cpu_blocks=0),
        max_num_seqs=16,
    )
    graphs, eager = ModelRunner(config), ModelRunner(dataclasses.replace(config, enforce_eager=True))
    assert graphs._graphs is not None and eager._graphs is None
    for n in (1, 3, 9):  # buckets 1, 4, 16: padding rows of every kind
        prompts = [[(7 * i + j) % 190 + 5 for j in range(3 + i)] for i in range(n)]
        tables = [[2 * i + 1, 2 * i + 2] for i in range(n)]
        outputs = []
        for runner in (graphs, eager):
            tokens = [list(p) for p in prompts]
            context = [0] * n
            for step in range(6):
                feeds = [
                    Feed(i, tokens[i][context[i] :], context[i], tables[i], output_position=step) for i in range(n)
                ]
                result = runner.execute(make_plan(step, feeds))
                for i in range(n):
                    context[i] = len(tokens[i])
                    tokens[i].append(int(result.sampled_token_ids[i]))
            outputs.append(tokens)
        assert outputs[0] == outputs[1], n
