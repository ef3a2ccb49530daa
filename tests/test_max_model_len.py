"""--max-model-len: the context served, up to what the model's positions (and rope scaling) allow."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig

from common.config import CacheConfig, WorkerConfig
from common.model_spec import ModelSpec, context_limit, served_context
from llmserve.cli.configs import worker_config
from llmserve.cli.parser import build_parser
from tests.conftest import make_tiny_model
from worker_svc.step.runner import ModelRunner


@pytest.mark.parametrize(
    ("max_pos", "rope", "want"),
    [
        (4096, None, 4096),
        (4096, {"rope_type": "default", "rope_theta": 1e4}, 4096),
        # Qwen's recipe: max_position_embeddings left at the original, yarn x4 on top
        (32768, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
        # DeepSeek's: the extended length stated already, from a short original
        (163840, {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}, 163840),
        (2048, {"rope_type": "linear", "factor": 8.0}, 16384),
        # llama3 and longrope configs state the extended length themselves
        (131072, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 131072),
        (131072, {"rope_type": "longrope", "factor": 32.0, "original_max_position_embeddings": 4096}, 131072),
    ],
)
def test_the_context_limit_follows_the_rope_scaling(max_pos: int, rope: dict[str, object] | None, want: int) -> None:
    assert context_limit(max_pos, rope) == want


def test_a_yarn_config_stretches_the_scheduler_and_worker_limits(tmp_path: Path) -> None:
    config = LlamaConfig(
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "rope_theta": 10000.0,
        },
    )
    assert served_context(config, 0) == 4096
    assert served_context(config, 3000) == 3000
    with pytest.raises(ValueError, match="--max-model-len 5000 is beyond this model's 4096 positions"):
        served_context(config, 5000)
    config.save_pretrained(str(tmp_path))
    assert ModelSpec.from_dir(tmp_path).max_model_len == 4096


def test_the_flag_reaches_the_worker_and_bounds_its_plans(tmp_path: Path, smollm2_dir: Path) -> None:
    model = make_tiny_model(tmp_path / "m", smollm2_dir, max_position_embeddings=4096)
    args = build_parser().parse_args(["up", "--model", str(model), "--max-model-len", "256"])
    assert worker_config(args, str(model)).max_model_len == 256
    runner = ModelRunner(
        WorkerConfig(
            model=str(model),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            max_model_len=256,
            cache=CacheConfig(num_gpu_blocks=32),
        )
    )
    assert runner.info("m").max_model_len == 256
    assert all(rotary.cos.shape[0] == 256 for rotary in runner.model.rotaries.values())
