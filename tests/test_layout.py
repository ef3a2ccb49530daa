"""Contracts of the repository layout (docs/design.md sections 2 to 4): layers, import
boundaries, module sizes, the design document's module list and the generated stubs.

The layer checks read imports from the source with `ast` (every `import` in a module: at the
top, under `if TYPE_CHECKING:` and inside functions, since each is a dependency the layering
must allow), and are small pure functions over a root directory, so that the tests at the end
can plant each kind of violation in a synthetic tree and see it reported."""

from __future__ import annotations

import ast
import filecmp
import pkgutil
import re
import subprocess
import sys
from collections import deque
from pathlib import Path

import scheduler_svc
from common import protogen

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "llmserve", "scheduler_svc", "worker_svc", "kernels")
SERVICES = ("scheduler_svc", "worker_svc")  # split into units one subpackage each

# Which units each unit may import, besides itself: imports go down the layers of
# docs/design.md section 4, never up or sideways. A bare name is a subpackage of the same
# service. A new subpackage needs a row here.
LAYERS = {
    "common": "",
    "kernels": "common",
    "scheduler_svc": "",  # the service package's __init__: its docstring only
    "scheduler_svc.kv": "common",
    "scheduler_svc.text": "common",
    "scheduler_svc.lora": "common",
    "scheduler_svc.workers": "common",
    "scheduler_svc.sched": "common kv lora text",
    "scheduler_svc.engine": "common sched kv lora text workers",
    "scheduler_svc.api": "common engine sched kv lora text workers",
    "worker_svc": "",  # the service package's __init__: its docstring only
    "worker_svc.device": "common",
    "worker_svc.layers": "common kernels device",
    "worker_svc.models": "common kernels device layers",
    "worker_svc.lora": "common kernels device layers",
    "worker_svc.sampling": "common kernels device",
    "worker_svc.step": "common kernels device layers models lora sampling",
    "worker_svc.service": "common kernels device layers models lora sampling step",
}
ALLOWED = {
    unit: {name if name in PACKAGES else f"{unit.partition('.')[0]}.{name}" for name in below.split()}
    for unit, below in LAYERS.items()
}
ALLOWED["llmserve"] = set(ALLOWED)  # the composition root; nothing imports it

# The scheduler core and KV accounting are pure and synchronous (section 3, item 2).
PURE_UNITS = ("scheduler_svc.sched", "scheduler_svc.kv")
IMPURE = ("asyncio", "grpc", "structlog", "time", "threading")

# Modules allowed past MAX_LINES, each with the reason. Empty: split a long module instead.
MAX_LINES = 400
LONG_MODULES: dict[str, str] = {}


def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every hand-written module under `root`'s packages by dotted name (common/pb is generated)."""
    files: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            if rel.parts[:2] == ("common", "pb") or "__pycache__" in rel.parts:
                continue
            parts = rel.with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _resolve(name: str, files: dict[str, Path]) -> str:
    """The module that `name` lives in (a name imported from a package resolves to the package,
    common.pb's stubs to `common`); a name outside the packages stays as written."""
    candidate = name
    while candidate and candidate not in files:
        candidate = candidate.rpartition(".")[0]
    return candidate or name


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> what it imports anywhere in its source: our modules by name (`from pkg import
    name` is the module `pkg.name` when that is one), anything else by its dotted name."""
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    above = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(above + ([node.module] if node.module else []))
                names += [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
        graph[module] = {_resolve(name, files) for name in names} - {module}
    return graph


def unit_of(module: str) -> str:
    """A service's modules belong to its subpackage; any other package is one unit."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in SERVICES else parts[0]


