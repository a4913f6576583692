"""Data-plane kernel benchmarks (H200): miss gather vs bulk H2D (1152-B and 656-B rows, variants),
resolver, attention (bf16 and FP8 rows) vs the RAW FlashMLA kernels, indexer + top-k (bf16 and
FP8 keys). Usage:
    python benchmarks/bench_ops.py [--out DIR|FILE.json] [--sweep] [--pool-gib 16]
                                   [--only gather,resolver,attention,indexer]
                                   [--indexer-ctx 8192,32768,131072]

Every figure is also reported as a ratio against a baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hisparse.ops import indexer_topk, resolve_rows, sparse_mla_attention  # noqa: E402
from hisparse.ops.attention import flashmla_available  # noqa: E402


def timeit(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    times.sort()
    return times[len(times) // 2]


def timeit_graph(fn, calls=10, reps=7):
    """Per-call GPU time of ``fn`` as the engine runs it: ``calls`` back-to-back calls captured
    in one CUDA graph (no host work between kernels: a wrapper's Python cost is not counted,
    its extra kernels are), median over ``reps`` replays."""
    fn()                                   # compile / allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / calls)
    times.sort()
    return times[len(times) // 2]


@triton.jit
def _gather_rows2d_kernel(src_ptr, dst_ptr, rows_ptr, n, src_stride_w, dst_stride_w,
                          CHUNKS: tl.constexpr, CP: tl.constexpr, BR: tl.constexpr):
    """Benchmark variant: BR rows per program, a row = CHUNKS 16-byte chunks (lanes padded to
    CP), int32 words with 16-byte alignment hints."""
    pid = tl.program_id(0)
    r = pid * BR + tl.arange(0, BR)
    rm = r < n
    sr = tl.load(rows_ptr + r, mask=rm, other=0).to(tl.int64)
    c = tl.arange(0, CP)
    so = tl.multiple_of(sr[:, None] * src_stride_w + c[None, :] * 4, [4, 4])
    do = tl.multiple_of(r.to(tl.int64)[:, None] * dst_stride_w + c[None, :] * 4, [4, 4])
    v4 = tl.arange(0, 4)
    m = (rm[:, None] & (c < CHUNKS)[None, :])[:, :, None]
    v = tl.load(src_ptr + so[:, :, None] + v4[None, None, :], mask=m)
    tl.store(dst_ptr + do[:, :, None] + v4[None, None, :], v, mask=m)


def gather_rows2d(src, dst, rows, br, num_warps):
    """``dst[i] = src[rows[i]]`` for uint8 rows whose byte size is a multiple of 16."""
    sw, dw = src.view(torch.int32), dst.view(torch.int32)
    chunks = sw.shape[1] // 4
    n = rows.numel()
    _gather_rows2d_kernel[(triton.cdiv(n, br),)](
        sw, dw, rows, n, sw.stride(0), dw.stride(0), CHUNKS=chunks,
        CP=triton.next_power_of_2(chunks), BR=br, num_warps=num_warps)


def _huge_page_pool(nbytes):
    """(tensor, kind): an mmap'd region backed by 2 MiB pages where the kernel gives them
    (MAP_HUGETLB, else transparent huge pages via madvise), registered with cudaHostRegister."""
    import mmap
    kind = "thp"
    mm = None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if hasattr(mmap, "MAP_HUGETLB"):
        try:
            mm = mmap.mmap(-1, nbytes, flags=flags | mmap.MAP_HUGETLB)
            kind = "hugetlb"
        except OSError:
            mm = None
    if mm is None:
        mm = mmap.mmap(-1, nbytes, flags=flags)
        if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
        else:
            kind = "4k"
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t.view(torch.int32)[:: 1024].fill_(1)          # fault the pages in
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    return t, mm, kind


def bench_gather(res, sweep, pool_gib):
    """Miss gather of scattered host rows (zero-copy, in-kernel) vs bulk pinned H2D, for 1152-B
    and 656-B rows, rows spread over 512 MiB .. the whole pool (``--pool-gib``, >= 16 GiB for
    the issue-11 target). Variants (656 B): flat 16-byte chunks (the production copy kernel) at
    several block sizes; BR rows per program; misses ordered by host address (sort excluded /
    included); 2 MiB pages (mmap + cudaHostRegister)."""
    from hisparse.ops._copy_triton import copy_rows_triton
    pool_bytes = int(pool_gib * (1 << 30))
    t0 = time.perf_counter()
    pool = torch.empty(pool_bytes, dtype=torch.uint8).pin_memory()
    print(f"pinned a {pool_gib} GiB pool in {time.perf_counter() - t0:.1f} s", flush=True)
    pool.view(torch.int32)[:: 1024].fill_(1)
    n_rows = 64 * 2048
    spreads = [("512MiB", 512 << 20), ("2GiB", 2 << 30)]
    if pool_bytes > (2 << 30):
        spreads.append((f"{pool_gib:g}GiB", pool_bytes))

    def record(row_bytes, spread, variant, t, t_bulk, **kw):
        nbytes = n_rows * row_bytes
        gbs, bulk = nbytes / t / 1e9, nbytes / t_bulk / 1e9
        res.append(dict(bench="gather", row_bytes=row_bytes, spread=spread, variant=variant,
                        gbs=gbs, bulk_gbs=bulk, ratio=t_bulk / t, **kw))
        print(f"  gather {row_bytes}B spread {spread:>7} {variant:<28} {gbs:6.1f} GB/s = "
              f"{t_bulk / t * 100:5.1f}% of bulk H2D ({bulk:.1f} GB/s)", flush=True)

    for row_bytes in (1152, 656):
        nbytes = n_rows * row_bytes
        src_bulk = pool[:nbytes]
        dst_bulk = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t_bulk = timeit(lambda: dst_bulk.copy_(src_bulk, non_blocking=True))
        host = pool[: (pool_bytes // row_bytes) * row_bytes].view(-1, row_bytes)
        dst = torch.empty(n_rows, row_bytes, dtype=torch.uint8, device="cuda")
        src3 = host.view(1, -1, row_bytes)
        dst3 = dst.view(1, n_rows, row_bytes)
        for spread_name, span_bytes in spreads:
            span = min(host.shape[0], span_bytes // row_bytes)
            rows = torch.randint(0, span, (n_rows,), device="cuda")
            configs = [(1024, 4)]
            if sweep or row_bytes == 656:
                configs += [(256, 4), (2048, 8), (4096, 16)]
            for bc, nw in configs:
                t = timeit(lambda: copy_rows_triton(src3, dst3, rows, None, block_c=bc,
                                                    num_warps=nw))
                record(row_bytes, spread_name, f"flat block_c={bc} w={nw}", t, t_bulk)
            assert torch.equal(dst[:64].cpu(), host[rows[:64].cpu()])
            if row_bytes != 656:
                continue
            for br, nw in ((1, 1), (2, 2), (4, 4), (8, 4), (16, 8), (32, 8)):
                t = timeit(lambda: gather_rows2d(host, dst, rows, br, nw))
                record(row_bytes, spread_name, f"rows/program={br} w={nw}", t, t_bulk)
            assert torch.equal(dst[:64].cpu(), host[rows[:64].cpu()])
            srt, perm = torch.sort(rows)
            t = timeit(lambda: copy_rows_triton(src3, dst3, srt, perm))
            record(row_bytes, spread_name, "sorted by address", t, t_bulk)

            def sort_and_copy():
                s_, p_ = torch.sort(rows)
                copy_rows_triton(src3, dst3, s_, p_)
            t = timeit(sort_and_copy)
            record(row_bytes, spread_name, "sort + copy", t, t_bulk)
    del pool
    # 2 MiB pages: a registered mmap region, 656-B rows spread over all of it
    hp_bytes = min(pool_bytes, 2 << 30)
    try:
        hp, mm, kind = _huge_page_pool(hp_bytes)
    except Exception as e:  # noqa: BLE001
        print(f"  huge-page pool unavailable: {type(e).__name__}: {e}", flush=True)
        return
    row_bytes = 656
    nbytes = n_rows * row_bytes
    dst_bulk = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t_bulk = timeit(lambda: dst_bulk.copy_(hp[:nbytes], non_blocking=True))
    host = hp[: (hp_bytes // row_bytes) * row_bytes].view(-1, row_bytes)
    dst = torch.empty(n_rows, row_bytes, dtype=torch.uint8, device="cuda")
    rows = torch.randint(0, host.shape[0], (n_rows,), device="cuda")
    for bc, nw in ((1024, 4), (4096, 16)):
        t = timeit(lambda: copy_rows_triton(host.view(1, -1, row_bytes),
                                            dst.view(1, n_rows, row_bytes), rows, None,
                                            block_c=bc, num_warps=nw))
        record(row_bytes, f"{hp_bytes >> 30}GiB", f"{kind} pages flat block_c={bc}", t, t_bulk,
               pages=kind)
    assert torch.equal(dst[:64].cpu(), host[rows[:64].cpu()])
    torch.cuda.cudart().cudaHostUnregister(hp.data_ptr())


def bench_resolver(res):
    R, K, H, bs = 64, 2048, 4096, 64
    ctx = 32 * 1024
    P = ctx // bs
    HB = H // bs
    n_blocks = R * HB + 16
    for row_bytes in (1152, 656):    # bf16 rows, FP8 rows (moved as int32 words)
        _bench_resolver_rows(res, R, K, H, bs, ctx, P, HB, n_blocks, row_bytes)


def _bench_resolver_rows(res, R, K, H, bs, ctx, P, HB, n_blocks, row_bytes):
    words = row_bytes // 4
    arena = torch.randint(-2**31, 2**31 - 1, (n_blocks * bs, words), dtype=torch.int32,
                          device="cuda")
    host = torch.randint(-2**31, 2**31 - 1, (R * P * bs, words), dtype=torch.int32).pin_memory()
    resbt = torch.full((R, P), -1, dtype=torch.int32, device="cuda")
    hostbt = torch.arange(R * P, dtype=torch.int32, device="cuda").view(R, P)
    hotbt = torch.arange(R * HB, dtype=torch.int32, device="cuda").view(R, HB)
    req = torch.arange(R, dtype=torch.int32, device="cuda")
    counters = torch.zeros(2, dtype=torch.int64, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for mode in ("eager", "graph"):
        for frac in (0.0, 0.1, 1.0):
            keys = torch.full((R, H), -1, dtype=torch.int32, device="cuda")
            lru = torch.arange(H, dtype=torch.int32, device="cuda").repeat(R, 1)
            perm = torch.argsort(torch.rand(R, ctx, device="cuda", generator=g),
                                 dim=1).to(torch.int32)
            sel = perm[:, :K].contiguous()
            nxt = K
            n_new = int(round(frac * K))
            steps = []
            for _ in range(12):
                s_ = sel.clone()
                if n_new:
                    s_[:, :n_new] = perm[:, nxt:nxt + n_new]
                    nxt += n_new
                sel = s_.roll(n_new // 2 + 1, dims=1).contiguous()
                steps.append(sel)
            static = perm[:, :K].contiguous()
            args = lambda: (static, req, resbt, hostbt, hotbt, keys, lru, arena, host, bs, counters)
            resolve_rows(*args())                      # cold fill (and scratch allocation)
            if mode == "graph":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    resolve_rows(*args())
                call = graph.replay
            else:
                call = lambda: resolve_rows(*args())
            torch.cuda.synchronize()
            c0 = counters.clone()
            times = []
            for i, st in enumerate(steps):
                static.copy_(st)
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                call()
                b.record()
                b.synchronize()
                if i >= 2:
                    times.append(a.elapsed_time(b) * 1e-3)
            times.sort()
            t = times[len(times) // 2]
            d = (counters - c0).tolist()
            miss_rate = d[1] / max(1, d[0] + d[1])
            miss_bytes = miss_rate * R * K * row_bytes
            res.append(dict(bench="resolver", row_bytes=row_bytes, mode=mode, batch=R, topk=K,
                            hot=H, miss_frac=frac,
                            us=t * 1e6, measured_miss_rate=miss_rate,
                            miss_gbs=(miss_bytes / t / 1e9) if frac else None))
            print(f"resolver[{mode}] {row_bytes}-B rows B={R} K={K} H={H} "
                  f"misses {frac * 100:.0f}% (measured "
                  f"{miss_rate * 100:.1f}%): {t * 1e6:.1f} us"
                  + (f", {miss_bytes / t / 1e9:.1f} GB/s of missed rows" if frac else ""),
                  flush=True)


def _raw_flashmla(q, kv, idx, scale, fp8_cache=None):
    """The raw FlashMLA calls, inputs prepared once (padded at allocation): returns closures
    ``(bf16 sparse_fwd, fp8 decode)``; ``None`` where the module lacks the call."""
    import flash_mla as fm

    from hisparse.ops.attention import _is_sm90, _takes_use_legacy
    T, H, D = q.shape
    K = idx.shape[1]
    legacy = _is_sm90(q.device)
    kv3, idx3 = kv.view(kv.shape[0], 1, D), idx.view(T, 1, K)
    bf16 = lambda: fm.flash_mla_sparse_fwd(q, kv3, idx3, scale, 512, use_legacy=legacy)
    fp8 = meta = None
    if fp8_cache is not None and hasattr(fm, "flash_mla_with_kvcache"):
        N = fp8_cache.shape[0]
        cache = fp8_cache.view(torch.float8_e4m3fn).view(N // 64, 64, 1, fp8_cache.shape[1])
        q4 = q.view(T, 1, H, D)
        meta = fm.get_mla_metadata()[0]
        kw = {"use_legacy": legacy} if _takes_use_legacy(fm.flash_mla_with_kvcache) else {}
        fp8 = lambda: fm.flash_mla_with_kvcache(q4, cache, None, None, 512, meta,
                                                softmax_scale=scale, is_fp8_kvcache=True,
                                                indices=idx3, **kw)
    return bf16, fp8, meta


def bench_attention(res, sweep, tokens=(64,), heads=(16, 64, 128)):
    """Sparse MLA attention, T tokens (``tokens``, default 64) x H heads x top-k 2048, every figure
    a throughput ratio against the RAW FlashMLA kernel on the same inputs, every call timed inside a
    CUDA graph (:func:`timeit_graph`: what a captured decode step pays) (bf16:
    ``flash_mla_sparse_fwd``; FP8: ``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``
    over 656-B rows). Heads are padded to 64 once at allocation for the raw calls (FlashMLA needs 64
    or 128); the hisparse FlashMLA backend gets the unpadded q (at 16 heads it pads per call: that
    cost is real)."""
    from hisparse.ops import quantize_mla_rows_reference, sparse_mla_attention_fp8
    from hisparse.ops._attention_triton import (
        AttnConfig,
        sparse_mla_attention_fp8_triton,
        sparse_mla_attention_triton,
    )
    K = 2048
    N = 64 * 4096
    kv = torch.randn(N, 576, device="cuda").to(torch.bfloat16)
    kv8 = quantize_mla_rows_reference(kv, 512)                     # [N, 656] uint8
    scale = 576 ** -0.5
    have_fm = flashmla_available()
    rows = []
    for T, H in [(T, H) for T in tokens for H in heads]:
        idx = torch.randint(0, N, (T, K), dtype=torch.int32, device="cuda")
        hp = max(64, H)
        qp = torch.randn(T, hp, 576, device="cuda").to(torch.bfloat16)   # padded at allocation
        q = qp[:, :H].contiguous() if hp != H else qp
        flops = T * H * K * (576 + 512) * 2
        line = {"T": T, "H": H}
        raw = {}
        if have_fm:
            try:
                bf16_raw, fp8_raw, _ = _raw_flashmla(qp, kv, idx, scale, kv8)
                raw["bf16"] = timeit_graph(bf16_raw)
                if fp8_raw is not None:
                    raw["fp8"] = timeit_graph(fp8_raw)
            except Exception as e:  # noqa: BLE001
                print(f"  raw flashmla H={H} failed: {type(e).__name__}: {str(e)[:200]}")
        cands = {
            ("bf16", "triton"): lambda: sparse_mla_attention_triton(q, kv, idx, scale),
            ("fp8", "triton"): lambda: sparse_mla_attention_fp8_triton(q, kv8, idx, scale),
        }
        if have_fm:
            cands[("bf16", "flashmla")] = lambda: sparse_mla_attention(q, kv, idx, scale,
                                                                       backend="flashmla")
            import flash_mla
            meta = flash_mla.get_mla_metadata()[0]       # reused across calls, as engines do
            cands[("fp8", "flashmla")] = lambda: sparse_mla_attention_fp8(
                q, kv8, idx, scale, backend="flashmla", sched_meta=meta)
            cands[("fp8", "flashmla fresh sched_meta")] = lambda: sparse_mla_attention_fp8(
                q, kv8, idx, scale, backend="flashmla")
        if sweep:
            # AttnConfig(block_h, block_n, num_warps, num_stages, k_per_split)
            cfgs = [AttnConfig(*c) for c in (
                (16, 64, 4, 2, 64), (16, 32, 4, 3, 128), (16, 32, 4, 3, 256), (32, 64, 8, 2, 256),
                (64, 64, 8, 2, 256), (64, 64, 8, 2, 512), (64, 64, 8, 2, 1024),
                (128, 32, 8, 2, 1024), (128, 64, 16, 2, 1024))]
            for cfg in cfgs:
                if cfg.block_h > max(16, H):
                    continue
                cands[("fp8", f"triton{cfg}")] = (
                    lambda cfg=cfg: sparse_mla_attention_fp8_triton(q, kv8, idx, scale,
                                                                    config=cfg))
        for (fmt, backend), fn in cands.items():
            try:
                t = timeit_graph(fn)
            except Exception as e:  # noqa: BLE001
                print(f"  attention {fmt} {backend} H={H} failed: {type(e).__name__}: "
                      f"{str(e)[:160]}")
                continue
            base = raw.get(fmt)
            ratio = (base / t) if base else None       # throughput vs the raw kernel
            res.append(dict(bench="attention", fmt=fmt, backend=backend, T=T, H=H, K=K,
                            us=t * 1e6, tflops=flops / t / 1e12,
                            raw_us=base * 1e6 if base else None, throughput_vs_raw=ratio))
            line[f"{fmt}/{backend}"] = (t, ratio)
        for fmt, t in raw.items():
            res.append(dict(bench="attention", fmt=fmt, backend="raw_flashmla", T=T, H=H, K=K,
                            us=t * 1e6, tflops=flops / t / 1e12, padded_heads=hp))
            line[f"{fmt}/raw"] = (t, 1.0)
        # accuracy: FP8 triton vs FP8 FlashMLA and vs the bf16 reference over dequantized rows
        o_t, _ = sparse_mla_attention_fp8_triton(q[:4], kv8, idx[:4], scale)
        o_r, _ = sparse_mla_attention_fp8(q[:4], kv8, idx[:4], scale, backend="reference")
        line["fp8 triton max|diff| vs ref"] = (o_t.float() - o_r.float()).abs().max().item()
        if have_fm:
            try:
                o_f, _ = sparse_mla_attention_fp8(q, kv8, idx, scale, backend="flashmla")
                o_t2, _ = sparse_mla_attention_fp8_triton(q, kv8, idx, scale)
                line["fp8 flashmla vs triton max|diff|"] = (
                    (o_f.float() - o_t2.float()).abs().max().item())
            except Exception as e:  # noqa: BLE001
                print(f"  fp8 flashmla check failed: {type(e).__name__}: {str(e)[:160]}")
        rows.append(line)
        parts = []
        for k_, v in line.items():
            if isinstance(v, tuple):
                t, r = v
                parts.append(f"{k_} {t * 1e6:.1f}us" + (f" ({r:.2f}x raw)" if r else ""))
            elif k_ not in ("T", "H"):
                parts.append(f"{k_} {v:.3g}")
        print(f"attention T={T} H={H} K={K}: " + " | ".join(parts), flush=True)
    return rows


# (BLOCK_S, programs per SM, num_warps, num_stages) of indexer_keys
INDEXER_SWEEP = [(64, 8, 4, 2), (128, 4, 4, 2), (128, 8, 4, 2), (128, 8, 4, 3), (128, 16, 4, 2),
                 (128, 8, 8, 2), (256, 4, 8, 2), (64, 16, 4, 3)]


def _sweep_indexer(res, keys: str, ctx: int, run) -> None:
    for cfg in INDEXER_SWEEP:
        tc = timeit(lambda: run(cfg), reps=10)
        print(f"  indexer scoring {keys} ctx={ctx} config {cfg}: {tc * 1e6:.0f} us", flush=True)
        res.append(dict(bench="indexer_score", keys=keys, ctx=ctx, config=str(cfg), us=tc * 1e6))


def bench_indexer(res, sweep, contexts=(8192, 32768, 131072)):
    """Indexer scoring and scoring + top-k, batch 64, 64 heads, D 128, page 64, top-k 2048:
    bf16 keys (256 B) vs page-split FP8 keys (132 B, quant.FP8KeyLayout) on the same values;
    ``sweep``: every config of INDEXER_SWEEP for both key formats."""
    from hisparse.ops._indexer_triton import indexer_keys
    from hisparse.ops.indexer import fp8_key_queries_reference
    from hisparse.ops.quant import (
        FP8KeyLayout,
        dequantize_index_keys_reference,
        quantize_index_keys_reference,
    )
    T, Hi, D, bs, topk = 64, 64, 128, 64, 2048
    layout = FP8KeyLayout(D, bs)
    for ctx in contexts:
        P = ctx // bs
        kc = torch.randn(T * P * bs, D, device="cuda").to(torch.bfloat16)
        bt = torch.arange(T * P, dtype=torch.int32, device="cuda").view(T, P)
        q = torch.randn(T, Hi, D, device="cuda").to(torch.bfloat16)
        w = torch.randn(T, Hi, device="cuda")
        req = torch.arange(T, dtype=torch.int32, device="cuda")
        pos = torch.full((T,), ctx - 1, dtype=torch.int32, device="cuda")
        t_all = timeit(lambda: indexer_topk(q, w, kc, bt, req, pos, bs, topk), reps=10)
        t_score = timeit(lambda: indexer_keys(q, w, kc, bt, req, pos, bs), reps=10)
        kbytes = T * ctx * D * 2
        res.append(dict(bench="indexer", batch=T, ctx=ctx, us=t_all * 1e6, score_us=t_score * 1e6,
                        score_gbs=kbytes / t_score / 1e9))
        if sweep:
            _sweep_indexer(res, "bf16", ctx, lambda cfg: indexer_keys(q, w, kc, bt, req, pos, bs,
                                                                     config=cfg))
        rows8 = quantize_index_keys_reference(kc)
        del kc
        k8 = layout.pages(rows8)
        deq = dequantize_index_keys_reference(rows8, D, torch.bfloat16)
        del rows8
        # same selection as the bf16 kernel over the dequantized (rotated) keys and the queries
        # as FP8-key scoring takes them (rotated; FP8 with HISPARSE_FP8_INDEXER=1; exact in
        # bf16: ops.indexer)
        qd = fp8_key_queries_reference(q).to(torch.bfloat16)
        sel8 = torch.sort(indexer_topk(q, w, k8, bt, req, pos, bs, topk), 1).values
        sel16 = torch.sort(indexer_topk(qd, w, deq, bt, req, pos, bs, topk), 1).values
        agree = (sel8 == sel16).float().mean().item()
        del deq
        t8 = timeit(lambda: indexer_keys(q, w, k8, bt, req, pos, bs), reps=10)
        t8_all = timeit(lambda: indexer_topk(q, w, k8, bt, req, pos, bs, topk), reps=10)
        res.append(dict(bench="indexer_fp8", batch=T, ctx=ctx, us=t8_all * 1e6,
                        score_us=t8 * 1e6, score_gbs=T * ctx * 132 / t8 / 1e9,
                        vs_bf16=t_score / t8, total_vs_bf16=t_all / t8_all, agree=agree))
        if sweep:
            _sweep_indexer(res, "fp8", ctx, lambda cfg: indexer_keys(q, w, k8, bt, req, pos, bs,
                                                                    config=cfg))
        print(f"indexer+topk B={T} ctx={ctx}: bf16 keys {t_all * 1e6:.0f} us "
              f"(scoring {t_score * 1e6:.0f} us, {kbytes / t_score / 1e9:.0f} GB/s of keys; "
              f"top-k {(t_all - t_score) * 1e6:.0f} us)", flush=True)
        print(f"  FP8 page-split keys (132 B): scoring {t8 * 1e6:.0f} us = {t_score / t8:.2f}x "
              f"the bf16 keys' throughput ({T * ctx * 132 / t8 / 1e9:.0f} GB/s); "
              f"indexer+topk {t8_all * 1e6:.0f} us = {t_all / t8_all:.2f}x; same selection as "
              f"bf16 over dequantized keys and queries: {agree:.4f}", flush=True)
        del k8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON file (*.json) or a directory "
                    "(bench_ops.json in it)")
    ap.add_argument("--pool-gib", type=float, default=16.0,
                    help="pinned host pool the gather rows spread over (>= 16 for issue 11)")
    ap.add_argument("--sweep", action="store_true", help="also try alternative kernel configs")
    ap.add_argument("--only", default="gather,resolver,attention,indexer")
    ap.add_argument("--attn-tokens", default="64",
                    help="tokens (decode rows) of the attention benchmark (comma-separated)")
    ap.add_argument("--attn-heads", default="16,64,128",
                    help="heads of the attention benchmark (16: one TP-8 rank of V3.2)")
    ap.add_argument("--indexer-ctx", default="8192,32768,131072",
                    help="contexts of the indexer benchmark (comma-separated)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True,
                                cwd=os.path.dirname(__file__)).stdout.strip() or "uncommitted"
    except Exception:
        commit = "uncommitted"
    meta = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), commit=commit,
                torch=torch.__version__, command=" ".join(sys.argv))
    import triton
    meta["triton"] = triton.__version__
    print(meta, flush=True)
    res = []
    only = args.only.split(",")
    if "gather" in only:
        bench_gather(res, args.sweep, args.pool_gib)
    if "resolver" in only:
        bench_resolver(res)
    if "attention" in only:
        bench_attention(res, args.sweep, [int(t) for t in args.attn_tokens.split(",")],
                        [int(h) for h in args.attn_heads.split(",")])
    if "indexer" in only:
        bench_indexer(res, args.sweep, [int(c) for c in args.indexer_ctx.split(",")])
    print_summary(res)
    if args.out:
        path = args.out
        if not path.endswith(".json"):
            os.makedirs(path, exist_ok=True)
            path = os.path.join(path, "bench_ops.json")
        elif os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(dict(meta=meta, results=res), f, indent=1)
        print(f"wrote {path}")


def print_summary(res):
    """Short table: attention vs the raw FlashMLA kernels, best gather per (row, spread)."""
    att = [r for r in res if r["bench"] == "attention"]
    if att:
        print("\nattention (T=64, K=2048): us | TFLOP/s | throughput vs raw FlashMLA (same fmt)")
        for r in sorted(att, key=lambda r: (r["H"], r["fmt"], r["backend"])):
            ratio = r.get("throughput_vs_raw")
            rel = "raw" if r["backend"] == "raw_flashmla" else (f"{ratio:.2f}x" if ratio else "-")
            print(f"  H={r['H']:>3} {r['fmt']:<4} {r['backend']:<34} {r['us']:8.1f} "
                  f"{r['tflops']:7.1f}  {rel}")
    ix = {(r["bench"], r["ctx"]): r for r in res if r["bench"] in ("indexer", "indexer_fp8")}
    if ix:
        print("\nindexer (B=64, 64 heads, D 128, page 64, top-k 2048): bf16 vs FP8 page-split keys")
        print("  ctx     | bf16 score us | fp8 score us | fp8/bf16 scoring throughput | "
              "fp8/bf16 indexer+topk | selection agreement")
        for ctx in sorted({c for _, c in ix}):
            b, f = ix.get(("indexer", ctx)), ix.get(("indexer_fp8", ctx))
            if b and f:
                print(f"  {ctx:>7} | {b['score_us']:13.0f} | {f['score_us']:12.0f} | "
                      f"{f['vs_bf16']:27.2f} | {f['total_vs_bf16']:21.2f} | {f['agree']:.4f}")
        sw = [r for r in res if r["bench"] == "indexer_score"]
        for name in ("bf16", "fp8"):
            for ctx in sorted({r["ctx"] for r in sw}):
                best = min((r for r in sw if r["keys"] == name and r["ctx"] == ctx),
                           key=lambda r: r["us"], default=None)
                if best:
                    print(f"  best {name} scoring config at {ctx}: {best['config']} "
                          f"{best['us']:.0f} us")
    g = [r for r in res if r["bench"] == "gather"]
    if g:
        print("\ngather (zero-copy, rows of 64x2048 misses): best variant per row size and spread")
        best = {}
        for r in g:
            key = (r["row_bytes"], r["spread"])
            if key not in best or r["gbs"] > best[key]["gbs"]:
                best[key] = r
        for (rb, sp), r in sorted(best.items()):
            print(f"  {rb:>5} B  spread {sp:>7}: {r['gbs']:6.1f} GB/s = {r['ratio'] * 100:5.1f}% "
                  f"of bulk H2D  [{r['variant']}]")


if __name__ == "__main__":
    main()
