"""Contracts of the repository layout: import boundaries and generated stubs."""

from __future__ import annotations

import filecmp
import pkgutil
import subprocess
import sys
from pathlib import Path

import scheduler_svc
from common import protogen

REPO = Path(__file__).resolve().parent.parent


def test_scheduler_service_imports_no_torch_or_triton() -> None:
    modules = [m.name for m in pkgutil.walk_packages(scheduler_svc.__path__, "scheduler_svc.")]
    assert "scheduler_svc.engine.engine" in modules and "scheduler_svc.api.server" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "import llmserve.cli, common.config, common.plan, common.model_spec\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "", f"scheduler side imported: {out.stdout.strip()}"


def test_kernels_is_this_repositorys_package() -> None:
    # An unrelated PyPI package is also called `kernels`; ours must win, from any directory.
    out = subprocess.run(
        [sys.executable, "-c", "import kernels; print(kernels.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    assert Path(out.stdout.strip()).resolve() == (REPO / "kernels" / "__init__.py").resolve()


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    protogen.generate(tmp_path)
    committed = REPO / "common" / "pb"
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert fresh == sorted(
        p.relative_to(committed) for p in committed.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, committed / p, shallow=False)]
    assert not stale, f"stubs out of date, run `make protos`: {stale}"


def test_common_imports_no_service_and_no_launcher() -> None:
    """common/ holds the contracts both services share; what starts or drives them (CLI,
    supervisor, rank launcher, model preparation, clients, the offline LLM) is in llmserve/."""
    import common

    modules = sorted(m.name for m in pkgutil.walk_packages(common.__path__, "common.") if ".pb" not in m.name)
    assert "common.config" in modules and "common.plan" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('scheduler_svc', 'worker_svc', 'kernels', 'llmserve', 'torch', 'triton'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "", f"common imported: {out.stdout.strip()}"


def test_the_public_package_loads_lazily() -> None:
    code = "import sys, llmserve; print(','.join(m for m in sys.modules if m.split('.')[0] in ('grpc', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == ""
    from llmserve import LlmserveClient
    from llmserve.client import LlmserveClient as direct

    assert LlmserveClient is direct


def test_every_module_has_a_line_in_the_design_document() -> None:
    design = (REPO / "docs" / "design.md").read_text()
    missing = []
    for package in ("common", "llmserve", "scheduler_svc", "worker_svc", "kernels"):
        for path in sorted((REPO / package).rglob("*.py")):
            generated = "pb" in path.relative_to(REPO).parts  # protobuf stubs
            if path.name != "__init__.py" and not generated and f"`{path.name}`" not in design:
                missing.append(f"{package}/{path.name}")
    assert not missing, f"modules missing from docs/design.md section 4: {missing}"


def test_nothing_points_outside_the_repository() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    # Spelled in two pieces so that this file does not match itself.
    outside = ("../" + "shared", "DESIGN" + ".md")
    pointing = []
    for name in tracked:
        path = REPO / name
        if path.suffix in (".py", ".md", ".yaml", ".toml", ".sh") or path.name in ("Makefile", "Dockerfile"):
            text = path.read_text(errors="replace")
            if any(marker in text for marker in outside):
                pointing.append(name)
    assert not pointing, pointing
