"""The worker's step execution on a tiny random model: greedy decoding and plan checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.config import CacheConfig, WorkerConfig
from tests.conftest import KERNEL_DEVICE
from tests.plans import Feed, make_plan
from worker_svc.step.runner import ModelRunner, PlanError


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, ModelRunner]:
    path = tmp_path_factory.mktemp("runner-model")
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
    ref = LlamaForCausalLM(cfg).float().eval()
    ref.save_pretrained(str(path))
    runner = ModelRunner(
        WorkerConfig(
            model=str(path),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(block_size=8, num_gpu_blocks=16),
        )
    )
    return ref, runner


@pytest.fixture(scope="module")
def triton_model(model: tuple[LlamaForCausalLM, ModelRunner]) -> tuple[LlamaForCausalLM, ModelRunner]:
    """The same weights with every per-layer op on our Triton kernels (interpreter on CPU)."""
    ref, runner = model
    return ref, ModelRunner(
        WorkerConfig(
            model=runner.config.model,
            dtype="float32",
            device=KERNEL_DEVICE,
            attention_backend="triton",
            cache=CacheConfig(block_size=8, num_gpu_blocks=16),
        )
    )


@pytest.fixture(scope="module")
def cpu_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, ModelRunner]:
    """Heads of 64 (the C++ attention kernel's smallest), every per-layer op on our CPU kernels."""
    path = tmp_path_factory.mktemp("runner-model-cpu")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    ref = LlamaForCausalLM(cfg).float().eval()
    ref.save_pretrained(str(path))
    return ref, ModelRunner(
        WorkerConfig(
            model=str(path),
            dtype="float32",
            device="cpu",
            attention_backend="auto",
            cache=CacheConfig(block_size=8, num_gpu_blocks=16),
        )
    )


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_greedy_decoding_through_steps_equals_transformers_generate(
    request: pytest.FixtureRequest, backend: str
) -> None:
    ref, runner = request.getfixturevalue({"torch": "model", "triton": "triton_model", "cpu": "cpu_model"}[backend])
    assert runner.attention_backend == backend
    prompts = [[5, 17, 42, 99, 3], list(range(10, 30))]
    tables = [[3, 9, 1, 12], [4, 2, 15, 6, 11]]
    new_tokens = 12
    outputs: list[list[int]] = [[], []]
    tokens = [list(p) for p in prompts]
    context = [0, 0]
    for step in range(new_tokens):
        feeds = [Feed(i, tokens[i][context[i] :], context[i], tables[i], output_position=step) for i in range(2)]
        result = runner.execute(make_plan(step, feeds))
        for i in range(2):
            context[i] = len(tokens[i])
            tokens[i].append(int(result.sampled_token_ids[i]))
            outputs[i].append(int(result.sampled_token_ids[i]))
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            want = ref.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
        assert out == want[0, len(prompt) :].tolist()


def test_unsampled_rows_return_minus_one(model: tuple[LlamaForCausalLM, ModelRunner]) -> None:
    _, runner = model
    plan = make_plan(0, [Feed(0, [1, 2, 3], 0, [5], sample=False), Feed(1, [4, 5], 0, [6])])
    result = runner.execute(plan)
    assert result.sampled_token_ids[0] == -1 and result.sampled_token_ids[1] >= 0


def test_seeded_sampling_depends_on_seed_and_position_only(model: tuple[LlamaForCausalLM, ModelRunner]) -> None:
    _, runner = model
    alone = runner.execute(make_plan(0, [Feed(0, [7, 8, 9], 0, [1], temperature=1.0, seed=99, output_position=4)]))
    crowd = runner.execute(
        make_plan(
            1,
            [
                Feed(1, [3, 3], 0, [2], temperature=0.5, seed=1),
                Feed(0, [7, 8, 9], 0, [1], temperature=1.0, seed=99, output_position=4),
                Feed(2, [4], 0, [3]),
            ],
        )
    )
    assert alone.sampled_token_ids[0] == crowd.sampled_token_ids[1]


@pytest.mark.parametrize(
    ("feeds", "message"),
    [
        ([Feed(0, [1, 2], 0, [16])], "block id outside"),
        ([Feed(0, [1, 2], 0, [-1])], "block id outside"),
        ([Feed(0, [1, 200], 0, [1])], "token id outside"),
        ([Feed(0, [1], 64, [1, 2, 3, 4, 5, 6, 7, 8, 9])], "outside the model's context"),
        ([Feed(0, list(range(9)), 0, [1])], "too short"),
    ],
)
def test_malformed_plans_are_refused_before_touching_the_cache(
    model: tuple[LlamaForCausalLM, ModelRunner], feeds: list[Feed], message: str
) -> None:
    _, runner = model
    before = [k.clone() for k, _ in runner.kv.layers]
    with pytest.raises(PlanError, match=message):
        runner.execute(make_plan(0, feeds))
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, runner.kv.layers))


