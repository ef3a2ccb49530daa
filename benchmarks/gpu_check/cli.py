"""The command line of benchmarks/gpu_check.py (its docstring is the --help text)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import gpu_check
from gpu_check.context import Context
from gpu_check.report import Report, plan_table
from gpu_check.runner import Budget, plan, run_sections
from gpu_check.sections import NAMES, SECTIONS

DEFAULT_BUDGET_S = 480.0  # inside a 10-minute device window with the start and the wheels' install


def default_model_dir() -> Path:
    """Where `llmserve prepare-model` (and `make run`) put SmolLM2: $LLMSERVE_CACHE/models/...
    (not imported from llmserve, whose imports would tie --help to the whole service stack)."""
    cache = Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve"))
    return cache / "models" / "SmolLM2-135M-Instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_check.py", description=gpu_check.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--dry-run",
        action="store_true",
        help="any device: print the plan, build every section's inputs at tiny sizes and construct what can be, time nothing",
    )
    mode.add_argument(
        "--smoke", action="store_true", help="any device: every section end to end at tiny sizes (numbers meaningless)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds the whole run may take; a section whose estimate exceeds what is left is skipped "
        f"(default {DEFAULT_BUDGET_S:.0f} on CUDA, none with --smoke)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="JSON result (default $OUT/gpu_check.json, else ./gpu_check.json)"
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=default_model_dir(),
        help="SmolLM2-135M-Instruct for the parity section (default: where `llmserve prepare-model` puts it); "
        "skipped when absent",
    )
    p.add_argument("--sections", default=None, help=f"comma-separated, in the fixed order: {','.join(NAMES)}")
    p.add_argument("--skip-tests", action="store_true", help="leave out kernel_tests")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per measurement (the median is reported)")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error("--iters must be at least 1")
    if args.budget_s is not None and args.budget_s <= 0:
        p.error("--budget-s must be positive")
    if args.sections is not None:
        chosen = [name.strip() for name in args.sections.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in NAMES]
        if unknown or not chosen:
            p.error(f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(NAMES)}")
        args.sections = chosen
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    mode = "dry" if args.dry_run else "smoke" if args.smoke else "full"
    if mode == "full" and not cuda:
        print(
            "gpu_check needs CUDA to measure; on this machine run it with --dry-run (plan and set-up) or --smoke "
            "(tiny sizes end to end, Triton's interpreter)",
            file=sys.stderr,
        )
        return 2
    if not cuda:
        # Chosen when a kernel is defined: set before any section imports one.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _quiet()
    device = torch.device("cuda:0") if cuda else torch.device("cpu")
    budget_s = args.budget_s if args.budget_s is not None else (None if mode == "smoke" else DEFAULT_BUDGET_S)
    sections = [s for s in SECTIONS if (args.sections is None or s.name in args.sections)]
    if args.skip_tests:
        sections = [s for s in sections if s.name != "kernel_tests"]
    warm = triton_cache_warm()
    out = args.out or Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    report = Report(
        out,
        {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "mode": mode,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "host": platform.node(),
            "budget_s": budget_s,
            "estimates": "warm" if warm else "cold",
            "argv": sys.argv[1:] if argv is None else argv,
        },
    )
    report.plan = plan(sections, budget_s)
    print(
        f"gpu_check {mode} on {report.meta['device']}; estimates for an H200, this run's are {report.meta['estimates']}"
    )
    print(plan_table(report.plan, budget_s), flush=True)
    report.save()
    budget = Budget(None if mode == "dry" else budget_s)
    budget.start = gpu_check.STARTED
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as workdir:
        ctx = Context(
            device=device,
            mode=mode,
            iters=2 if mode != "full" else args.iters,
            model_dir=args.model_dir,
            workdir=Path(workdir),
            budget=budget,
        )
        run_sections(sections, ctx, report, warm, after_each=ctx.release)
    report.meta["seconds"] = budget.elapsed()
    report.save()
    print(report.table())
    print(f"wrote {out} ({budget.elapsed():.0f} s)")
    return 1 if report.names("failed") else 0


def triton_cache_warm() -> bool:
    """Whether kernels compiled by an earlier run are on disk here (a bare device has none)."""
    explicit = os.environ.get("TRITON_CACHE_DIR")
    home = os.environ.get("TRITON_HOME", str(Path.home()))
    directory = Path(explicit) if explicit else Path(home) / ".triton" / "cache"
    return directory.is_dir() and any(directory.iterdir())


def _quiet() -> None:
    """Warnings and errors only: the worker's info logs and transformers' progress bars would
    bury the section lines a person reads."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from common import log
    except ImportError:
        return  # structlog missing: the sections that need it fail on their own
    log.configure("warning", json=False)
