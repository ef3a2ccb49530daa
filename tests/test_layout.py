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
    modules = [f"scheduler_svc.{m.name}" for m in pkgutil.iter_modules(scheduler_svc.__path__)]
    assert "scheduler_svc.engine" in modules and "scheduler_svc.server" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "import common.cli, common.config, common.plan, common.model_spec\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "", f"scheduler side imported: {out.stdout.strip()}"


def test_kernels_is_this_repositorys_package() -> None:
    # An unrelated PyPI package is also called `kernels`; ours must win, from any directory.
    out = subprocess.run(
        [sys.executable, "-c", "import kernels; print(kernels.__file__)"], capture_output=True, text=True, check=True, cwd="/"
    )
    assert Path(out.stdout.strip()).resolve() == (REPO / "kernels" / "__init__.py").resolve()


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    protogen.generate(tmp_path)
    committed = REPO / "common" / "pb"
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert fresh == sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, committed / p, shallow=False)]
    assert not stale, f"stubs out of date, run `make protos`: {stale}"
