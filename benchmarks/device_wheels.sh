#!/usr/bin/env bash
# Wheels a GPU machine without network access may lack (an image with torch, triton, transformers, grpcio,
# protobuf and safetensors, but not our pinned grpc/protobuf, structlog or the test plugins),
# downloaded here for CPython 3.12 / x86-64 into .whl/ (git-ignored through .git/info/exclude).
#
#   bash benchmarks/device_wheels.sh
#   then, on the device (the `run` tool with carry [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH \
#       && python3 benchmarks/gpu_check.py --out "$OUT/gpu_check.json"
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl
for spec in grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
            structlog==26.1.0 prometheus-client==0.26.0 \
            pytest==9.2.0 pluggy==1.6.0 iniconfig==2.3.0 packaging==25.0 pygments==2.19.2 \
            pytest-asyncio==1.5.0 pytest-timeout==2.4.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$spec"
done
du -sh .whl
