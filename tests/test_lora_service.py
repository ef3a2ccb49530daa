"""Multi-LoRA through the real services: a worker process with two adapter slots, an in-process
scheduler on a real port, PEFT adapters made with peft, and transformers + peft as the reference.

Every request's greedy tokens (float32) must equal transformers + peft's for its adapter, with
base and adapter requests mixed in the same steps, more adapters than slots, the same prompt
under several adapters (the prefix cache must keep their blocks apart), and through TGIS.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from common.pb.fmaas import generation_pb2 as tgis_pb
from common.pb.fmaas import generation_pb2_grpc as tgis_grpc
from common.pb.llmserve.v1 import generation_pb2 as pb
from tests.adapters import ATTENTION, MLP, make_peft_adapter, reference_greedy
from tests.conftest import Scheduler, WorkerProcess, collect, start_scheduler, start_worker, stop_scheduler

MAX_TOKENS = 8
MAX_RANK = 16
# Three prompts of more than two KV blocks each (16 tokens a block), so a repeat hits the prefix cache.
PROMPTS = [[1, *range(100 + 40 * i, 140 + 40 * i)] for i in range(3)]

# name: (target modules, rank, rsLoRA, seed)
ADAPTERS = {
    "qv": (("q_proj", "v_proj"), 8, False, 1),
    "mlp": (("o_proj", *MLP), 4, True, 2),
    "all": ((*ATTENTION, *MLP), 16, False, 3),
    "kv": (("k_proj", "v_proj", "down_proj"), 8, False, 4),
}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    dirs = {
        name: make_peft_adapter(tiny_model_dir, root / name, targets, rank=rank, rslora=rslora, seed=seed)
        for name, (targets, rank, rslora, seed) in ADAPTERS.items()
    }
    dirs["too-big"] = make_peft_adapter(tiny_model_dir, root / "too-big", ("q_proj",), rank=32, seed=5)
    return dirs


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    """transformers (+ peft) greedy tokens of every prompt, for the base model and each adapter."""
    out = {"": reference_greedy(tiny_model_dir, None, PROMPTS, MAX_TOKENS)}
    for name in ADAPTERS:
        out[name] = reference_greedy(tiny_model_dir, adapter_dirs[name], PROMPTS, MAX_TOKENS)
        assert out[name] != out[""], f"adapter {name} changes nothing: the test could not fail"
    return out


@pytest.fixture(scope="module")
def lora_worker(tiny_model_dir: Path) -> Iterator[WorkerProcess]:
    worker = start_worker(
        tiny_model_dir, "--num-gpu-blocks", "64", "--enable-lora", "--max-loras", "2", "--max-lora-rank", str(MAX_RANK)
    )
    yield worker
    worker.stop()


@pytest.fixture
async def lora_scheduler(
    tiny_model_dir: Path, lora_worker: WorkerProcess, adapter_dirs: dict[str, Path]
) -> AsyncIterator[Scheduler]:
    s = await start_scheduler(
        tiny_model_dir,
        lora_worker.address,
        enable_lora=True,
        max_lora_rank=MAX_RANK,
        lora_modules=(("qv", str(adapter_dirs["qv"])),),  # type: ignore[arg-type]
        # The tests load the others at run time, from the directory that holds them all.
        lora_root=str(adapter_dirs["qv"].parent),  # type: ignore[arg-type]
        allow_runtime_lora=True,
    )
    await s.wait_ready()
    try:
        yield s
        await s.wait_idle()
        for replica in s.engine.replicas:  # every slot reference given back
            assert not any(replica.scheduler.queues.adapter_slots.refs)
    finally:
        await stop_scheduler(s)


def greedy(prompt: list[int], adapter: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        stopping=pb.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True),
        adapter_id=adapter,
    )


def slot_loads(s: Scheduler) -> int:
    return sum(r.scheduler.num_adapter_loads for r in s.engine.replicas)


async def test_mixed_adapters_in_one_batch_match_transformers_and_peft(
    lora_scheduler: Scheduler, adapter_dirs: dict[str, Path], expected: dict[str, list[list[int]]]
) -> None:
    stub = lora_scheduler.stub
    await stub.LoadAdapter(pb.LoadAdapterRequest(name="mlp", path=str(adapter_dirs["mlp"])))
    # The base model first, alone: its blocks are then in the prefix cache when the same prompts
    # come back under the adapters, which must not reuse them.
    base = [await collect(stub, greedy(p)) for p in PROMPTS]
    assert [g.token_ids for g in base] == expected[""]
    names = ["", "qv", "mlp"]
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in names]
    results = await asyncio.gather(*(collect(stub, greedy(PROMPTS[i], name)) for name, i in jobs))
    for (name, i), got in zip(jobs, results):
        assert got.token_ids == expected[name][i], f"adapter {name or 'base'!r}, prompt {i}"
    # Repeats under one adapter share its cached blocks.
    again = await collect(stub, greedy(PROMPTS[0], "qv"))
    assert again.token_ids == expected["qv"][0]
    assert again.final.stats.prefix_cache_hit_tokens >= 32


async def test_more_adapters_than_slots_complete_without_thrashing(
    lora_scheduler: Scheduler, adapter_dirs: dict[str, Path], expected: dict[str, list[list[int]]]
) -> None:
    stub = lora_scheduler.stub
    for name in ("mlp", "all", "kv"):
        await stub.LoadAdapter(pb.LoadAdapterRequest(name=name, path=str(adapter_dirs[name])))
    before = slot_loads(lora_scheduler)
    # Four adapters over two slots, arriving grouped by adapter: in line order each adapter is
    # put into a slot once (a waiting adapter takes the slot the group before it left).
    order = [(name, i) for name in ("qv", "mlp", "all", "kv") for i in range(len(PROMPTS))]
    tasks = []
    for name, i in order:
        tasks.append(asyncio.ensure_future(collect(stub, greedy(PROMPTS[i], name))))
        await asyncio.sleep(0.02)  # keeps the arrival order
    results = await asyncio.gather(*tasks)
    for (name, i), got in zip(order, results):
        assert got.token_ids == expected[name][i], f"adapter {name}, prompt {i}"
    loads = slot_loads(lora_scheduler) - before
    assert 2 <= loads <= 4, f"{loads} slot loads for 4 adapters arriving in groups"
    metrics = lora_scheduler.engine.metrics
    assert metrics.adapter_loads._value.get() == slot_loads(lora_scheduler)
    assert metrics.adapter_requests("kv")._value.get() == len(PROMPTS)
    assert metrics.adapter_tokens("kv")._value.get() == len(PROMPTS) * MAX_TOKENS


async def test_unknown_adapters_and_bad_files_are_refused(
    lora_scheduler: Scheduler, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    stub = lora_scheduler.stub
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, greedy(PROMPTS[0], "nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadAdapter(pb.LoadAdapterRequest(name="big", path=str(adapter_dirs["too-big"])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "32" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadAdapter(pb.LoadAdapterRequest(name="qv", path=str(adapter_dirs["mlp"])))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadAdapter(pb.LoadAdapterRequest(name="gone", path=str(tmp_path / "missing")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.UnloadAdapter(pb.UnloadAdapterRequest(name="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()


async def test_adapters_are_listed_and_unloaded(
    lora_scheduler: Scheduler, adapter_dirs: dict[str, Path], expected: dict[str, list[list[int]]]
) -> None:
    stub = lora_scheduler.stub
    info = await stub.LoadAdapter(pb.LoadAdapterRequest(name="mlp", path=str(adapter_dirs["mlp"])))
    config = json.loads((adapter_dirs["mlp"] / "adapter_config.json").read_text())
    assert (info.rank, info.scale) == (4, pytest.approx(config["lora_alpha"] / 2.0))  # rsLoRA: alpha / sqrt(4)
    assert sorted(info.target_modules) == sorted(ADAPTERS["mlp"][0])
    listed = await stub.ListAdapters(pb.ListAdaptersRequest())
    assert [a.name for a in listed.adapters] == ["qv", "mlp"]
    model = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert [a.name for a in model.adapters] == ["qv", "mlp"]
    # A request in flight keeps its adapter through an unload; new ones are refused.
    running = asyncio.ensure_future(collect(stub, greedy(PROMPTS[1], "mlp")))
    await asyncio.sleep(0.05)
    await stub.UnloadAdapter(pb.UnloadAdapterRequest(name="mlp"))
    assert (await running).token_ids == expected["mlp"][1]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, greedy(PROMPTS[1], "mlp"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert [a.name for a in (await stub.ListAdapters(pb.ListAdaptersRequest())).adapters] == ["qv"]


async def test_tgis_adapter_id_selects_the_adapter(
    lora_scheduler: Scheduler, expected: dict[str, list[list[int]]]
) -> None:
    stub = tgis_grpc.GenerationServiceStub(lora_scheduler.channel)
    text = lora_scheduler.engine.tokenizer.decode(PROMPTS[2][1:])
    ids = lora_scheduler.engine.tokenizer.encode(text)
    native = await collect(lora_scheduler.stub, greedy(ids, "qv"))
    reply = await stub.Generate(
        tgis_pb.BatchedGenerationRequest(
            adapter_id="qv",
            requests=[tgis_pb.GenerationRequest(text=text)],
            params=tgis_pb.Parameters(
                stopping=tgis_pb.StoppingCriteria(max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS),
                response=tgis_pb.ResponseOptions(generated_tokens=True),
            ),
        )
    )
    tokens = [t.text for t in reply.responses[0].tokens]
    assert tokens == lora_scheduler.engine.tokenizer.token_strings(native.token_ids)
    base = await collect(lora_scheduler.stub, greedy(ids))
    assert base.token_ids != native.token_ids


def test_offline_llm_serves_adapters_per_prompt(
    tiny_model_dir: Path, adapter_dirs: dict[str, Path], expected: dict[str, list[list[int]]]
) -> None:
    from llmserve import LLM, LoRARequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(
        str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_gpu_blocks=64,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=MAX_RANK,
        lora_modules={"qv": str(adapter_dirs["qv"])},
    ) as llm:
        adapters = [None, "qv", LoRARequest("mlp", 2, str(adapter_dirs["mlp"]))]
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters)
        assert [o.outputs[0].token_ids for o in outs] == [expected[""][0], expected["qv"][1], expected["mlp"][2]]
        assert llm.list_loras() == ["qv", "mlp"]
        # One adapter for every prompt.
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request="mlp")
        assert [o.outputs[0].token_ids for o in outs] == expected["mlp"]
        with pytest.raises(LookupError, match="nope"):
            llm.generate(prompts[:1], params, use_tqdm=False, lora_request="nope")


async def test_worker_groups_without_big_enough_slots_are_refused(lora_scheduler: Scheduler) -> None:
    from common.worker_info import WorkerInfo

    spec = lora_scheduler.engine.spec

    def info(max_loras: int, max_lora_rank: int) -> WorkerInfo:
        return WorkerInfo(
            spec.name, spec.vocab_size, 512, "float32", "cpu", 0, 1, 16, 64, 0, 0, max_loras, max_lora_rank
        )

    fleet = lora_scheduler.engine._fleet
    (group,) = lora_scheduler.engine.replicas
    assert fleet._incompatibility(group, info(2, MAX_RANK)) is None
    assert "--enable-lora" in (fleet._incompatibility(group, info(0, 0)) or "")
    assert f"--max-lora-rank {MAX_RANK}" in (fleet._incompatibility(group, info(2, 8)) or "")
