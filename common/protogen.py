"""Generate the Python gRPC stubs in `common/pb/` from `protos/`.

The stubs are committed, so an install needs no grpcio-tools; `tests/test_layout.py`
regenerates them into a temporary folder and fails when the committed ones are stale.
Run: `python -m common.protogen` (or `make protos`).

protoc names imports after the proto path (`from llmserve.v1 import ...`); they are rewritten
to live under `common.pb`, so no top-level `llmserve` package is needed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
OUT = REPO / "common" / "pb"

_IMPORT = re.compile(r"^from (llmserve\.v1|fmaas) import ", re.MULTILINE)  # fmaas: the TGIS API


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("**/*.proto"))


def generate(out: Path = OUT) -> list[Path]:
    """Write stubs under `out`; returns the files written."""
    from grpc_tools import protoc  # only a dev dependency: imported here, not at module load

    out.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    written = []
    for path in sorted(out.rglob("*.py*")):
        text = _IMPORT.sub(r"from common.pb.\1 import ", path.read_text())
        path.write_text(text)
        written.append(path)
    for pkg in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text("")
            written.append(init)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
