"""The command line: worker flags reach the worker's config and the processes `up` starts; `generate`
names the flag of every bad value; every option has help."""

from __future__ import annotations

import argparse

import pytest

from llmserve.cli import commands, configs
from llmserve.cli.commands import cmd_generate
from llmserve.cli.parser import build_parser
from llmserve.cli.worker import worker_args


def _args(*flags: str) -> object:
    return build_parser().parse_args(["up", "--model", "/models/m", *flags])


def test_gpu_memory_utilization_reaches_the_config_and_the_worker_command() -> None:
    a = _args("--gpu-memory-utilization", "0.55")
    assert configs.worker_config(a, "/models/m").cache.gpu_memory_utilization == 0.55  # type: ignore[arg-type]
    cmd = worker_args(a, "/models/m")  # type: ignore[arg-type]
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.55"
    # The worker parses what `up` passes it into the same config.
    worker = build_parser().parse_args(cmd[cmd.index("worker") :] + ["--listen", "unix:///tmp/w.sock"])
    assert configs.worker_config(worker, "/models/m").cache.gpu_memory_utilization == 0.55


def test_lora_flags_reach_both_configs_and_the_worker_command() -> None:
    a = _args("--lora-modules", "sql=/adapters/sql", "chat=/a/chat", "--max-loras", "3", "--max-lora-rank", "16")
    sched = configs.scheduler_config(a)  # type: ignore[arg-type]
    assert sched.enable_lora and sched.max_lora_rank == 16  # --lora-modules implies --enable-lora
    assert sched.lora_modules == (("sql", "/adapters/sql"), ("chat", "/a/chat"))
    cmd = worker_args(a, "/models/m")  # type: ignore[arg-type]
    worker = build_parser().parse_args(cmd[cmd.index("worker") :] + ["--listen", "unix:///tmp/w.sock"])
    lora = configs.worker_config(worker, "/models/m").lora
    assert lora is not None and (lora.max_loras, lora.max_lora_rank, lora.host_copies) == (3, 16, 3)
    plain = _args()
    assert configs.worker_config(plain, "/models/m").lora is None  # type: ignore[arg-type]
    assert "--enable-lora" not in worker_args(plain, "/models/m")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NAME=DIR"):
        configs.scheduler_config(_args("--lora-modules", "no-equals-sign"))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_gpu_memory_utilization_outside_its_range_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        configs.worker_config(_args("--gpu-memory-utilization", value), "/models/m")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-tokens", "-1"], "argument --max-tokens: must be at least 0, got -1"),
        (["--temperature", "-0.5"], "argument --temperature: must be at least 0.0, got -0.5"),
        (["--top-p", "1.5"], "argument --top-p: must lie in [0, 1], got 1.5"),
        (["--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
    ],
)
def test_generate_flag_errors_name_the_flag(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["generate", "hi", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_generate_system_needs_chat() -> None:
    with pytest.raises(ValueError, match="^--system needs --chat$"):
        cmd_generate(build_parser().parse_args(["generate", "hi", "--system", "Be brief."]))


def test_server_errors_name_the_flag_that_set_the_field() -> None:
    assert commands._flag_names("sampling.top_k: must be >= 0") == "--top-k (sampling.top_k: must be >= 0)"  # noqa: SLF001
    assert commands._flag_names("stopping.stop[0]: empty stop string").startswith("--stop (")  # noqa: SLF001
    assert commands._flag_names("the server is shutting down") == "the server is shutting down"  # noqa: SLF001


def test_every_option_has_help() -> None:
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    missing = [
        f"{name} {' '.join(action.option_strings) or action.dest}"
        for name, sub in subcommands.choices.items()
        for action in sub._actions  # noqa: SLF001
        if action.help is None
    ]
    assert missing == []
