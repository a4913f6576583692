#!/usr/bin/env bash
# The Triton kernel tests (tests/ops, CPU interpreter) with the oldest Triton we support (3.6.0:
# the H200 machine's version). The main suite already ran them with the newest Triton (the one
# `pip install -e ".[test]"` resolves); here the 3.6.0 wheel is installed into its own target
# directory and put first on PYTHONPATH, so the rest of the environment (torch, numpy) is the
# CI venv's own. Variants marked ``newest_triton_only`` run with the newest only (the same
# kernel paths run here in other cases: another size, policy or launch), and the two files that
# run no kernel (the switch parser, the import layering) do not run here. Usage, from .ci/run
# with the venv active:
#     .ci/triton_matrix.sh                      # versions: 3.6.0
#     TRITON_VERSIONS="3.6.0 3.7.1" .ci/triton_matrix.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python}
VERSIONS=${TRITON_VERSIONS:-"3.6.0"}
status=0
for v in $VERSIONS; do
    target="${TRITON_MATRIX_DIR:-${TMPDIR:-/tmp}/hisparse-triton-matrix}/$v"
    if [ ! -d "$target/triton" ]; then
        # numpy < 2.4 beside it: triton 3.6's interpreter converts one-element arrays to
        # Python ints (a loop bound given as an argument), which numpy 2.4 refuses
        "$PY" -m pip install -q --no-compile --no-deps --target "$target" "triton==$v" "numpy<2.4"
    fi
    got=$(PYTHONPATH="$target" "$PY" -c "import triton; print(triton.__version__)")
    echo "== tests/ops under TRITON_INTERPRET=1 with triton $got"
    if ! TRITON_INTERPRET=1 PYTHONPATH="$target:$ROOT" "$PY" -m pytest -q -p no:cacheprovider \
            -m "not gpu and not newest_triton_only" -n 2 tests/ops \
            --ignore tests/ops/test_ops_switches.py --ignore tests/ops/test_ops_layering.py; then
        echo "FAILED with triton $got" >&2
        status=1
    fi
done
exit $status
