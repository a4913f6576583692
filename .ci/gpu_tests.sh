#!/usr/bin/env bash
# Run the GPU-marked tests on a CUDA machine, one pytest process per file (a device fault
# aborts only its own file), and print one summary line per file.
# Usage: .ci/gpu_tests.sh [LOGDIR] [FILE...]   (default: every file with GPU tests)
set -u
logdir=${1:-/tmp/gpu_tests}; shift || true
mkdir -p "$logdir"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD HISPARSE_TRITON_AUTOTUNE=${HISPARSE_TRITON_AUTOTUNE:-0}
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  mapfile -t files < <(grep -rlE "mark\.gpu|pytestmark = pytest\.mark\.gpu" tests | sort)
fi
for f in "${files[@]}"; do
  name=$(basename "$f" .py)
  start=$(date +%s)
  timeout "${GPU_TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider "$f" \
    >"$logdir/$name.log" 2>&1
  rc=$?
  printf '%-28s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - start ))" \
    "$(grep -E '(passed|failed|error|skipped|no tests ran)' "$logdir/$name.log" | tail -1)"
done
