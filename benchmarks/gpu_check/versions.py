"""What the numbers were measured with: a result without its versions cannot be compared.

The device image's torch and Triton are older than the ones the project pins (pyproject.toml);
kernels/versions.py states the oldest the GPU path supports and names what falls short. Its
verdict is recorded as it gives it; a stack it refuses fails this section (the others still
run, and those that start a worker fail with the same reason).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import platform
from typing import Any

import torch

from gpu_check.context import Context

PACKAGES = ("torch", "triton", "transformers", "tokenizers", "numpy", "grpcio", "protobuf", "pytest", "pytest-timeout")


def run(ctx: Context) -> dict[str, Any]:
    result: dict[str, Any] = {"python": platform.python_version(), "packages": _packages()}
    result["cuda_runtime"] = torch.version.cuda
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        result["device"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_bytes": props.total_memory,
            "l2_bytes": getattr(props, "L2_cache_size", None),
            "count": torch.cuda.device_count(),
        }
    else:
        result["device"] = {"name": "cpu"}
    checked = result["kernels_versions"] = _kernels_check(ctx.cuda)
    packages = result["packages"]
    result["summary"] = (
        f"{result['device']['name']}, torch {packages['torch']}, triton {packages['triton']}, "
        f"CUDA {result['cuda_runtime']}, transformers {packages['transformers']}"
    )
    # Below the floor the worker refuses to start on CUDA: this row then names why the
    # sections that build one fail.
    problem = checked.get("gpu_stack_problem") if ctx.cuda else checked.get("interpreter_stack_problem")
    if problem:
        result["passed"] = False
        result["summary"] += f"; {problem}"
    return result


def _packages() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _kernels_check(cuda: bool) -> dict[str, Any]:
    """kernels.versions' verdict on this stack, read defensively (each name only if it is
    there): the floor it states, what it finds installed, and its one-line problem, if any,
    for the GPU path (and, without CUDA, for the interpreter)."""
    try:
        module = importlib.import_module("kernels.versions")
    except ImportError as error:
        return {"available": False, "reason": str(error)}
    found: dict[str, Any] = {"available": True}
    minimum = getattr(module, "GPU_MINIMUM", None)
    if isinstance(minimum, dict):
        found["gpu_minimum"] = {name: ".".join(map(str, v)) for name, v in minimum.items()}
    installed_versions = getattr(module, "installed_versions", None)
    if not callable(installed_versions):
        return found
    installed = installed_versions()
    found["installed"] = _plain(installed)
    checks = ["gpu_stack_problem"] if cuda else ["gpu_stack_problem", "interpreter_stack_problem"]
    for name in checks:
        check = getattr(module, name, None)
        if callable(check):
            found[name] = check(installed)
    return found


def _plain(value: Any) -> Any:
    """A JSON-able form of whatever the check returns."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