def layer_violations(graph: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    """Imports the table does not allow, and modules in no unit of the table. A layer that
    imports a layer above it cannot be tested, replaced or reasoned about below that layer."""
    found = []
    for module in sorted(graph):
        unit = unit_of(module)
        if unit not in allowed:
            found.append(f"{module}: unit {unit} has no row in LAYERS")
            continue
        for target in sorted(t for t in graph[module] if t in graph):
            if unit_of(target) not in allowed[unit] | {unit}:
                found.append(f"{module} imports {target} ({unit} -> {unit_of(target)})")
    return found


def _shortest_cycle(start: str, edges: dict[str, list[str]]) -> list[str]:
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        for there in edges[here]:
            if there == start:
                path = [here]
                while (up := parent[path[-1]]) is not None:
                    path.append(up)
                return [*reversed(path), start]
            if there not in parent:
                parent[there] = here
                queue.append(there)
    raise ValueError(f"{start} is on no cycle")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle, modules in import order, per group of mutually importing modules.
    Modules that import each other can only be understood, tested and split together, and
    work at run time only by the accident of which one is imported first."""
    edges = {m: sorted(t for t in targets if t in graph) for m, targets in graph.items()}
    reach: dict[str, set[str]] = {}
    for module in edges:
        seen: set[str] = set()
        todo = list(edges[module])
        while todo:
            if (here := todo.pop()) not in seen:
                seen.add(here)
                todo += edges[here]
        reach[module] = seen
    cycles, grouped = [], set()
    for module in sorted(edges):
        if module in reach[module] and module not in grouped:
            grouped |= {m for m in reach[module] if module in reach[m]}
            cycles.append(_shortest_cycle(module, edges))
    return cycles


def impure_imports(graph: dict[str, set[str]]) -> list[str]:
    """Direct imports of I/O, clock, threads or logging by the pure units: the scheduler core
    is `schedule() -> StepPlan` and `update(plan, result)`, so that tests drive it step by step
    with no event loop, no sleeps and exact results; the engine loop does the I/O."""
    return [
        f"{module} imports {target}"
        for module in sorted(graph)
        if unit_of(module) in PURE_UNITS
        for target in sorted(graph[module])
        if target.split(".")[0] in IMPURE
    ]


def long_modules(files: dict[str, Path], root: Path, exempt: dict[str, str]) -> list[str]:
    """Modules over MAX_LINES lines not named in `exempt` (section 3, item 1: one noun per file):
    a long module owns more than one thing, and its parts cannot be read or tested apart."""
    found = []
    for path in files.values():
        lines = len(path.read_text().splitlines())
        rel = path.relative_to(root).as_posix()
        if lines > MAX_LINES and rel not in exempt:
            found.append(f"{rel}: {lines} lines")
    return sorted(found)


def documented_paths(design: str) -> set[str]:
    """The module paths section 4 describes: a `### `dir/`` heading, then `- `file.py`: ...` lines."""
    section = re.search(r"^## 4\..*?(?=^## |\Z)", design, re.M | re.S)
    heading, paths = "", set()
    for line in section[0].splitlines() if section else ():
        if match := re.match(r"### `([\w/]+/)`", line):
            heading = match[1]
        elif line.startswith("- "):
            paths |= {heading + name for name in re.findall(r"`([\w/]+\.py)`", line.split(":", 1)[0])}
    return paths


def design_gaps(files: dict[str, Path], root: Path, design: str) -> list[str]:
    """Modules without their line in section 4, and lines for modules that are gone. Paths are
    matched whole, so two `wire.py` or two `lora/` packages cannot stand in for each other."""
    modules = {p.relative_to(root).as_posix() for p in files.values() if p.name != "__init__.py"}
    documented = documented_paths(design)
    return [f"no line: {p}" for p in sorted(modules - documented)] + [
        f"line for a missing module: {p}" for p in sorted(documented - modules)
    ]


def _listing(title: str, items: list[str]) -> str:
    return f"{title}:\n  " + "\n  ".join(items)


def test_imports_follow_the_layers() -> None:
    graph = import_graph(module_files(REPO))
    assert "common.plan" in graph["scheduler_svc.sched.plan_builder"]  # the graph is read
    assert all(below <= ALLOWED.keys() for below in ALLOWED.values()), "LAYERS names an unknown unit"
    found = layer_violations(graph, ALLOWED)
    assert not found, _listing("imports against the layers (docs/design.md section 4)", found)


def test_no_module_imports_itself_through_others() -> None:
    found = [" -> ".join(cycle) for cycle in import_cycles(import_graph(module_files(REPO)))]
    assert not found, _listing("import cycles", found)


def test_scheduler_core_and_kv_do_no_io() -> None:
    found = impure_imports(import_graph(module_files(REPO)))
    assert not found, _listing(f"the pure units import one of {IMPURE}", found)


def test_no_module_is_too_long() -> None:
    found = long_modules(module_files(REPO), REPO, LONG_MODULES)
    assert not found, _listing(f"over {MAX_LINES} lines, to be split (or named in LONG_MODULES)", found)


def test_every_module_has_a_line_in_the_design_document() -> None:
    found = design_gaps(module_files(REPO), REPO, (REPO / "docs" / "design.md").read_text())
    assert not found, _listing("docs/design.md section 4 out of step with the tree", found)


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
    supervisor, rank launcher, model preparation, clients, the offline LLM) is in llmserve/.
    The graph test sees the source; this one sees what importing common really loads."""
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


# The checks can fail: each kind of violation planted in a synthetic tree is reported.


def _plant(root: Path, sources: dict[str, str]) -> dict[str, set[str]]:
    for rel, source in sources.items():
        path = root / rel
        for folder in [path.parent, *path.parent.parents]:
            if folder == root:
                break
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "__init__.py").touch()
        path.write_text(source)
    return import_graph(module_files(root))


