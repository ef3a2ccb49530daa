"""Worker flags reach the worker's config, and `up` hands them to the worker processes it starts."""

from __future__ import annotations

import pytest

from llmserve import cli


def _args(*flags: str) -> object:
    return cli._parser().parse_args(["up", "--model", "/models/m", *flags])  # noqa: SLF001


def test_gpu_memory_utilization_reaches_the_config_and_the_worker_command() -> None:
    a = _args("--gpu-memory-utilization", "0.55")
    assert cli._worker_config(a, "/models/m").cache.gpu_memory_utilization == 0.55  # type: ignore[arg-type]  # noqa: SLF001
    cmd = cli._worker_args(a, "/models/m")  # type: ignore[arg-type]  # noqa: SLF001
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.55"
    # The worker parses what `up` passes it into the same config.
    worker = cli._parser().parse_args(cmd[cmd.index("worker"):] + ["--listen", "unix:///tmp/w.sock"])  # noqa: SLF001
    assert cli._worker_config(worker, "/models/m").cache.gpu_memory_utilization == 0.55  # noqa: SLF001


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_gpu_memory_utilization_outside_its_range_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        cli._worker_config(_args("--gpu-memory-utilization", value), "/models/m")  # type: ignore[arg-type]  # noqa: SLF001
