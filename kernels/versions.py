"""The oldest torch and triton the GPU path is known to work with, and the check a CUDA start makes.

The project pins torch 2.13 / triton 3.9, but a GPU machine without network access has whatever
its image has (the lent H200 image has had torch 2.11 / triton 3.6). Measured offline, on the
interpreter and by compiling every kernel to an sm_90 cubin (tests/compile_kernels.py):

    torch 2.11 / triton 3.6   everything passes: kernel and model tests, the sm_90 compile,
                              its int32 index check, the warm-up variant keys
    torch 2.9  / triton 3.5   kernels compile and compute the same; the warm-up variant test
                              cannot hook the 3.5 interpreter's launches
    torch 2.8  / triton 3.4   kernels compile; the int32 check misreads 3.4's IR, and
                              triton.runtime.jit has no compute_cache_key for the warm-up test

So the minimum is the oldest pair on which every offline check holds. Pre-releases and local
builds count as their release: NVIDIA's images ship torch "2.11.0a0+git..." built from the
release branch, and a wheel says "+cu130".

Separately, the interpreter (TRITON_INTERPRET=1, the CPU path) of triton before 3.7 turns a
loop bound computed in a kernel into an int with int(array of shape (1,)), which numpy 2.4 made
an error: every kernel with such a loop (attention, LoRA, MoE) fails there.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping

from packaging.version import InvalidVersion, Version

MIN_TORCH = (2, 11)
MIN_TRITON = (3, 6)
GPU_MINIMUM = {"torch": MIN_TORCH, "triton": MIN_TRITON}

# The interpreter's int() of a one-element array: fixed in triton 3.7, an error from numpy 2.4.
INTERPRETER_FIXED_TRITON = (3, 7)
STRICT_NUMPY = (2, 4)

_LEADING_RELEASE = re.compile(r"\s*v?(\d+(?:\.\d+)*)")


class UnsupportedStack(RuntimeError):
    """The installed torch or triton is older than the GPU path needs (or missing)."""


def release(version: str) -> tuple[int, ...] | None:
    """The numeric release of a version string, or None when it has none.

    (2, 11, 0) for "2.11.0", "2.11.0+cu130", "2.11.0a0+git1b2c3d4" and "2.11.0.dev20260101";
    a string packaging rejects still gives its leading digits ("3.6.0-custom" -> (3, 6, 0)).
    """
    try:
        return Version(version).release
    except InvalidVersion:
        match = _LEADING_RELEASE.match(version)
        return tuple(int(part) for part in match.group(1).split(".")) if match else None


def _pad(numbers: tuple[int, ...], length: int) -> tuple[int, ...]:
    return numbers + (0,) * (length - len(numbers))


def at_least(version: str, minimum: tuple[int, ...]) -> bool:
    """Whether `version`'s release is `minimum` or newer (False when it cannot be read)."""
    found = release(version)
    if found is None:
        return False
    length = max(len(found), len(minimum))
    return _pad(found, length) >= _pad(minimum, length)


def _dotted(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))


def installed_versions() -> dict[str, str | None]:
    """torch's, triton's and numpy's own version strings; None for one that is not installed."""
    found: dict[str, str | None] = {}
    for name in ("torch", "triton", "numpy"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            found[name] = None
        else:
            found[name] = str(getattr(module, "__version__", "unknown"))
    return found


def gpu_stack_problem(installed: Mapping[str, str | None]) -> str | None:
    """One line naming the torch and triton the GPU path needs, when `installed` falls short.

    None when both are new enough. `installed` maps "torch" and "triton" to version strings,
    None (or absent) for a package that is not installed.
    """
    needs = " and ".join(f"{name}>={_dotted(minimum)}" for name, minimum in GPU_MINIMUM.items())
    found, short = [], False
    for name, minimum in GPU_MINIMUM.items():
        version = installed.get(name)
        if version is None:
            found.append(f"no {name}")
            short = True
        elif release(version) is None:
            found.append(f"{name} {version!r} (unreadable version)")
            short = True
        elif not at_least(version, minimum):
            found.append(f"{name} {version} (too old)")
            short = True
        else:
            found.append(f"{name} {version}")
    return f"the GPU path needs {needs}; found {', '.join(found)}" if short else None


def interpreter_stack_problem(installed: Mapping[str, str | None]) -> str | None:
    """One line when triton's interpreter cannot run the kernels beside this numpy, else None."""
    triton, numpy = installed.get("triton"), installed.get("numpy")
    if triton is None or numpy is None:
        return None  # nothing to run, or triton itself fails to import without numpy
    if at_least(triton, INTERPRETER_FIXED_TRITON) or not at_least(numpy, STRICT_NUMPY):
        return None
    return (
        f"TRITON_INTERPRET=1 needs triton>={_dotted(INTERPRETER_FIXED_TRITON)} with numpy>={_dotted(STRICT_NUMPY)}"
        f" (or numpy<{_dotted(STRICT_NUMPY)}); found triton {triton}, numpy {numpy}"
    )


def require_gpu_stack(installed: Mapping[str, str | None] | None = None) -> None:
    """Raises UnsupportedStack with gpu_stack_problem's line; reads the installed versions by default."""
    problem = gpu_stack_problem(installed_versions() if installed is None else installed)
    if problem is not None:
        raise UnsupportedStack(problem)
