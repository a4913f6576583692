#!/usr/bin/env bash
# Run the Triton kernel tests (tests/ops, CPU interpreter) with the oldest supported Triton
# (3.6.0, the H200 machine's version) and the newest one, each in its own small venv on top of
# the CPU torch that .ci/run installs. Usage (from .ci/run, after the main suite):
#     .ci/triton_matrix.sh            # versions: 3.6.0 and the newest on the index
#     TRITON_VERSIONS="3.6.0 3.9.0" .ci/triton_matrix.sh
# Venvs are kept under $TRITON_MATRIX_DIR (default /tmp/hisparse-triton-matrix) and reused.
# Only tests/ops run here (~10 s per version): the rest of the suite does not depend on Triton.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
TORCH=${TORCH_VERSION:-2.13.0}
VERSIONS=${TRITON_VERSIONS:-"3.6.0 newest"}
status=0
for v in $VERSIONS; do
    venv="${TRITON_MATRIX_DIR:-${TMPDIR:-/tmp}/hisparse-triton-matrix}/$v"
    if [ ! -x "$venv/bin/python" ]; then
        "$PY" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
        "$venv/bin/python" -m pip install -q "torch==$TORCH" "numpy>=2" pytest hypothesis
        if [ "$v" = newest ]; then
            "$venv/bin/python" -m pip install -q --upgrade --no-deps triton
        else
            "$venv/bin/python" -m pip install -q --no-deps "triton==$v"
        fi
    fi
    got=$("$venv/bin/python" -c "import triton; print(triton.__version__)")
    echo "== tests/ops under TRITON_INTERPRET=1 with triton $got"
    if ! TRITON_INTERPRET=1 PYTHONPATH="$ROOT" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
            -m "not gpu" tests/ops; then
        echo "FAILED with triton $got" >&2
        status=1
    fi
done
exit $status
