#!/usr/bin/env bash
# The GPU measurements still owed (docs/BENCHMARKS.md, "Not yet measured on a GPU"), as sections
# sized to fit one device call each (<= ~9 min). Run from the repository root on the H200:
#
#   benchmarks/gpu_pending.sh OUTDIR SECTION...      SECTION: tests policy staged mtp moe fp8 rank
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
    tests)   # side-stream prefetch (incl. the delayed-copy join test), FP8 and graph engine tests
      GPU_TEST_TIMEOUT=240 HISPARSE_TRITON_AUTOTUNE=0 .ci/gpu_tests.sh "$out/tests" \
        tests/ops/test_ops_resolve.py tests/engine/test_hot_policy.py \
        tests/engine/test_engine_gpu.py ;;
    policy)  # issue 15: step time at the trace's hit rate (its top-k and band) vs every row
             # hitting; the trace is git-ignored (benchmarks/record_trace.py
             # .bench_data/trace_essays_s128.npz --docs 4 --doc-len 8192 --steps 128); its
             # 8 tiles of 8192 positions need a 64k context
      run policy 420 python3 -m hisparse.cli bench --profile tp8-rank --contexts 65536 \
        --concurrency 64 --modes always-host --topk trace:.bench_data/trace_essays_s128.npz \
        --hot-policies lru,score,score+prefetch --locality synthetic:1.0 --host-pool-gib 32 \
        --out "$out/policy" ;;
    staged)  # issue 14: 128k prefill under a quarter of the prompt, whole-history staging
      run staged 480 python3 benchmarks/bench_staged_prefill.py --context 131072 \
        --no-track-blocks --out "$out/staged_prefill.json" ;;
    mtp)     # issue 14: MTP decode at injected acceptance
      run mtp 480 python3 benchmarks/bench_mtp.py --geometry production --layers 4 \
        --context 16384 --requests 16 --ks 1,2 --accepts 0.7,1.0 --out "$out/mtp.json" ;;
    moe)     # issue 12: fused MoE layer vs touched-expert bytes; FP8 GEMM with 64-row tiles
      run moe 480 python3 benchmarks/bench_moe.py --out "$out/bench_moe.json" ;;
    fp8)     # issue 11: FP8 KV vs bf16 at the same GPU bytes
      run fp8 420 python3 -m hisparse.cli bench --profile tp8-rank --gpu-kv-gib 2.96 \
        --kv-cache-dtype fp8 --contexts 32768,65536 --concurrency max --outputs 128 \
        --host-pool-gib 32 --out "$out/fp8" ;;
    rank)    # issue 12: one real TP-8 rank of DeepSeek-V3.2 (61 layers, FP8 weights)
      run rank 540 python3 -m hisparse.cli bench --model-shape deepseek-v3.2-tp8-rank \
        --contexts 32768,65536 --concurrency 8,max --outputs 64 --host-pool-gib 64 \
        --out "$out/rank" ;;
    *) echo "unknown section $section (tests policy staged mtp moe fp8 rank)"; exit 2 ;;
  esac
done
