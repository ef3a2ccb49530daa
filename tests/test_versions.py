"""kernels/versions.py: reading version strings, and the one-line refusal of a too-old GPU stack."""

from __future__ import annotations

import tomllib

import pytest

from kernels import versions
from kernels.versions import (
    MIN_TORCH,
    MIN_TRITON,
    UnsupportedStack,
    at_least,
    gpu_stack_problem,
    installed_versions,
    interpreter_stack_problem,
    release,
    require_gpu_stack,
)
from tests.conftest import REPO


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2.13.0", (2, 13, 0)),
        ("2.11.0+cu130", (2, 11, 0)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.11.0a0+git1b2c3d4", (2, 11, 0)),  # NVIDIA's images
        ("2.12.0.dev20260101+cu128", (2, 12, 0)),  # nightlies
        ("3.6.0+git9844da95", (3, 6, 0)),  # pytorch-triton
        ("3.6", (3, 6)),
        ("v3.9.0", (3, 9, 0)),
        ("3.6.0-custom build", (3, 6, 0)),  # not PEP 440: its leading digits
        ("unknown", None),
        ("", None),
    ],
)
def test_release(text: str, expected: tuple[int, ...] | None) -> None:
    assert release(text) == expected


@pytest.mark.parametrize(
    "text, minimum, expected",
    [
        ("2.11.0", (2, 11), True),
        ("2.11", (2, 11, 0), True),
        ("2.11.0a0+git1b2c3d4", (2, 11), True),  # a pre-release counts as its release
        ("2.10.9", (2, 11), False),
        ("3.10.0", (3, 6), True),  # numbers, not strings: 10 > 6
        ("2.9.1+cu128", (2, 11), False),
        ("unknown", (0,), False),
    ],
)
def test_at_least(text: str, minimum: tuple[int, ...], expected: bool) -> None:
    assert at_least(text, minimum) is expected


def test_a_new_enough_pair_has_no_problem() -> None:
    assert gpu_stack_problem({"torch": "2.11.0+cu130", "triton": "3.6.0"}) is None
    assert gpu_stack_problem({"torch": "2.13.0+cpu", "triton": "3.9.0"}) is None


def test_too_old_names_what_is_needed_on_one_line() -> None:
    problem = gpu_stack_problem({"torch": "2.9.1+cu128", "triton": "3.5.1"})
    assert problem == (
        "the GPU path needs torch>=2.11 and triton>=3.6; found torch 2.9.1+cu128 (too old), triton 3.5.1 (too old)"
    )


def test_only_the_short_package_is_marked() -> None:
    problem = gpu_stack_problem({"torch": "2.11.0", "triton": "3.5.1"})
    assert problem is not None and "\n" not in problem
    assert "torch 2.11.0," in problem and "triton 3.5.1 (too old)" in problem


def test_missing_and_unreadable_versions_are_problems() -> None:
    assert gpu_stack_problem({"torch": "2.13.0"}) == (
        "the GPU path needs torch>=2.11 and triton>=3.6; found torch 2.13.0, no triton"
    )
    problem = gpu_stack_problem({"torch": "unknown", "triton": "3.9.0"})
    assert problem is not None and "torch 'unknown' (unreadable version)" in problem


def test_require_gpu_stack_raises_the_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "installed_versions", lambda: {"torch": "2.8.0", "triton": "3.4.0"})
    with pytest.raises(
        UnsupportedStack, match=r"^the GPU path needs torch>=2\.11 and triton>=3\.6; found torch 2\.8\.0"
    ):
        require_gpu_stack()
    require_gpu_stack({"torch": "2.11.0", "triton": "3.6.0"})  # given versions are not read again


def test_the_installed_pair_passes() -> None:
    installed = installed_versions()
    assert installed["torch"] and installed["triton"] and installed["numpy"]
    require_gpu_stack()
    assert interpreter_stack_problem(installed) is None


def test_the_pins_are_not_below_the_minimum() -> None:
    pins = {}
    for spec in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        name, _, version = spec.partition("==")
        pins[name] = version
    assert at_least(pins["torch"], MIN_TORCH) and at_least(pins["triton"], MIN_TRITON)


@pytest.mark.parametrize(
    "triton, numpy, refused",
    [
        ("3.6.0", "2.4.6", True),  # int() of a one-element array is an error from numpy 2.4
        ("3.6.0", "2.3.5", False),  # only a DeprecationWarning before it
        ("3.7.0", "2.4.6", False),  # the interpreter squeezes the array first
        ("3.9.0", "2.4.6", False),
    ],
)
def test_the_old_interpreter_beside_numpy_2_4(triton: str, numpy: str, refused: bool) -> None:
    problem = interpreter_stack_problem({"torch": "2.11.0", "triton": triton, "numpy": numpy})
    assert (problem is not None) is refused
    if refused:
        assert problem == (
            "TRITON_INTERPRET=1 needs triton>=3.7 with numpy>=2.4 (or numpy<2.4); found triton 3.6.0, numpy 2.4.6"
        )
