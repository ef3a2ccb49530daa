"""Print the project's runtime requirements from pyproject.toml, one per line, for `pip install -r`.

The Dockerfile installs the dependencies in a layer of their own (so that editing the source
does not reinstall torch) and the scheduler image leaves out what only the worker imports:

    python deploy/requirements.py --exclude torch triton transformers safetensors > req.txt
    python deploy/requirements.py --extra prepare > req.txt

Only the standard library is used: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def requirement_name(requirement: str) -> str:
    """The normalized distribution name of a PEP 508 requirement ("Foo_bar[x]>=1" -> "foo-bar")."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path, extras: list[str], exclude: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise ValueError(f"no such extra in {pyproject}: {', '.join(unknown)}")
    selected = list(project["dependencies"]) + [r for extra in extras for r in optional[extra]]
    dropped = {requirement_name(name) for name in exclude}
    missing = dropped - {requirement_name(r) for r in selected}
    if missing:
        # A stale exclusion list would otherwise go unnoticed.
        raise ValueError(f"--exclude names no requirement: {', '.join(sorted(missing))}")
    return [r for r in selected if requirement_name(r) not in dropped]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parent.parent / "pyproject.toml")
    parser.add_argument("--extra", action="append", default=[], help="also the requirements of this extra")
    parser.add_argument("--exclude", nargs="*", default=[], help="distribution names to leave out")
    args = parser.parse_args(argv)
    try:
        lines = requirements(args.pyproject, args.extra, args.exclude)
    except ValueError as error:
        print(f"requirements.py: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
