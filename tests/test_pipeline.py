"""Pipeline parallelism: `llmserve worker --pp N [--tp M]` starts N x M gloo ranks, each stage
holding only its layers, and greedy float32 equals transformers token for token; a stage
that dies ends its group; the split and the loading are checked piece by piece."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from common.worker_info import WorkerInfo, out_of_bounds
from tests.conftest import REPO, collect, make_tiny_model, request, start_scheduler, stop_scheduler
from tests.engine_state import first_scheduler
from tests.test_model_families_e2e import reference_greedy
from tests.test_registration import until
from tests.test_tp_service import children_of, kill_a_rank_mid_stream, start_group
from worker_svc.device.pipeline import PipelineStage, holds_tensor, layer_split
from worker_svc.step.loader import load_model

NEW_TOKENS = 16


async def stream_through(
    model_dir: Path, addresses: list[str], prompts: list[list[int]], micro_batches: int = 0
) -> list[list[int]]:
    s = await start_scheduler(model_dir, ",".join(addresses), pipeline_microbatches=micro_batches)
    try:
        await s.wait_ready()
        gens = await asyncio.gather(
            *(collect(s.stub, request(ids=p, max_tokens=NEW_TOKENS, ignore_eos=True)) for p in prompts)
        )
        await s.wait_idle()
        manager = first_scheduler(s.engine).block_manager
        assert manager.num_free_blocks == manager.num_blocks  # every block back in the pool
        return [g.token_ids for g in gens]
    finally:
        await stop_scheduler(s)


def prompts_for(seed: int, lengths: tuple[int, ...] = (20, 9, 31)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


async def served(
    model_dir: Path, pp: int, tp: int, prompts: list[list[int]], *extra: str, micro_batches: int = 0
) -> list[list[int]]:
    """Greedy tokens through a pipeline; `micro_batches` 0: the default, for CPU ranks one plan
    at a time (they share the cores), so the tests that name more run the stages at once."""
    launcher, addresses = start_group(model_dir, tp, 20.0, extra, pp=pp)
    try:
        return await stream_through(model_dir, addresses, prompts, micro_batches)
    finally:
        launcher.terminate()
        assert launcher.wait(60) == 0


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("pp") / "llama4", smollm2_dir, num_hidden_layers=4)


@pytest.mark.parametrize(
    ("pp", "tp", "extra", "micro_batches"),
    [(2, 1, (), 3), (2, 1, (), 1), (3, 1, ("--pp-layer-split", "1,2,1"), 4), (2, 2, (), 3)],
    ids=["pp2-3-microbatches", "pp2-one-plan-at-a-time", "pp3-split-1-2-1-4-microbatches", "pp2xtp2-3-microbatches"],
)
async def test_greedy_through_a_pipeline_equals_transformers(
    four_layers: Path, pp: int, tp: int, extra: tuple[str, ...], micro_batches: int
) -> None:
    # Five prompts: in decode each micro-batch holds one or two of them.
    prompts = prompts_for(pp * 10 + tp, (20, 9, 31, 14, 3))
    want = reference_greedy(four_layers, LlamaForCausalLM, prompts)
    assert await served(four_layers, pp, tp, prompts, *extra, micro_batches=micro_batches) == want


@pytest.mark.parametrize(
    "family",
    [
        # untied embeddings, a sliding window shorter than the prompts
        ("mistral", MistralConfig, MistralForCausalLM, dict(sliding_window=7, tie_word_embeddings=False)),
        # tied embeddings (the last stage holds its own copy), sandwich norms, soft-capping, a window
        (
            "gemma2",
            Gemma2Config,
            Gemma2ForCausalLM,
            dict(head_dim=64, query_pre_attn_scalar=48, sliding_window=7, attn_logit_softcapping=4.0),
        ),
    ],
    ids=lambda f: f[0],
)
async def test_two_families_through_a_two_stage_pipeline(tmp_path: Path, smollm2_dir: Path, family: tuple) -> None:
    name, config_cls, model_cls, overrides = family
    model_dir = make_tiny_model(tmp_path / name, smollm2_dir, config_cls, model_cls, num_hidden_layers=3, **overrides)
    prompts = prompts_for(7)
    want = reference_greedy(model_dir, model_cls, prompts)
    assert await served(model_dir, 2, 1, prompts, micro_batches=3) == want


@pytest.mark.slow
async def test_smollm2_through_two_stages_equals_transformers(smollm2_dir: Path) -> None:
    prompts = [[1, 504, 3458, 282, 4649, 314, 216, 9], [1, 9690, 28, 2683, 457, 6077, 284, 15, 9]]
    want = reference_greedy(smollm2_dir, LlamaForCausalLM, prompts)
    assert await served(smollm2_dir, 2, 1, prompts) == want


async def test_killing_a_stage_ends_the_group_and_leaves_no_process(four_layers: Path) -> None:
    launcher, addresses = start_group(four_layers, 1, dist_timeout=4.0, pp=2)
    await kill_a_rank_mid_stream(four_layers, launcher, addresses, victim=0, within=15)


@pytest.mark.parametrize("victim", [0, 1], ids=["first-stage", "last-stage"])
async def test_a_killed_stage_costs_its_requests_a_re_prefill_on_the_other_group(
    four_layers: Path, victim: int
) -> None:
    """Two pipelines under one scheduler, three micro-batches each; one stage of the first is
    SIGKILLed mid-stream: every stream ends with exactly the tokens of its undisturbed run, and
    no block is left taken."""
    groups = [start_group(four_layers, 1, dist_timeout=4.0, pp=2) for _ in range(2)]
    s = await start_scheduler(
        four_layers,
        [",".join(addresses) for _, addresses in groups],  # type: ignore[arg-type]
        pipeline_microbatches=3,  # the lost group has several plans in flight
    )
    try:
        await until(lambda: len(s.engine.replicas) == 2 and all(r.scheduler for r in s.engine.replicas), timeout=120)
        reqs = [request(ids=p, max_tokens=40, ignore_eos=True) for p in prompts_for(3, tuple(range(5, 37, 4)))]
        undisturbed = [g.token_ids for g in await asyncio.gather(*(collect(s.stub, r) for r in reqs))]
        assert all(r.scheduler.next_step_id > 0 for r in s.engine.replicas)  # both groups served
        await s.wait_idle()

        tasks = [asyncio.create_task(collect(s.stub, r)) for r in reqs]
        doomed = s.engine.replicas[0]
        deadline = asyncio.get_running_loop().time() + 30
        while not any(g.seqs[0].num_output_tokens >= 2 for g in doomed.scheduler.queues.running):
            assert asyncio.get_running_loop().time() < deadline, "the first group never ran a request"
            await asyncio.sleep(0.002)
        ranks = children_of(groups[0][0].pid)
        port = groups[0][1][victim].rsplit(":", 1)[1]
        pid = next(p for p in ranks if f"127.0.0.1:{port}" in Path(f"/proc/{p}/cmdline").read_text().replace("\0", " "))
        os.kill(pid, signal.SIGKILL)
        disturbed = [g.token_ids for g in await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)]
        assert disturbed == undisturbed
        assert [r.name for r in s.engine.replicas] == [",".join(groups[1][1])]
        await s.wait_idle()
        assert groups[0][0].wait(30) != 0  # the lost group's launcher ends with its stage
    finally:
        await stop_scheduler(s)
        for launcher, _ in groups:
            if launcher.poll() is None:
                launcher.kill()
            launcher.wait(30)


def test_a_pipeline_the_model_cannot_form_is_refused_at_start(four_layers: Path) -> None:
    for args, message in (
        (("--pp", "5"), "--pp 5 is more stages than the model's 4 layers"),
        (("--pp", "2", "--pp-layer-split", "3,2"), "add up to the model's 4 layers"),
        (("--pp", "2", "--pp-layer-split", "a,b"), "want layer counts such as 10,20"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "llmserve.cli", "worker", "--model", str(four_layers), "--device", "cpu", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out.stderr
        assert message in out.stderr + out.stdout


# ---- the pieces ----


def test_layer_split_is_even_with_the_remainder_in_the_middle_stages() -> None:
    assert layer_split(30, 1) == [range(0, 30)]
    assert layer_split(30, 2) == [range(0, 15), range(15, 30)]
    assert [len(r) for r in layer_split(30, 4)] == [7, 8, 8, 7]
    assert [len(r) for r in layer_split(31, 4)] == [8, 8, 8, 7]  # the middle two, then the first
    assert [len(r) for r in layer_split(10, 4)] == [2, 3, 3, 2]
    assert layer_split(30, 2, (10, 20)) == [range(0, 10), range(10, 30)]
    ranges = layer_split(24, 3)
    assert ranges[0].start == 0 and ranges[-1].stop == 24
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError, match="want 2 counts of at least 1"):
        layer_split(30, 2, (30, 0))


def test_a_stage_holds_only_its_tensors() -> None:
    middle = PipelineStage(1, 3, range(10, 20), 1, 1)
    last = PipelineStage(2, 3, range(20, 30), 2, 1)
    assert holds_tensor(middle, "model.layers.10.mlp.down_proj.weight", False)
    assert not holds_tensor(middle, "model.layers.9.mlp.down_proj.weight", False)
    assert not holds_tensor(middle, "model.layers.20.self_attn.q_proj.weight", False)
    assert not holds_tensor(middle, "model.embed_tokens.weight", False)
    assert not holds_tensor(middle, "model.norm.weight", False)
    assert not holds_tensor(middle, "lm_head.weight", False)
    assert holds_tensor(last, "model.norm.weight", True)
    assert holds_tensor(last, "lm_head.weight", False)
    assert holds_tensor(last, "model.embed_tokens.weight", True)  # a tied head
    assert holds_tensor(PipelineStage(layers=range(0, 30)), "model.layers.29.mlp.up_proj.weight", False)


@pytest.mark.parametrize("tied", [True, False])
def test_each_stage_loads_only_its_layers(tmp_path: Path, smollm2_dir: Path, tied: bool) -> None:
    model_dir = make_tiny_model(tmp_path / "m", smollm2_dir, num_hidden_layers=4, tie_word_embeddings=tied)
    stages = [PipelineStage(s, 2, r, s, 1) for s, r in enumerate(layer_split(4, 2))]
    names = [
        {n for n, _ in load_model(model_dir, torch.float32, torch.device("cpu"), stage=stage).named_parameters()}
        for stage in stages
    ]
    first, last = names
    assert any(n.startswith("model.layers.0.") for n in first) and any(n.startswith("model.layers.1.") for n in first)
    assert not any(n.startswith(("model.layers.2.", "model.layers.3.")) for n in first)
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in last)
    assert "model.embed_tokens.weight" in first and "model.norm.weight" not in first
    assert "model.norm.weight" in last
    # A tied head reads an embedding the last stage holds itself; an untied one has its own.
    assert ("model.embed_tokens.weight" in last) == tied and ("lm_head.weight" in last) == (not tied)


def test_a_worker_info_names_the_pipelines_driver() -> None:
    info = WorkerInfo("m", 100, 64, "float32", "cpu", 0, 6, 16, 10, 0, pipeline_stages=3)
    assert info.driver_rank == 4  # the last stage's first rank: stages of 2
    assert WorkerInfo("m", 100, 64, "float32", "cpu", 0, 2, 16, 10, 0).driver_rank == 0
    assert out_of_bounds(info) is None
    assert "4 pipeline stages in a group of 6" in (
        out_of_bounds(WorkerInfo(**{**info.__dict__, "pipeline_stages": 4})) or ""
    )


def test_the_offline_llm_takes_vllms_pipeline_parallel_size(four_layers: Path) -> None:
    from llmserve import LLM, SamplingParams

    prompts = prompts_for(5, (12, 25))
    want = reference_greedy(four_layers, LlamaForCausalLM, prompts)
    llm = LLM(str(four_layers), dtype="float32", device="cpu", num_gpu_blocks=64, pipeline_parallel_size=2)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.close()
    assert [list(o.outputs[0].token_ids) for o in outs] == want
