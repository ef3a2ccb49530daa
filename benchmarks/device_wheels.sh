#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on a GPU machine without network access, for
# CPython 3.12 / x86-64, downloaded into .whl/ (git-ignored through .git/info/exclude); about
# 25 MB, which with the working tree (~3 MB) stays inside the 64 MiB a device call carries.
#
# The device image (seen 2026-11: Python 3.12, torch 2.11, triton 3.6, transformers 5.17,
# grpcio, protobuf, pytest, pytest-timeout, numpy, tokenizers, safetensors, accelerate) lacks:
#   grpcio 1.85 + protobuf 7        the committed stubs (common/pb/) need them, not the image's
#   grpcio-health-checking/-reflection, structlog, prometheus-client   the services
#   smg-grpc-proto                  the scheduler serves smg's engine protocol (tensor_parallel)
#   transformers 5.24 + regex       the pinned reference for the parity sections (5.24 checks
#                                   regex >= 2025.10 at import)
#   pytest 9.2, pytest-asyncio, pytest-timeout 2.4 (--session-timeout), pluggy, iniconfig,
#   packaging, pygments             the kernel tests
# SmolLM2 (260 MB) cannot travel: parity_smollm2 is skipped there unless --model-dir names a
# copy on the machine (docs/benchmarks.md, the GPU check).
#
#   bash benchmarks/device_wheels.sh
#   then, on the device (the `run` tool with carry [".whl"], timeout_s 600):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \
#       && python3 benchmarks/gpu_check.py --budget-s 480 --out "$OUT/gpu_check.json"
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # .git may be a file (a worktree)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl
for spec in grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
            structlog==26.1.0 prometheus-client==0.26.0 smg-grpc-proto==0.4.28 \
            transformers==5.24.0 regex==2026.11.19 \
            pytest==9.2.0 pluggy==1.6.0 iniconfig==2.3.0 packaging==25.0 pygments==2.19.2 \
            pytest-asyncio==1.5.0 pytest-timeout==2.4.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$spec"
done
du -sh .whl
