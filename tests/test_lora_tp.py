"""LoRA with tensor parallelism: a tp = 3 worker group of SmolLM2 (9 heads, 3 KV heads: one KV
head per rank) serves base and adapter requests mixed in the same steps, and each gives
transformers + peft's greedy tokens (float32). Column-parallel parts keep their rows of B,
row-parallel ones their columns of A, and a row-parallel update joins the all-reduce."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.pb.llmserve.v1 import generation_pb2 as pb
from tests.adapters import MLP, make_peft_adapter, reference_greedy
from tests.conftest import collect, start_scheduler, stop_scheduler
from tests.test_tp_service import start_group

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
PROMPTS = [[1, 504, 3458, 314, 4649, 282], [1, 2683, 8297, 28, 339, 1695, 2722, 30, 549]]


async def test_tp3_smollm2_mixes_adapters_like_transformers_and_peft(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("lora-tp")
    # A moderate update (std 0.05): enough to change the greedy tokens (0.02 did not change the
    # attention adapter's), small enough that rank sums do not round the logits apart.
    adapters = {
        "qkv": make_peft_adapter(smollm2_dir, root / "qkv", ("q_proj", "k_proj", "v_proj"), rank=8, seed=1, std=0.05),
        "mlp": make_peft_adapter(smollm2_dir, root / "mlp", ("o_proj", *MLP), rank=4, rslora=True, seed=2, std=0.05),
    }
    expected = {"": reference_greedy(smollm2_dir, None, PROMPTS, MAX_TOKENS)}
    for name, path in adapters.items():
        expected[name] = reference_greedy(smollm2_dir, path, PROMPTS, MAX_TOKENS)
        assert expected[name] != expected[""], f"adapter {name} changes nothing: the test could not fail"
    launcher, addresses = start_group(
        smollm2_dir, 3, dist_timeout=60.0, extra=("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
    )
    s = await start_scheduler(
        smollm2_dir,
        ",".join(addresses),
        enable_lora=True,
        max_lora_rank=8,
        lora_modules=tuple((n, str(p)) for n, p in adapters.items()),  # type: ignore[arg-type]
    )
    try:
        await s.wait_ready(timeout=300)
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("", "qkv", "mlp")]
        got = await asyncio.gather(
            *(
                collect(
                    s.stub,
                    pb.GenerateRequest(
                        prompt_token_ids=PROMPTS[i],
                        stopping=pb.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True),
                        adapter_id=name,
                    ),
                )
                for name, i in jobs
            )
        )
        for (name, i), g in zip(jobs, got):
            assert g.token_ids == expected[name][i], f"adapter {name or 'base'!r}, prompt {i}"
        await s.wait_idle()
    finally:
        await stop_scheduler(s)
        launcher.terminate()
        assert launcher.wait(60) == 0
