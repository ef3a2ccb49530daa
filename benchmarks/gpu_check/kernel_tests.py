"""The kernel tests on CUDA (the whole grid, --full-kernels), last and with what is left.

Their cost is compiling: each case of the grid is a kernel variant, and a cold machine
compiles each for seconds, so on a fresh device they do not finish in one window. They run
after every measurement, stopped cleanly between tests when the budget is about to end
(pytest-timeout's --session-timeout), a hung test stopped by --timeout, and the process
killed if it still runs when the budget is gone. What ran is counted either way.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpu_check.context import Context, Skip

REPO_ROOT = Path(__file__).resolve().parents[2]
# Most telling first: what is cut off at the end of the budget is the least missed.
FILES = (
    "tests/test_kernels.py",
    "tests/test_cuda_graphs.py",
    "tests/test_decode_splits.py",
    "tests/test_workspace.py",
    "tests/test_block_ops.py",
    "tests/test_token_mask.py",
    "tests/test_host_copy.py",
    "tests/test_lora_kernels.py",
    "tests/test_model_forward.py",
    "tests/test_runner.py",
)
PER_TEST_TIMEOUT_S = 300
KILL_MARGIN_S = 15.0  # between pytest's own stop and the kill: a test that overran ends its report
SESSION_STOP = re.compile(r"session-timeout: \S+ sec exceeded")  # pytest-timeout's reason for stopping
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def command(seconds: float) -> list[str]:
    files = [f for f in FILES if (REPO_ROOT / f).is_file()]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "--full-kernels"]
    cmd.append(f"--timeout={int(min(PER_TEST_TIMEOUT_S, max(seconds, 1)))}")
    if _has_session_timeout():
        cmd.append(f"--session-timeout={int(max(seconds - KILL_MARGIN_S, 1))}")
    return cmd


def _has_session_timeout() -> bool:
    """--session-timeout came with pytest-timeout 2.3; an older one would refuse the flag."""
    try:
        major, minor = (int(x) for x in importlib.metadata.version("pytest-timeout").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (2, 3)


def run(ctx: Context) -> dict[str, Any]:
    try:
        import pytest  # noqa: F401
        import pytest_timeout  # noqa: F401
    except ImportError as error:
        raise Skip(f"{error.name} is not installed here (benchmarks/device_wheels.sh carries it)") from error
    left = ctx.budget.left()
    cmd = command(left if left != float("inf") else 3600.0)
    files = [part for part in cmd if part.startswith("tests/")]
    if ctx.dry:
        return {"command": " ".join(cmd), "summary": f"{len(files)} test files; pytest and pytest-timeout import"}
    if not ctx.cuda:
        raise Skip("the kernel tests run on CUDA here; on a CPU they are part of `make test`")
    timeout = None if left == float("inf") else max(left - 1.0, 1.0)
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        output, returncode, killed = proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as expired:
        output = _text(expired.stdout) + _text(expired.stderr)
        returncode, killed = None, True
    counts = _counts(output)
    stopped = SESSION_STOP.search(output) is not None
    cut = " (cut short by the budget)" if killed or stopped else ""
    return {
        "command": " ".join(cmd),
        "files": files,
        "returncode": returncode,
        "killed_at_budget": killed,
        "stopped_by_session_timeout": stopped,
        "counts": counts,
        "output_tail": output[-4000:],
        # Tests the budget cut off are not failures; what ran must pass.
        "passed": counts.get("failed", 0) == 0
        and counts.get("error", 0) == 0
        and (killed or stopped or returncode == 0),
        "summary": ", ".join(f"{n} {k}" for k, n in counts.items()) + cut,
    }


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _counts(output: str) -> dict[str, int]:
    """pytest's closing line ("3 failed, 120 passed in 1.2s"), or the progress dots of a run
    killed before it printed one."""
    lines = [line for line in output.splitlines() if " in " in line and COUNTS.search(line)]
    if lines:
        return {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in COUNTS.findall(lines[-1])}
    progress = "".join(line for line in output.splitlines() if re.fullmatch(r"[.FEsxX]+(\s+\[\s*\d+%\])?", line))
    return {"passed": progress.count("."), "failed": progress.count("F"), "error": progress.count("E")}
