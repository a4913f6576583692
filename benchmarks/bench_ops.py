"""Data-plane kernel benchmarks (H200): miss gather vs bulk H2D, resolver, attention vs FlashMLA,
indexer + top-k. Usage: python benchmarks/bench_ops.py [--out DIR] [--quick] [--sweep]

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


def bench_gather(res, sweep):
    from hisparse.ops._copy_triton import copy_rows_triton
    pool_bytes = 2 << 30
    pool = torch.empty(pool_bytes, dtype=torch.uint8).pin_memory()
    pool.view(torch.int32)[:: 1024].fill_(1)
    n_rows = 64 * 2048
    for row_bytes in (1152, 656):
        nbytes = n_rows * row_bytes
        src_bulk = pool[:nbytes]
        dst_bulk = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t_bulk = timeit(lambda: dst_bulk.copy_(src_bulk, non_blocking=True))
        host = pool[: (pool_bytes // row_bytes) * row_bytes].view(-1, row_bytes)
        for spread_name, span in (("512MiB", (512 << 20) // row_bytes), ("2GiB", host.shape[0])):
            rows = torch.randint(0, span, (n_rows,), device="cuda")
            dst = torch.empty(n_rows, row_bytes, dtype=torch.uint8, device="cuda")
            src3 = host.view(1, -1, row_bytes)
            dst3 = dst.view(1, n_rows, row_bytes)
            configs = [(1024, 4)]
            if sweep:
                configs += [(256, 4), (2048, 8), (1024, 8), (4096, 16), (8192, 16)]
            best = None
            for bc, nw in configs:
                t = timeit(lambda: copy_rows_triton(src3, dst3, rows, None, block_c=bc, num_warps=nw))
                gbs = nbytes / t / 1e9
                res.append(dict(bench="gather", row_bytes=row_bytes, spread=spread_name,
                                block_c=bc, num_warps=nw, gbs=gbs, bulk_gbs=nbytes / t_bulk / 1e9,
                                ratio=t_bulk / t))
                if best is None or gbs > best[0]:
                    best = (gbs, bc, nw)
            assert torch.equal(dst[:64].cpu(), host[rows[:64].cpu()])
            print(f"gather {row_bytes}B spread {spread_name}: best {best[0]:.1f} GB/s "
                  f"(block_c={best[1]}, warps={best[2]}) vs bulk H2D {nbytes / t_bulk / 1e9:.1f} GB/s "
                  f"= {best[0] / (nbytes / t_bulk / 1e9) * 100:.0f}%", flush=True)
    # hypothesis check: 656-B rows placed at a 128-B aligned stride (768 B)
    n_rows = 64 * 2048
    host768 = pool[: (pool_bytes // 768) * 768].view(-1, 768)[: (512 << 20) // 768, :656]
    rows = torch.randint(0, host768.shape[0], (n_rows,), device="cuda")
    dst = torch.empty(n_rows, 656, dtype=torch.uint8, device="cuda")
    t = timeit(lambda: copy_rows_triton(host768.unsqueeze(0), dst.unsqueeze(0), rows, None))
    src_bulk = pool[: n_rows * 656]
    dst_bulk = torch.empty(n_rows * 656, dtype=torch.uint8, device="cuda")
    t_bulk = timeit(lambda: dst_bulk.copy_(src_bulk, non_blocking=True))
    gbs = n_rows * 656 / t / 1e9
    res.append(dict(bench="gather", row_bytes=656, spread="512MiB", stride=768, gbs=gbs,
                    bulk_gbs=n_rows * 656 / t_bulk / 1e9, ratio=t_bulk / t))
    print(f"gather 656B rows at 768-B stride, spread 512MiB: {gbs:.1f} GB/s = {t_bulk / t * 100:.0f}% of bulk",
          flush=True)
    del pool


def bench_resolver(res):
    R, K, H, bs = 64, 2048, 4096, 64
    ctx = 32 * 1024
    P = ctx // bs
    HB = H // bs
    n_blocks = R * HB + 16
    arena = torch.randn(n_blocks * bs, 576, device="cuda").to(torch.bfloat16)
    host = torch.randn(R * P * bs, 576).to(torch.bfloat16).pin_memory()
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
            perm = torch.argsort(torch.rand(R, ctx, device="cuda", generator=g), dim=1).to(torch.int32)
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
            miss_bytes = miss_rate * R * K * 1152
            res.append(dict(bench="resolver", mode=mode, batch=R, topk=K, hot=H, miss_frac=frac,
                            us=t * 1e6, measured_miss_rate=miss_rate,
                            miss_gbs=(miss_bytes / t / 1e9) if frac else None))
            print(f"resolver[{mode}] B={R} K={K} H={H} misses {frac * 100:.0f}% (measured "
                  f"{miss_rate * 100:.1f}%): {t * 1e6:.1f} us"
                  + (f", {miss_bytes / t / 1e9:.1f} GB/s of missed rows" if frac else ""), flush=True)


def bench_attention(res, sweep):
    from hisparse.ops._attention_triton import sparse_mla_attention_triton
    T, K = 64, 2048
    N = 64 * 4096
    kv = torch.randn(N, 576, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, N, (T, K), dtype=torch.int32, device="cuda")
    scale = 576 ** -0.5
    for H in (16, 128):
        q = torch.randn(T, H, 576, device="cuda").to(torch.bfloat16)
        flops = T * H * K * (576 + 512) * 2
        nbytes = T * K * 576 * 2 + q.numel() * 2 + T * H * 512 * 2
        configs = [None]
        if sweep:
            if H <= 16:
                configs += [(16, 32, 512, 4, 2, 8), (16, 64, 512, 4, 2, 16)]
            else:
                configs += [(64, 64, 512, 8, 2, 1), (64, 64, 512, 8, 2, 2), (64, 64, 512, 8, 1, 1),
                            (64, 32, 512, 4, 2, 1), (64, 64, 512, 4, 2, 1)]
        best = None
        for cfg in configs:
            try:
                t = timeit(lambda: sparse_mla_attention_triton(q, kv, idx, scale, config=cfg))
            except Exception as e:  # a config that does not compile (e.g. shared memory)
                print(f"  attention H={H} config {cfg}: failed {type(e).__name__}: {str(e)[:100]}")
                continue
            res.append(dict(bench="attention", backend="triton", H=H, config=str(cfg),
                            us=t * 1e6, tflops=flops / t / 1e12, gbs=nbytes / t / 1e9))
            if sweep:
                print(f"  attention triton H={H} config {cfg}: {t * 1e6:.1f} us", flush=True)
            if best is None or t < best[0]:
                best = (t, cfg)
        t_tr = best[0]
        line = (f"attention T={T} H={H} K={K}: triton {t_tr * 1e6:.1f} us "
                f"({flops / t_tr / 1e12:.1f} TFLOP/s, {nbytes / t_tr / 1e9:.0f} GB/s, cfg {best[1]})")
        if flashmla_available():
            try:
                t_fm = timeit(lambda: sparse_mla_attention(q, kv, idx, scale, backend="flashmla"))
                o1, l1 = sparse_mla_attention(q, kv, idx, scale, backend="flashmla")
                o2, l2 = sparse_mla_attention_triton(q, kv, idx, scale, config=best[1])
                err = (o1.float() - o2.float()).abs().max().item()
                res.append(dict(bench="attention", backend="flashmla", H=H, us=t_fm * 1e6,
                                tflops=flops / t_fm / 1e12, gbs=nbytes / t_fm / 1e9,
                                triton_over_flashmla=t_fm / t_tr, max_abs_diff=err))
                line += (f" | flashmla {t_fm * 1e6:.1f} us ({flops / t_fm / 1e12:.1f} TFLOP/s) "
                         f"| triton/flashmla throughput {t_fm / t_tr:.2f}x | max|diff| {err:.3g}")
            except Exception as e:
                line += f" | flashmla failed: {type(e).__name__}: {str(e)[:200]}"
        else:
            line += " | flashmla not importable"
        print(line, flush=True)


def bench_indexer(res, sweep):
    from hisparse.ops._indexer_triton import indexer_keys
    T, Hi, D, bs, topk = 64, 64, 128, 64, 2048
    for ctx in (8192, 32768, 131072):
        P = ctx // bs
        kc = torch.randn(T * P * bs, D, device="cuda").to(torch.bfloat16)
        bt = torch.arange(T * P, dtype=torch.int32, device="cuda").view(T, P)
        q = torch.randn(T, Hi, D, device="cuda").to(torch.bfloat16)
        w = torch.randn(T, Hi, device="cuda")
        req = torch.arange(T, dtype=torch.int32, device="cuda")
        pos = torch.full((T,), ctx - 1, dtype=torch.int32, device="cuda")
        t_all = timeit(lambda: indexer_topk(q, w, kc, bt, req, pos, bs, topk), reps=10)
        t_score = timeit(lambda: indexer_keys(q, w, kc, bt, req, pos, bs), reps=10)
        if sweep:
            for cfg in [(64, 1, 4), (64, 8, 4), (128, 4, 8), (128, 2, 4), (32, 8, 4)]:
                tc = timeit(lambda: indexer_keys(q, w, kc, bt, req, pos, bs, config=cfg), reps=10)
                print(f"  indexer scoring ctx={ctx} config {cfg}: {tc * 1e6:.0f} us", flush=True)
                res.append(dict(bench="indexer_score", ctx=ctx, config=str(cfg), us=tc * 1e6))
        kbytes = T * ctx * D * 2
        res.append(dict(bench="indexer", batch=T, ctx=ctx, us=t_all * 1e6, score_us=t_score * 1e6,
                        score_gbs=kbytes / t_score / 1e9))
        print(f"indexer+topk B={T} ctx={ctx}: {t_all * 1e6:.0f} us (scoring {t_score * 1e6:.0f} us, "
              f"{kbytes / t_score / 1e9:.0f} GB/s of keys; top-k {(t_all - t_score) * 1e6:.0f} us)",
              flush=True)
        del kc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="also try alternative kernel configs")
    ap.add_argument("--only", default="gather,resolver,attention,indexer")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip() or "uncommitted"
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
        bench_gather(res, args.sweep)
    if "resolver" in only:
        bench_resolver(res)
    if "attention" in only:
        bench_attention(res, args.sweep)
    if "indexer" in only:
        bench_indexer(res, args.sweep)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_ops.json"), "w") as f:
            json.dump(dict(meta=meta, results=res), f, indent=1)


if __name__ == "__main__":
    main()
