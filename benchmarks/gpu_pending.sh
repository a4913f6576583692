#!/usr/bin/env bash
# The GPU measurements still owed (docs/BENCHMARKS.md, "Not yet measured on a GPU"), as sections
# sized to fit one device call each (<= ~9 min). Run from the repository root on the H200:
#
#   benchmarks/gpu_pending.sh OUTDIR SECTION...
#   SECTION: tests owed resolver attnprobe attnncu rankmax fused buckets step order convert topk plans
#            cut36 hostpool policies merge short narrow narrow32k eff topkstore
#            moe rank glm gemm pinned disagg nixl kernels serve
#
# Each section writes its logs and JSON under OUTDIR and prints a short summary; a section that
# runs past its time limit is stopped and the next one starts. sgl-flash-mla is used when
# importable (`pip install --no-deps sgl-flash-mla`).
set -u
out=${1:?usage: benchmarks/gpu_pending.sh OUTDIR SECTION...}; shift
mkdir -p "$out"
out=$(cd "$out" && pwd)   # absolute: sections run some commands from another tree
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

rank2k() {   # rank2k NAME: the V3.2 rank GPU-only at 2k x 96 (256 outputs, kernel profile), under
             # the caller's environment (~2 min, H200: the rank needs ~90 GB)
  run "$1" 150 python3 -m hisparse.cli bench --model-shape deepseek-v3.2-tp8-rank \
    --kv-cache-dtype fp8 --topk synthetic:0.8 --modes gpu-only --host-pool-gib 1 \
    --profile-kernels 5 --contexts 2048 --concurrency 96 --outputs 256 --out "$out/$1"
}

skip_or_test() {   # a section's own GPU tests (GPU_TEST_FILES), unless SKIP_TESTS=1: `owed` ran them
  if [ "${SKIP_TESTS:-0}" = 1 ]; then elapsed "tests skipped (SKIP_TESTS=1)"
  else bash "$0" "$out" tests; fi
}

