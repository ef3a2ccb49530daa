"""`llmserve`: the entry point (the only place that reads flags and environment).

llmserve up          scheduler + one worker on this machine, OpenAI HTTP in front (what `make run` starts)
llmserve scheduler   the scheduler service alone, driving a worker at --worker
llmserve worker      one worker service alone
llmserve gateway     the OpenAI HTTP API (smg) over one or more running schedulers
llmserve generate    stream one generation from a running service to the terminal
llmserve prepare-model   download and convert the default model into the cache

The command line is parser.py (its shared flag groups flags.py), the configurations built
from it configs.py, the commands commands.py, up.py and worker.py; `main` dispatches.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
from collections.abc import Callable

import structlog

from common import log as logsetup
from llmserve.cli.commands import cmd_gateway, cmd_generate, cmd_prepare_model, cmd_scheduler
from llmserve.cli.configs import log_json
from llmserve.cli.parser import build_parser
from llmserve.cli.up import cmd_up
from llmserve.cli.worker import cmd_worker

log = structlog.get_logger("llmserve")

COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "up": cmd_up,
    "scheduler": cmd_scheduler,
    "worker": cmd_worker,
    "generate": cmd_generate,
    "gateway": cmd_gateway,
    "prepare-model": cmd_prepare_model,
}


def main(argv: list[str] | None = None) -> None:
    """The `llmserve` command (pyproject's script entry, and `python -m llmserve.cli`)."""
    args = build_parser().parse_args(argv)
    logsetup.configure(args.log_level, json=log_json())
    # A crash in native code (a kernel, gRPC, torch) then leaves the Python stack of every
    # thread on stderr instead of a bare exit status.
    faulthandler.enable()
    try:
        COMMANDS[args.command](args)
    except ValueError as error:
        # Configuration mistakes (bad flags, bad model directory) are the user's to fix.
        log.error("invalid_configuration", reason=str(error))
        sys.exit(2)


__all__ = ["COMMANDS", "main"]