def test_an_upward_import_and_a_unit_without_a_row_are_reported(tmp_path: Path) -> None:
    graph = _plant(
        tmp_path,
        {
            "scheduler_svc/sched/scheduler.py": "from scheduler_svc.kv import block_pool\n",
            "scheduler_svc/kv/block_pool.py": "def f():\n    from scheduler_svc.sched.scheduler import Scheduler\n",
            "scheduler_svc/cache/lru.py": "import common\n",
        },
    )
    assert layer_violations(graph, ALLOWED) == [
        "scheduler_svc.cache: unit scheduler_svc.cache has no row in LAYERS",
        "scheduler_svc.cache.lru: unit scheduler_svc.cache has no row in LAYERS",
        "scheduler_svc.kv.block_pool imports scheduler_svc.sched.scheduler (scheduler_svc.kv -> scheduler_svc.sched)",
    ]


def test_an_import_cycle_is_reported_in_order(tmp_path: Path) -> None:
    graph = _plant(
        tmp_path,
        {
            "scheduler_svc/sched/a.py": "from scheduler_svc.sched import b\n",
            "scheduler_svc/sched/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from scheduler_svc.sched.a import A\n"
            ),
            "scheduler_svc/sched/c.py": "from . import a\n",
        },
    )
    assert import_cycles(graph) == [["scheduler_svc.sched.a", "scheduler_svc.sched.b", "scheduler_svc.sched.a"]]


def test_a_long_module_is_reported_unless_exempt(tmp_path: Path) -> None:
    _plant(tmp_path, {"scheduler_svc/sched/big.py": "x = 1\n" * 450})
    files = module_files(tmp_path)
    assert long_modules(files, tmp_path, {}) == ["scheduler_svc/sched/big.py: 450 lines"]
    assert long_modules(files, tmp_path, {"scheduler_svc/sched/big.py": "a reason"}) == []


def test_the_clock_in_the_scheduler_core_is_reported(tmp_path: Path) -> None:
    graph = _plant(
        tmp_path,
        {
            "scheduler_svc/sched/step_planner.py": "def now():\n    import time\n    return time.monotonic()\n",
            "scheduler_svc/kv/block_pool.py": "from threading import Lock\n",
            "scheduler_svc/engine/engine.py": "import asyncio\n",
        },
    )
    assert impure_imports(graph) == [
        "scheduler_svc.kv.block_pool imports threading",
        "scheduler_svc.sched.step_planner imports time",
    ]


def test_a_module_is_matched_by_its_whole_path(tmp_path: Path) -> None:
    _plant(tmp_path, {"scheduler_svc/api/wire.py": "", "worker_svc/service/wire.py": ""})
    design = "## 4. Modules\n\n### `worker_svc/service/`\n- `wire.py`, `gone.py`: the worker's edge.\n## 5. End\n"
    assert design_gaps(module_files(tmp_path), tmp_path, design) == [
        "no line: scheduler_svc/api/wire.py",
        "line for a missing module: worker_svc/service/gone.py",
    ]
