#!/usr/bin/env bash
# Creates, once, the virtual environment of the real TGIS client stack used by
# tests/test_tgis.py: caikit-tgis-backend needs protobuf < 7 (ours is 7), hence its own venv,
# and importing it needs fastapi. The pins are written to a marker file; a venv whose marker
# differs (other pins, other Python) is rebuilt. Concurrent callers wait on a lock.
#
#   tests/tgis_client/setup_venv.sh VENV_DIR [PYTHON]     (prints VENV_DIR when ready)
set -euo pipefail

VENV=${1:?usage: setup_venv.sh VENV_DIR [PYTHON]}
PYTHON=${2:-python3}
PINS="caikit-tgis-backend==0.1.39 caikit==0.28.3 fastapi==0.165.0 protobuf==6.33.6 grpcio==1.85.3"
STAMP="$PINS python=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
MARKER="$VENV/.llmserve-tgis-pins"

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$STAMP" ]; then
    echo "$VENV"
    exit 0
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# shellcheck disable=SC2086  # PINS is a word list on purpose
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $PINS
"$VENV/bin/python" -c "import caikit_tgis_backend.tgis_connection, google.protobuf; print('protobuf', google.protobuf.__version__)"
echo "$STAMP" >"$MARKER"
echo "$VENV"