def test_inconsistent_plan_arrays_are_refused(model: tuple[LlamaForCausalLM, ModelRunner]) -> None:
    _, runner = model
    plan = make_plan(0, [Feed(0, [1, 2], 0, [1])])
    broken = type(plan)(**{**plan.__dict__, "query_lens": np.array([3], np.int32)})
    with pytest.raises(PlanError, match="sum of query_lens"):
        runner.execute(broken)


def test_cpu_steps_are_padded_to_gemm_buckets_without_changing_a_token(
    cpu_model: tuple[LlamaForCausalLM, ModelRunner],
) -> None:
    _, runner = cpu_model
    assert runner._gemm_buckets is not None and runner._gemm_buckets.pad(5) == 8
    # 3 + 1 + 1 = 5 tokens run as 8 rows; 2 of 3 sequences sample (LM head rows padded to 2).
    feeds = [Feed(0, [5, 6, 7], 0, [1]), Feed(1, [9], 4, [2]), Feed(2, [11], 0, [3])]
    padded_logits = runner.logits(make_plan(0, feeds))
    padded = runner.execute(make_plan(1, feeds))
    buckets, runner._gemm_buckets = runner._gemm_buckets, None
    try:
        exact_logits = runner.logits(make_plan(2, feeds))
        exact = runner.execute(make_plan(3, feeds))
    finally:
        runner._gemm_buckets = buckets
    assert padded_logits.shape == exact_logits.shape == (5, 200)
    torch.testing.assert_close(padded_logits, exact_logits, atol=1e-5, rtol=0)
    assert np.array_equal(padded.sampled_token_ids, exact.sampled_token_ids)
    np.testing.assert_allclose(padded.logprobs, exact.logprobs, atol=1e-5)


def test_deferred_inputs_are_the_tokens_the_last_step_sampled(model: tuple[LlamaForCausalLM, ModelRunner]) -> None:
    from common.plan import DEFERRED_INPUT

    _, runner = model
    prompt = [5, 17, 42]
    first = runner.execute(make_plan(0, [Feed(0, prompt, 0, [3])]))
    token = int(first.sampled_token_ids[0])
    explicit = runner.execute(make_plan(1, [Feed(0, [token], 3, [3], output_position=1)]))
    runner.execute(make_plan(2, [Feed(0, prompt, 0, [3])]))  # the same first step again
    deferred = runner.execute(make_plan(3, [Feed(0, [DEFERRED_INPUT], 3, [3], output_position=1)]))
    assert np.array_equal(deferred.sampled_token_ids, explicit.sampled_token_ids)
    # Only what the step right before sampled, and only as a sequence's last fed token.
    with pytest.raises(PlanError, match="did not sample"):
        runner.execute(make_plan(4, [Feed(7, [DEFERRED_INPUT], 3, [5])]))
    runner.execute(make_plan(5, [Feed(0, prompt, 0, [3])]))
    with pytest.raises(PlanError, match="last fed token"):
        runner.execute(make_plan(6, [Feed(0, [DEFERRED_INPUT, 4], 3, [3])]))


def test_a_step_past_the_kernels_token_limit_is_refused(triton_model: tuple[LlamaForCausalLM, ModelRunner]) -> None:
    """The Triton runner knows its int32 token limit (kernels/limits.py) and checks each plan
    against it; the limit is lowered here so that a small plan passes it."""
    _, runner = triton_model
    assert runner.step_token_limit is not None and runner.step_token_limit > 2**30
    limit, runner.step_token_limit = runner.step_token_limit, 2
    try:
        with pytest.raises(PlanError, match="3 tokens in one step, above the kernels' limit of 2"):
            runner.execute(make_plan(0, [Feed(0, [1, 2, 3], 0, [1])]))
        runner.execute(make_plan(1, [Feed(0, [1, 2], 0, [1])]))
    finally:
        runner.step_token_limit = limit