for section in "$@"; do
  case $section in
    owed)    # the GPU tests of the GPU-path changes not yet run on an H200, in one pass (~3
             # min): the engine, graphs, disaggregation and capacity tests, the bf16 router
             # and weights_proj (thirty-second session), the norms' FP8 rows (thirty-third);
             # they passed on an H100 in the thirty-third session (0c57488, 10b0ddb:
             # docs/GPU_TESTS.md), but for test_disagg_gpu (nixl not carried) and all of
             # test_models_fused_sums but its norm-rows test; then the sections, SKIP_TESTS=1
      GPU_TEST_FILES="tests/engine/test_engine_gpu.py tests/worker/test_cuda_graph_gpu.py
        tests/engine/test_disagg_gpu.py tests/engine/test_capacity.py
        tests/ops/test_ops_moe_layer.py tests/ops/test_ops_fp32_linear.py
        tests/models/test_models_moe_gpu.py tests/ops/test_ops_norm_fp8.py
        tests/models/test_models_fused_sums.py" \
        bash "$0" "$out" tests ;;
    tests)   # the whole GPU suite, every file its own process, in 4 shards side by side on
             # the one GPU (~4 min; docs/GPU_TESTS.md); xgrammar, pydantic, nixl-cu13 carried
      # GPU_TEST_FILES="a.py b.py": only those files
      mapfile -t files < <(if [ -n "${GPU_TEST_FILES:-}" ]; then printf '%s\n' $GPU_TEST_FILES
                           else grep -rlE "mark\.gpu|pytestmark = pytest\.mark\.gpu" tests | sort; fi)
      for shard in 0 1 2 3; do
        mine=(); for i in "${!files[@]}"; do (( i % 4 == shard )) && mine+=("${files[$i]}"); done
        # an empty shard would run gpu_tests.sh without files, i.e. every file
        (( ${#mine[@]} )) || { : >"$out/shard$shard.txt"; continue; }
        GPU_TEST_TIMEOUT=300 .ci/gpu_tests.sh "$out/tests" "${mine[@]}" >"$out/shard$shard.txt" &
      done
      wait; cat "$out"/shard?.txt; elapsed tests
      # the device returns few files: failed logs' tails in one file, every log in one archive
      for f in "$out"/tests/*.log; do
        grep -qE "[0-9]+ (failed|error)" "$f" && { echo "=== $f"; tail -n 80 "$f"; }
      done >"$out/tests_failed.txt"
      # shards share the GPU, and an engine sized from free memory (gpu_memory_utilization)
      # can starve another shard: a file that failed is run again alone
      mapfile -t again < <(grep -lE "[0-9]+ (failed|error)" "$out"/tests/*.log | xargs -r -n1 \
                           basename | sed 's/\.log$//')
      for name in "${again[@]}"; do
        f=$(printf '%s\n' "${files[@]}" | grep "/$name.py$")
        echo "alone: $(GPU_TEST_TIMEOUT=300 .ci/gpu_tests.sh "$out/tests_alone" "$f")"
      done
      [ -d "$out/tests_alone" ] && mv "$out/tests_alone" "$out/tests/alone"
      tar -czf "$out/tests_logs.tgz" -C "$out" tests && rm -r "$out/tests" "$out"/shard?.txt ;;
    rank)    # issues 24/25: one real TP-8 rank of DeepSeek-V3.2, FP8 KV, 512 outputs, the
             # kernel profile by class at every point (fused glue, radix top-k, memory split)
      run rank 560 python3 -m hisparse.cli bench --model-shape deepseek-v3.2-tp8-rank \
        --kv-cache-dtype fp8 --topk synthetic:0.8 --contexts 32768 --concurrency 8,24,max \
        --modes gpu-only,hisparse \
        --outputs 512 --host-pool-gib 64 --profile-kernels 5 --out "$out/rank" ;;
    fused)   # the eighth session's launch fusions (merged before any GPU run): their GPU tests
             # and those of the files they touch (~4 min), then their bits against the tree
             # before them when OLD names a directory holding `git archive cf89023 hisparse/ops`
             # unpacked as OLD/hisparse_old/ops (the device copy has no .git: carry a tarball)
      GPU_TEST_FILES="tests/ops/test_ops_indexer_fused.py tests/ops/test_ops_pending.py
        tests/models/test_models_fused_sums.py tests/ops/test_ops_glue.py
        tests/ops/test_ops_gemm_splitk.py tests/ops/test_ops_indexer.py
        tests/ops/test_ops_indexer_fp8.py tests/ops/test_ops_topk.py tests/ops/test_ops_moe_layer.py
        tests/models/test_models_stacked.py tests/engine/test_engine_gpu.py
        tests/worker/test_cuda_graph_gpu.py tests/engine/test_spec_gpu.py
        tests/models/test_models_moe_gpu.py" \
        bash "$0" "$out" tests
      if [ -n "${OLD:-}" ]; then
        run bits 240 python3 benchmarks/bits_vs_revision.py "$OLD"
      fi ;;
    buckets) # the tenth session's finer graph buckets and attention empty-chunk skip against
             # the tree before them (BASE: a directory holding `git archive e5a4684` unpacked;
             # the device copy has no .git), same call: GPU-only at its 32k maximum (33
             # requests: the 40-token graph now, 48 before) and 24 x 32k (~6 min)
      base=${BASE:?buckets: BASE=dir of git archive e5a4684}
      for tree in new base; do
        dir=$PWD; [ $tree = base ] && dir=$(cd "$base" && pwd)
        (
          cd "$dir" && export PYTHONPATH=$dir
          run buckets_$tree 300 python3 -m hisparse.cli bench \
            --model-shape deepseek-v3.2-tp8-rank --kv-cache-dtype fp8 --topk synthetic:0.8 \
            --modes gpu-only,hisparse --host-pool-gib 64 --profile-kernels 5 --contexts 32768 \
            --concurrency 24,max --outputs 128 --out "$out/buckets_$tree"
        )
      done ;;
    step)    # issue 25: the real rank's GPU step by kernel class, gpu-only, at the three points
             # the targets name (~4 min). For a same-run baseline run it again in a tree of the
             # base commit (git archive REV | tar x -C base; cd base; gpu_pending.sh OUT2 step)
      run step32k 200 python3 -m hisparse.cli bench --model-shape deepseek-v3.2-tp8-rank \
        --kv-cache-dtype fp8 --topk synthetic:0.8 --modes gpu-only --host-pool-gib 1 \
        --profile-kernels 5 --contexts 32768 --concurrency 8,24 --outputs 128 --out "$out/step32k"
      rank2k step2k ;;
    order)   # issues 24/25: the engine's selection in position order (no ranking pass;
             # twenty-second session) against score order, same call: the GPU tests of the
             # files it touches (~3 min), the top-k alone (ranked and column order beside
             # torch.topk, ~1 min), then the rank's step at 2k x 96 under
             # HISPARSE_TOPK_ORDER=ranked and positions (the default since the twenty-sixth
             # session; ~5 min; H200; LAYERS=36 on an H100)
      GPU_TEST_FILES="tests/ops/test_ops_topk.py tests/ops/test_ops_indexer.py
        tests/ops/test_ops_indexer_fp8.py tests/ops/test_ops_indexer_fused.py
        tests/engine/test_engine_gpu.py tests/worker/test_cuda_graph_gpu.py" skip_or_test
      run topk_order 200 python3 benchmarks/bench_topk.py --only topk \
        --topk-shapes 32768x8x2048,32768x24x2048,32768x48x2048,32768x64x2048,131072x8x2048,2304x96x2048,2112x96x2048 \
        --out "$out/topk_order.json"
      cut=()
      [ -n "${LAYERS:-}" ] && cut=(--layers "$LAYERS")
      for order in ranked positions; do
        HISPARSE_TOPK_ORDER=$order run "step2k_$order" 170 python3 -m hisparse.cli bench \
          --model-shape deepseek-v3.2-tp8-rank --kv-cache-dtype fp8 --topk synthetic:0.8 \
          --modes gpu-only --host-pool-gib 1 --profile-kernels 5 --contexts 2048 \
          --concurrency 96 --outputs 256 --out "$out/step2k_$order" "${cut[@]}"
      done ;;
    convert) # issue 25: the FP8 attention's integer e4m3 -> bf16 (HISPARSE_FP8_CONVERT=int,
             # fourteenth session, CPU-built): its GPU bits tests, the stages probe (isolated,
             # bits compared), then 2k x 96 on the rank without and with it (~6 min, H200)
      GPU_TEST_FILES="tests/ops/test_ops_attention_convert.py tests/ops/test_ops_quant.py" \
        skip_or_test
      run attn_stages 180 python3 benchmarks/probe_attention_stages.py \
        --out "$out/attn_stages.json"
      for cvt in native int; do HISPARSE_FP8_CONVERT=$cvt rank2k step2k_$cvt; done ;;
    topk)    # issue 24: the top-k's ratios against torch.topk on the H200 (the H100's at
             # de21877: docs/BENCHMARKS.md, twenty-ninth session), its GPU tests, its phase
             # probe, the launch over the engine's table width (the bench's 32k + 512 outputs
             # halfway through the decode, then a 163,840-column max_model_len) and the later
             # digits' sparse blocks against none (~9 min)
      shapes=32768x8x2048,32768x16x2048,32768x24x2048,32768x40x2048,32768x48x2048
      shapes=$shapes,32768x64x2048
      shapes=$shapes,131072x8x2048,32768x24x4096,2304x96x2048,2112x96x2048
      export HISPARSE_TRITON_AUTOTUNE=0
      run topk_new 150 python3 benchmarks/bench_topk.py --only topk --topk-shapes $shapes \
        --out "$out/topk_new.json"
      GPU_TEST_FILES="tests/ops/test_ops_topk.py" skip_or_test
      run topk_phases 90 python3 benchmarks/probe_topk_phases.py --out "$out/topk_phases.json"
      run topk_wide33k 150 python3 benchmarks/bench_topk.py --only wide --table-width 33280 \
        --row-extra 256 --topk-shapes 32768x8x2048,32768x24x2048,32768x32x2048,32768x64x2048 \
        --out "$out/topk_wide33k.json"
      run topk_wide160k 150 python3 benchmarks/bench_topk.py --only wide --table-width 163840 \
        --topk-shapes 32768x8x2048,32768x24x2048,32768x64x2048,131072x8x2048,131072x16x2048 \
        --out "$out/topk_wide160k.json"
      run topk_sparse 150 python3 benchmarks/bench_topk.py --only sparse --sparse 0,64 \
        --table-width 163840 --topk-shapes 32768x8x2048,32768x24x2048,131072x16x2048 \
        --out "$out/topk_sparse.json"
      unset HISPARSE_TRITON_AUTOTUNE ;;
    short)   # issues 24/25 (twenty-ninth session; first run on an H100 in the thirtieth, no
             # step gain on the 36-layer cut): column
             # order's short rows by one program a row holding the row in registers
             # (TopkLaunch.short_rows, HISPARSE_TOPK_SHORT): its GPU tests, the top-k alone at
             # the 2k point's rows (2,049-2,304 of a 163,840-column table) and at longer rows
             # (the extra launch's cost where no row is short), then the rank's 2k x 96 step
             # without and with it (LAYERS=36 on an H100; ~7 min)
      GPU_TEST_FILES="tests/ops/test_ops_topk.py tests/ops/test_ops_indexer_fused.py" \
        skip_or_test
      export HISPARSE_TRITON_AUTOTUNE=0
      run short_topk 150 python3 benchmarks/bench_topk.py --only short --short 4096,8192 \
        --table-width 163840 --row-extra 256 \
        --topk-shapes 2048x96x2048,2048x64x2048,2048x24x2048,3840x96x2048,7936x32x2048 \
        --out "$out/short_topk.json"
      run short_long 100 python3 benchmarks/bench_topk.py --only short --short 4096 \
        --table-width 163840 --topk-shapes 32768x8x2048,32768x24x2048,131072x8x2048 \
        --out "$out/short_long.json"
      unset HISPARSE_TRITON_AUTOTUNE
      cut=()
      [ -n "${LAYERS:-}" ] && cut=(--layers "$LAYERS")
      for rows in 0 4096; do
        HISPARSE_TOPK_SHORT=$rows run short_step2k_$rows 170 python3 -m hisparse.cli bench \
          --model-shape deepseek-v3.2-tp8-rank --kv-cache-dtype fp8 --topk synthetic:0.8 \
          --modes gpu-only --host-pool-gib 1 --profile-kernels 5 --contexts 2048 \
          --concurrency 96 --outputs 256 --out "$out/short_step2k_$rows" "${cut[@]}"
      done ;;
    plans)   # issue 25: the 16-head FP8 attention plans with today's kernel, isolated at the
             # decode's shapes (8-96 tokens, 32k rows a token), then the rank's 2k x 96 under
             # the package's plan and under the plan with the least summed time (~6 min, H200)
      # (the whole grid of 24 plans does not fit the limit: the plans nearest today's)
      run attn_plans 180 python3 benchmarks/bench_attention_plans.py \
        --shapes 16x8,16x24,16x42,16x96 --context 32768 --out "$out/attn_plans.json" \
        --plans 64/4/2/64,64/4/2/128,64/8/2/128,32/4/2/128,32/4/3/128,64/4/2/256,32/4/2/256,64/8/2/64
      best=$(python3 -c 'import json, sys; rows = json.load(open(sys.argv[1])); names = [
n for n in rows[0]["us"] if n not in ("former", "default")]; print(min(names, key=lambda n:
sum(r["us"][n] for r in rows)))' "$out/attn_plans.json" 2>/dev/null)
      if [ -z "$best" ] || [ "$best" = 64/4/2/64 ]; then    # no table, or the package's plan
        elapsed "plan with the least summed time: ${best:-none (no table)}; rank runs skipped"
      else
        elapsed "plan with the least summed time: $best"
        rank2k plan2k_package
        run plan2k_best 150 python3 benchmarks/bench_rank_attn_plan.py "$best" bench \
          --model-shape deepseek-v3.2-tp8-rank --kv-cache-dtype fp8 --topk synthetic:0.8 \
          --modes gpu-only --host-pool-gib 1 --profile-kernels 5 --contexts 2048 \
          --concurrency 96 --outputs 256 --out "$out/plan2k_best"
      fi ;;
    cut36)   # an H100 (80 GB: the whole rank does not fit): a 36-layer cut of the V3.2 rank,
             # 2k x 96 gpu-only, the per-layer kernels at the rank's shapes: this tree with
             # and without HISPARSE_FP8_CONVERT=int, and, with BASE (a directory holding
             # `git archive 3753608` unpacked: the device copy has no .git), the tree before
             # the bf16 partials, same call (~6 min)
      runs="native:$PWD int:$PWD"
      [ -n "${BASE:-}" ] && runs="$runs base:$(cd "$BASE" && pwd)"
      for r in $runs; do
        name=${r%%:*}; dir=${r#*:}
        (
          cd "$dir" && export PYTHONPATH=$dir
          [ "$name" = int ] && export HISPARSE_FP8_CONVERT=int
          run cut36_$name 150 python3 -m hisparse.cli bench \
            --model-shape deepseek-v3.2-tp8-rank --layers 36 --kv-cache-dtype fp8 \
            --topk synthetic:0.8 --modes gpu-only --host-pool-gib 1 --profile-kernels 5 \
            --contexts 2048 --concurrency 96 --outputs 128 --out "$out/cut36_$name"
        )
      done ;;
    narrow)  # issue 25 (thirty-second session; run on an H100 in the thirty-third: 0.983x at
             # 2k x 96, 0.977x at 8 x 32k on the 36-layer cut): the router gate and the
             # indexer's weights_proj in bf16 where their values are bf16 (one bf16 MMA pass,
             # narrow_fp32_weights_); its GPU tests are in `owed` (run that first). The router
             # sweep (both gate dtypes), then 2k x 96 on the rank, this tree and, with BASE (a
             # directory holding `git archive 9555d82` unpacked), the tree before (~8 min; an
             # H100 with LAYERS=36). The base tree draws other dummy gate values: compare the
             # router's and weights_proj's kernel times, not only the step
      HISPARSE_TRITON_AUTOTUNE=0 run router 90 python3 benchmarks/bench_moe.py --router-sweep \
        --skip-gemm --skip-moe --moe-batches 8,24,96 --out "$out/router.json"
      NARROW_CTX=2048 NARROW_CONC=96 bash "$0" "$out" narrow_rank ;;
    narrow32k) # the same at 8 x 32k (~6 min)
      NARROW_CTX=32768 NARROW_CONC=8 bash "$0" "$out" narrow_rank ;;
    narrow_rank) # (narrow's, narrow32k's) one point on the rank, this tree and BASE's
      cut=()
      [ -n "${LAYERS:-}" ] && cut=(--layers "$LAYERS")
      runs="new:$PWD"
      [ -n "${BASE:-}" ] && runs="$runs base:$(cd "$BASE" && pwd)"
      for r in $runs; do
        name=${r%%:*}; dir=${r#*:}
        (
          cd "$dir" && export PYTHONPATH=$dir
          run narrow${NARROW_CTX}_$name 170 python3 -m hisparse.cli bench \
            --model-shape deepseek-v3.2-tp8-rank --kv-cache-dtype fp8 --topk synthetic:0.8 \
            --modes gpu-only --host-pool-gib 1 --profile-kernels 5 --contexts "$NARROW_CTX" \
            --concurrency "$NARROW_CONC" --outputs 128 --out "$out/narrow${NARROW_CTX}_$name" \
            "${cut[@]}"
        )
      done ;;
    eff)     # issue 24 (thirty-third session, H100: 0.89 / 0.80 at 41 / 68 running): HiSparse's
             # tok/s against GPU-only's at the same running count, on an 18-layer cut at 32k (its
             # KV fits an H100 at 68 x 32k): both modes on one GPU budget (GPU-only holds 31),
             # then GPU-only with the whole memory at 16 and at HiSparse's count (~3 min)
      run eff_pair 200 python3 -m hisparse.cli bench --model-shape deepseek-v3.2-tp8-rank \
        --layers 18 --kv-cache-dtype fp8 --topk synthetic:0.8 --contexts 32768 --outputs 192 \
        --profile-kernels 3 --modes gpu-only,hisparse --concurrency max --gpu-kv-gib 11.5 \
        --host-pool-gib 30 --out "$out/eff_pair"
      n=$(python3 -c "import json, sys; print(max(p['running_reached'] for p in json.load(open(
        sys.argv[1])) if p['mode'] == 'hisparse'))" "$out/eff_pair/bench_decode.json")
      run eff_wide 150 python3 -m hisparse.cli bench --model-shape deepseek-v3.2-tp8-rank \
        --layers 18 --kv-cache-dtype fp8 --topk synthetic:0.8 --contexts 32768 --outputs 192 \
        --profile-kernels 3 --modes gpu-only --concurrency "16,$n" --host-pool-gib 1 \
        --out "$out/eff_wide"
      python3 -m hisparse.bench.report "$out/eff_pair/bench_decode.json" \
        "$out/eff_wide/bench_decode.json" | tail -n 3 ;;
    topkstore) # issue 24 (thirty-fourth session, built without a GPU): the top-k's histograms
             # one bin a thread (no layout conversion through shared memory in its four
             # histogram phases; b8dc09c). Its GPU tests, then the top-k over the engine's
             # 163,840-column table at 8 / 24 / 64 x 32k and 8 / 24 x 128k, this tree and, with
             # BASE (a directory holding `git archive b30f855` unpacked: the tree before), the
             # tree before in the same call (~5 min, any GPU: issue 24's figures are H100's)
      GPU_TEST_FILES="tests/ops/test_ops_topk.py tests/ops/test_ops_indexer_fused.py" \
        skip_or_test
      base=${BASE:?topkstore: BASE=dir of git archive b30f855}
      for tree in new base; do
        dir=$PWD; [ $tree = base ] && dir=$(cd "$base" && pwd)
        (
          cd "$dir" && export PYTHONPATH=$dir HISPARSE_TRITON_AUTOTUNE=0
          run topkstore_$tree 150 python3 benchmarks/bench_topk.py --only wide \
            --table-width 163840 --topk-shapes \
            32768x8x2048,32768x24x2048,32768x64x2048,131072x8x2048,131072x24x2048 \
            --out "$out/topkstore_$tree.json"
        )
      done ;;
    moe)     # issue 25 item 3: the fused MoE layer's launch table vs the runtime autotune,
             # 1-512 tokens (~1.5 min; bench_moe_launch.py prints MOE_LAUNCHES to paste)
      run moe_launch 150 python3 benchmarks/bench_moe_launch.py --out "$out/moe_launch.json" ;;
    glm)     # issue 25: GLM-5's rank (78 layers, never run), the same table
      run glm 560 python3 -m hisparse.cli bench --model-shape glm-5-tp8-rank \
        --kv-cache-dtype fp8 --topk synthetic:0.8 --contexts 32768 --concurrency 8,max \
        --outputs 128 --host-pool-gib 64 --profile-kernels 5 --out "$out/glm" ;;
    gemm)    # issue 25 item 2: the split-K FP8 linears vs the stream kernel and bf16 mm, M to
             # 512, with the launch sweep that SPLITK_TABLE comes from (~75 s)
      run gemm 150 python3 benchmarks/bench_gemm.py --chunks-sweep --out "$out/bench_gemm.json" ;;
    pinned)  # issue 25 item 4: cudaHostAlloc vs cudaHostRegister, to 112 GiB (~3 min)
      run pinned 240 python3 benchmarks/probe_pinned.py --time-limit 200 --json "$out/pinned.json" ;;
    disagg)  # issue 23: TTFT / ITL through the router vs colocated, transfer GB/s per tier
             # (GPU pages with room; the host pool: an always-host decode lands every row there)
      run disagg 200 python3 benchmarks/bench_disagg.py --out "$out/disagg.json" --layers 4 \
        --num-prompts 24 --input-len 4096 --output-len 64 --request-rate 2
      run disagg_host 150 python3 benchmarks/bench_disagg.py --out "$out/disagg_host.json" \
        --layers 4 --num-prompts 24 --input-len 4096 --output-len 64 --request-rate 2 \
        --skip-colocated --decode-args "--mode always-host" ;;
    nixl)    # issue 23: raw NIXL READ rates between two processes of this host (~3 min):
             # pinned host -> pinned host (what a decode's loads do) by UCX transport and agent
             # option, 4-layer stand-in and V3.2 rank; pinned host -> VRAM (the old GPU-tier
             # landing); each with the protocol UCX chose for the GETs
      run nixl_host 170 python3 benchmarks/probe_nixl.py --src pinned --dst pinned \
        --variants default,tcp,cma,threads4 --shapes standin,v32 --repeat 3 --proto-info \
        --json "$out/nixl_host.json"
      run nixl_vram 70 python3 benchmarks/probe_nixl.py --src pinned --dst vram \
        --variants default,cuda --shapes standin --repeat 3 --proto-info \
        --json "$out/nixl_vram.json"
      grep -hv "NIXL INFO" "$out/nixl_host.log" "$out/nixl_vram.log" >"$out/nixl_table.txt"
      cat "$out/nixl_table.txt" ;;
    resolver) # issue 24 item 3: the eleventh session's resolver rebuild (epoch-tagged map, loads
             # side by side, packed prefix sums) against the kernel before it, same call: its
             # GPU tests, the phase probe of both kernels and the bench's scenarios under lru
             # and score+prefetch (~5 min).
             # RESOLVE_BASE: `git show ae322f2:hisparse/ops/_resolve_triton.py` saved here
             # (the device's copy has no history; carry its directory)
      base=${RESOLVE_BASE:?resolver: RESOLVE_BASE=file of the kernel module at ae322f2}
      GPU_TEST_FILES="tests/ops/test_ops_resolve.py tests/engine/test_capacity.py
        tests/engine/test_hot_policy.py tests/bench/test_band_replay.py tests/engine/test_spec_gpu.py
        tests/engine/test_soak.py tests/engine/test_engine_gpu.py tests/worker/test_cuda_graph_gpu.py
        tests/engine/test_engine_switches.py tests/engine/test_disagg_gpu.py" skip_or_test
      for policy in lru score+prefetch; do     # the benches' policy, the engine's default
        run phases_base_$policy 60 python3 benchmarks/probe_resolver_phases.py --source "$base" \
          --requests 8,42 --scenarios steady,cold2 --policy $policy \
          --out "$out/phases_base_$policy.json"
        run phases_new_$policy 60 python3 benchmarks/probe_resolver_phases.py --requests 8,42 \
          --scenarios steady,cold2 --policy $policy --out "$out/phases_new_$policy.json"
        run bench_resolver_$policy 90 python3 benchmarks/bench_resolver.py --baseline "$base" \
          --splits 16 --policy $policy --out "$out/bench_resolver_$policy.json"
      done ;;
    rankmax) # issues 24/25: the real rank at its 32k maximum, both modes, 512 outputs, kernel
             # profile (whole-run figures under the current warm-up; ~5 min). `max` is
             # hisparse's plan with GPU-held requests (twentieth session: ~61 against the host
             # pool's 42): both modes run that many requests. A 96 GiB pool: past the VM's
             # former 72-80 GiB "ceiling" (torch's power-of-two pinned rounding; the pool now
             # pins its exact size); if it does not pin, the error names the knob: use 64
      run rankmax 560 python3 -m hisparse.cli bench --model-shape deepseek-v3.2-tp8-rank \
        --kv-cache-dtype fp8 --topk synthetic:0.8 --contexts 32768 --concurrency max \
        --modes gpu-only,hisparse --outputs 512 --host-pool-gib 96 --profile-kernels 5 \
        --out "$out/rankmax" ;;
    hostpool) # issue 24: the miss gather over host pools pinned three ways (cudaHostAlloc,
             # registered mmap, the same on huge pages) at four spreads, the engine's
             # layer-major slabs included (~2 min; the H100 host, twenty-third session: huge
             # pages change nothing, one call's spread does)
      run host_gather 200 python3 benchmarks/probe_host_gather.py --gib 32 \
        --json "$out/host_gather.json" ;;
    policies) # issue 24: the step cost of the engine's default hot policy (score: a ranked
             # top-k + band in host-read forwards, its k counted into position order, the band
             # walk) against lru (position order, no band), then score under
             # HISPARSE_TOPK_ORDER=ranked (score order in every forward: the default before the
             # twenty-sixth session, measured there on an H100 cut); the rank's own indexer
             # selecting (synthetic sources have no band; dummy weights, so the hit rates are
             # not a real model's), hisparse at 42 x 32k, 128 outputs (~8 min, H200)
      run policies_positions 330 python3 -m hisparse.cli bench \
        --model-shape deepseek-v3.2-tp8-rank --kv-cache-dtype fp8 --topk indexer \
        --contexts 32768 --concurrency 42 --modes hisparse --hot-policies lru,score \
        --outputs 128 --host-pool-gib 64 --profile-kernels 5 --out "$out/policies_positions"
      HISPARSE_TOPK_ORDER=ranked run policies_ranked 200 python3 -m hisparse.cli bench \
        --model-shape deepseek-v3.2-tp8-rank --kv-cache-dtype fp8 --topk indexer \
        --contexts 32768 --concurrency 42 --modes hisparse --hot-policies score --outputs 128 \
        --host-pool-gib 64 --profile-kernels 5 --out "$out/policies_ranked" ;;
    merge)   # issues 24/25 (twenty-fourth session; measured on an H100 with LAYERS=36):
             # the attention's merge at 2 warps and column_order in one launch (positions'
             # sort; twenty-fifth session: a count over a bitmap instead): their GPU tests
             # (~2 min), the merge's plans alone beside the kernel of BASE
             # (probe_attention_stages.py, ~1 min), positions' ranked select + count (and
             # sort) against column order alone (~30 s), then the rank's 2k x 96 step, this tree then
             # BASE's (~5 min; the whole rank on an H200: is 2k x 96 under 39.5 ms?). BASE: a
             # directory holding `git archive c6912dd` unpacked
      base=$(cd "${BASE:?merge: BASE=directory of git archive c6912dd}" && pwd) \
        || { elapsed "merge: BASE (a directory) is not set"; continue; }
      GPU_TEST_FILES="tests/ops/test_ops_attention.py tests/ops/test_ops_topk.py
        tests/engine/test_engine_gpu.py tests/worker/test_cuda_graph_gpu.py
        tests/ops/test_ops_indexer_fused.py" skip_or_test
      export HISPARSE_TRITON_AUTOTUNE=0
      run merge_probe 120 python3 benchmarks/probe_attention_stages.py --variants '' \
        --base "$base/hisparse/ops/_attention_triton.py" --out "$out/merge_probe.json"
      run order_sort 90 python3 benchmarks/bench_topk.py --only order \
        --topk-shapes 32768x8x2048,32768x42x2048,2304x96x2048 --out "$out/order_sort.json"
      unset HISPARSE_TRITON_AUTOTUNE
      cut=()
      [ -n "${LAYERS:-}" ] && cut=(--layers "$LAYERS")
      run merge_step2k_new 170 python3 -m hisparse.cli bench \
        --model-shape deepseek-v3.2-tp8-rank --kv-cache-dtype fp8 --topk synthetic:0.8 \
        --modes gpu-only --host-pool-gib 1 --profile-kernels 5 --contexts 2048 \
        --concurrency 96 --outputs 256 --out "$out/merge_step2k_new" "${cut[@]}"
      (cd "$base" && export PYTHONPATH=$base && run merge_step2k_base 170 python3 -m \
        hisparse.cli bench --model-shape deepseek-v3.2-tp8-rank --kv-cache-dtype fp8 \
        --topk synthetic:0.8 --modes gpu-only --host-pool-gib 1 --profile-kernels 5 \
        --contexts 2048 --concurrency 96 --outputs 256 --out "$out/merge_step2k_base" \
        "${cut[@]}") ;;
    attnprobe) # issue 25: the FP8 attention's one-copy dequantization (twelfth session, CPU-
             # built): the GPU tests of the files it touches (~3 min), where its time goes at
             # 16 heads (variants leaving a stage out, the kernel before it with a bits check,
             # the merge alone; ~2 min), eight 16-head plans (~1.5 min: each compiles once)
      GPU_TEST_FILES="tests/ops/test_ops_quant.py tests/ops/test_ops_attention.py
        tests/engine/test_engine_gpu.py tests/worker/test_cuda_graph_gpu.py
        tests/engine/test_soak.py" skip_or_test
      run attn_stages 180 python3 benchmarks/probe_attention_stages.py \
        --out "$out/attn_stages.json"
      # the plan grid again: one copy of the tile changes each plan's registers and shared
      # memory (benchmarks/attention_resources.py), so the best plan may move
      run attn_plans 150 python3 benchmarks/bench_attention_plans.py \
        --shapes 16x8,16x24,16x42,16x96 --context 32768 \
        --plans 64/4/3/64,64/8/2/64,64/4/2/128,64/4/3/128,32/4/3/128,32/4/3/256,64/4/3/256 \
        --out "$out/attn_plans.json" ;;
    attnncu) # issue 25: the FP8 attention's occupancy and stall reasons at 96 x 2k from ncu,
             # where ncu reads hardware counters (Firecracker machines; on gVisor it cannot:
             # H200.md), checked first on one small kernel (~2.5 min)
      if command -v ncu >/dev/null && timeout 60 ncu --clock-control none --launch-count 1 \
          python3 -c "import torch; (torch.ones(8, device='cuda') * 2).sum().item()" 2>&1 \
          | grep -q "Duration"; then
        run attn_ncu 150 ncu --clock-control none --kernel-name regex:_attn_fp8 \
          --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
          --section LaunchStats --section WarpStateStats --section SchedulerStats \
          --section MemoryWorkloadAnalysis \
          python3 benchmarks/probe_attention_stages.py --once 96x2048
        grep -vE "^==PROF==" "$out/attn_ncu.log" | tail -n 120 >"$out/attn_ncu.txt"
      else
        elapsed "attnncu: ncu reads no hardware counters here"
      fi ;;
    kernels) # issues 24/25: the new kernels against the old ones in one run (first configs,
             # no autotuning, so both sides compile once): FP8 linears (stream vs tile vs
             # scaled_mm vs bf16), the whole MoE layer (fused vs HISPARSE_FUSED_MOE=0), the
             # resolver (split miss gather vs the kernel at 986c8d9), scoring configs
      # the baseline resolver, made where git is (the device's copy has no history):
      # mkdir -p bench_base && git show 986c8d9:hisparse/ops/_resolve_triton.py >bench_base/resolve_base.py
      base=${RESOLVE_BASE:-bench_base/resolve_base.py}
      export HISPARSE_TRITON_AUTOTUNE=0
      run gemm 100 python3 benchmarks/bench_moe.py --skip-moe --batches 1,16,64,256,512 \
        --out "$out/bench_gemm.json"
      run moe 90 python3 benchmarks/bench_moe.py --skip-gemm --moe-weights fp8 \
        --out "$out/bench_moe_layer.json"
      run resolver 60 python3 benchmarks/bench_resolver.py --baseline "$base" \
        --splits 16,1 --out "$out/bench_resolver.json"
      run scoring 40 python3 benchmarks/bench_topk.py --only sweep --contexts 32768 \
        --score-rows 24 --out "$out/scoring_sweep.json"
      # the top-k: torch.topk vs HISPARSE_TOPK=legacy vs phased vs fused, and the fused
      # launch's hints (TopkLaunch) at four shapes
      run topk 120 python3 benchmarks/bench_topk.py --only topk,topk-sweep \
        --out "$out/bench_topk.json"
      unset HISPARSE_TRITON_AUTOTUNE ;;
    serve)   # issue 22 item 6: hisparse serve per mode on the stand-in, bench-serve at 32k / 512
             # Poisson, guidellm against the hisparse server (~5-6 min; carry .whl-serve too)
      run serve 470 python3 benchmarks/serve_matrix.py --out "$out/serve" --num-prompts 16 \
        --request-rate 1 --startup-timeout 180 --load-timeout 150 ;;
    *) echo "unknown section $section (tests owed resolver attnprobe attnncu rankmax fused buckets"\
            "step order convert cut36 moe rank glm gemm pinned disagg nixl kernels serve)"; exit 2 ;;
  esac
done
