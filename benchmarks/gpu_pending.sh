#!/usr/bin/env bash
# The GPU measurements still owed (docs/BENCHMARKS.md, "Not yet measured on a GPU"), as sections
# sized to fit one device call each (<= ~9 min). Run from the repository root on the H200:
#
#   benchmarks/gpu_pending.sh OUTDIR SECTION...      SECTION: tests moe rank mtp policy
#
# Each section writes its logs and JSON under OUTDIR and prints a short summary; a section that
# runs past its time limit is stopped and the next one starts. sgl-flash-mla is used when
# importable (`pip install --no-deps sgl-flash-mla`).
set -u
out=${1:?usage: benchmarks/gpu_pending.sh OUTDIR SECTION...}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
t0=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

run() {   # run NAME LIMIT_S CMD...: log to OUTDIR/NAME.log, print its last lines
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  elapsed "$name rc=$rc"
  tail -n 12 "$out/$name.log"
}

for section in "$@"; do
  case $section in
    tests)   # what changed after the last GPU call of 2026-11-29: auto KV dtype and score
             # hot-policy defaults, the decode GEMM's split count, spec-graph memory reserve
      GPU_TEST_TIMEOUT=200 HISPARSE_TRITON_AUTOTUNE=0 .ci/gpu_tests.sh "$out/tests" \
        tests/ops/test_ops_gemm.py tests/engine/test_engine_gpu.py \
        tests/engine/test_hot_policy.py tests/engine/test_spec_gpu.py \
        tests/models/test_models_moe_gpu.py ;;
    moe)     # issue 12: decode GEMM (one program per SM) vs the tile kernel, M = 1..256
      run moe 300 python3 benchmarks/bench_moe.py --out "$out/bench_moe.json" ;;
    rank)    # issue 12: one real TP-8 rank of DeepSeek-V3.2 with FP8 KV, the largest pool
      run rank 540 python3 -m hisparse.cli bench --model-shape deepseek-v3.2-tp8-rank \
        --kv-cache-dtype fp8 --topk synthetic:0.8 --contexts 32768,65536 \
        --concurrency 8,max --outputs 32 --host-pool-gib 96 --out "$out/rank" ;;
    mtp)     # issue 14: MTP decode at injected acceptance, production geometry, CUDA graphs
      run mtp 480 python3 benchmarks/bench_mtp.py --geometry production --layers 4 \
        --context 16384 --requests 16 --ks 1,2 --accepts 0.7,1.0 --out "$out/mtp.json" ;;
    policy)  # issue 15: step time at the trace's hit rate (its top-k and band) vs every row
             # hitting; the trace is git-ignored (benchmarks/record_trace.py
             # .bench_data/trace_essays_s128.npz --docs 4 --doc-len 8192 --steps 128); its
             # 8 tiles of 8192 positions need a 64k context
      run policy 420 python3 -m hisparse.cli bench --profile tp8-rank --contexts 65536 \
        --concurrency 64 --modes always-host --topk trace:.bench_data/trace_essays_s128.npz \
        --hot-policies lru,score,score+prefetch --locality synthetic:1.0 --host-pool-gib 32 \
        --out "$out/policy" ;;
    *) echo "unknown section $section (tests moe rank mtp policy)"; exit 2 ;;
  esac
done
