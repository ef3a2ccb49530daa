"""The GPU check's command: `python benchmarks/gpu_check.py --help` (the code: benchmarks/gpu_check/)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
# The repository for the engine's packages; benchmarks/ for the package `gpu_check`, which a
# directory of that name provides (Python prefers a package directory to this file's name).
for path in (str(BENCHMARKS.parent), str(BENCHMARKS)):
    if path not in sys.path:
        sys.path.insert(0, path)

from gpu_check.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
