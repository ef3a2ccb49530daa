"""The engine options of `LLM(...)`: keyword arguments turned into `llmserve up` flags and parsed
by the command's own parser.

Going through the parser keeps one definition of each option (its flag, type, choices and
default) for the command and the offline API alike, and `llmserve.cli.configs` builds and
checks the configurations from the result exactly as `llmserve up` does. A keyword is a
flag's destination: `max_num_seqs=64` is `--max-num-seqs 64`, `enforce_eager=True` is
`--enforce-eager`, `plan_ahead=False` is `--no-plan-ahead`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from dataclasses import dataclass
from typing import Any

from common.config import SchedulerConfig
from llmserve.cli import configs
from llmserve.cli.flags import add_scheduler_flags, add_worker_flags
from llmserve.cli.parser import build_parser

# `up`'s options besides the scheduler's and the worker's; the others (ports, TLS, the
# gateway) concern what the offline API does not run.
_ENGINE_EXTRAS = ("workers",)


@dataclass(frozen=True)
class EngineArgs:
    model: str  # the model directory (resolved: the default model is prepared if none was given)
    flags: argparse.Namespace  # the parsed `up` command line, what llmserve.cli.configs' functions take
    scheduler: SchedulerConfig


def _up_options() -> dict[str, argparse.Action]:
    """The engine's options of the `up` subcommand (scheduler, worker, workers), by destination."""
    engine = argparse.ArgumentParser(add_help=False)
    add_scheduler_flags(engine)
    add_worker_flags(engine)
    # argparse has no public way to list a parser's options or reach a subcommand's parser.
    names = {a.dest for a in engine._actions} | set(_ENGINE_EXTRAS)
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in subcommands.choices["up"]._actions if a.dest in names}


def engine_args(model: str | None, log_level: str, options: dict[str, Any]) -> EngineArgs:
    """Parse and check the options; TypeError for an unknown keyword, ValueError for a bad value."""
    known = _up_options()
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(
            f"LLM() got unexpected keyword argument(s): {', '.join(unknown)}; "
            f"engine options are: {', '.join(sorted(known))}"
        )
    argv = ["--log-level", log_level, "up"]
    for name, value in options.items():
        action = known[name]
        flag = action.option_strings[0]
        if action.nargs == 0:  # an on/off flag (store_true, or store_false for --no-*)
            if not isinstance(value, bool):
                raise ValueError(f"{name}: must be True or False, got {value!r}")
            if value != action.default:
                argv.append(flag)
        elif action.nargs == "+":  # lora_modules: {name: dir}, or ["NAME=DIR", ...]
            items = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else [str(v) for v in value]
            if items:
                argv += [flag, *items]
        elif isinstance(value, dict):  # speculative_config, vLLM's dict
            argv += [flag, json.dumps(value)]
        elif value is not None:  # None keeps the default
            argv += [flag, str(value)]
    flags = _parse(argv, known)
    resolved = configs.model_dir(model)
    configs.worker_config(flags, resolved)  # checks the worker options as `up` does before starting anything
    configs.check_tp(resolved, flags.tp)
    configs.check_pp(resolved, flags.pp, flags.pp_layer_split)
    if flags.workers < 1:
        raise ValueError(f"workers: must be at least 1, got {flags.workers}")
    return EngineArgs(model=resolved, flags=flags, scheduler=configs.scheduler_config(flags))


def _parse(argv: list[str], known: dict[str, argparse.Action]) -> argparse.Namespace:
    """argparse reports a bad value by printing usage and exiting: catch that as a ValueError
    that names the keyword instead of the flag."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(argv)
    except SystemExit:
        message = stderr.getvalue().strip().splitlines()[-1].partition("error: ")[2]
        flags = {"log_level": "--log-level", **{name: "/".join(a.option_strings) for name, a in known.items()}}
        for name, flag in flags.items():
            message = message.replace(f"argument {flag}", name)
        raise ValueError(message) from None
