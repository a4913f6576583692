"""Indexer top-k and scoring on the GPU (issue 24), per call and per step of 61 indexer layers.

Usage (repository root, CUDA):
    PYTHONPATH=. python benchmarks/bench_topk.py [--only topk,topk-sweep,wide,sparse,short,
        order,scoring,sweep] [--sparse 0,16,64,256] [--short 4096,8192]
        [--topk-shapes 32768x8x2048,...] [--sweep-shapes 32768x8x2048,...]
        [--contexts 32768,131072] [--score-rows 8,64] [--table-width 163840]
        [--row-extra 0] [--out FILE]

Top-k (``--only topk``): per shape ``ctx x rows x k`` (every row ``ctx`` long), the old path
(``torch.topk`` sorted over int64 ``(key << 32) | ~col`` keys, as ``indexer_topk`` ran it before
the radix select: ``torch`` over the row's length, ``torch@W`` over ``--table-width`` columns,
the width it really ran over) against ``ops.topk.topk_select`` under each ``HISPARSE_TOPK``
mode (``legacy``: the former radix select's launches; ``phased``; ``fused``) and the fused
launch in column order (``ranked=False``: what the engine runs in a forward that selects no
band), all
checked equal to the reference. ``--only topk-sweep``: the fused launch's ``TopkLaunch`` hints
at a few shapes (pick the default from it). ``--only wide``: the fused launch over the whole
``--table-width`` (as an engine's graph launches it over ``max_model_len``) with rows ``ctx +
--row-extra`` long, at 2-4 programs an SM. Times are per call from CUDA graphs of 10
back-to-back calls (as the engine replays them).

Scoring: ``_indexer_triton.indexer_keys`` over FP8 page-split keys (132 B) and bf16 keys (256 B),
64 heads, D 128, page 64, one token per request (``group 1``) and MTP pairs (``group 2``: two
tokens of one request per program, keys read once for both); GB/s over the key bytes read (one
read per request) against the device's spec HBM bandwidth (``SPEC_HBM_GBS``: the H200's 4.8
TB/s, the H100 SXM's 3.35).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_ops import timeit_graph  # noqa: E402  (the same graph-replay timer)

from hisparse.ops import switches  # noqa: E402
from hisparse.ops._indexer_triton import indexer_keys  # noqa: E402
from hisparse.ops.quant import FP8KeyLayout, quantize_index_keys_reference  # noqa: E402
from hisparse.ops.topk import (  # noqa: E402
    CUDA_BLOCK,
    TopkLaunch,
    TopkScratch,
    orderable_keys,
    topk_select,
    topk_select_reference,
)

# spec HBM bandwidth by device name (GB/s): the fractions printed are of the device's own
SPEC_HBM_GBS = {"H200": 4800.0, "H100 80GB HBM3": 3350.0}
HBM_GBS = 4800.0        # set from the device in main()
LAYERS = 61


def spec_hbm_gbs(device_name: str) -> float:
    """The spec HBM bandwidth of ``device_name`` (the first name of SPEC_HBM_GBS it contains);
    the H200's where none matches."""
    for name, gbs in SPEC_HBM_GBS.items():
        if name in device_name:
            return gbs
    return SPEC_HBM_GBS["H200"]


def old_topk(packed, k):
    """The old path's top-k: sorted torch.topk over int64 keys, INT64_MIN -> -1."""
    vals, idx = torch.topk(packed, k, dim=1, largest=True, sorted=True)
    return torch.where(vals == -(2**63), torch.full_like(idx, -1), idx).to(torch.int32)


def pack(keys, lengths):
    col = torch.arange(keys.shape[1], device=keys.device)
    packed = (keys.long() << 32) | (0xFFFFFFFF - col)[None, :]
    valid = col[None, :] < lengths.long()[:, None]
    return torch.where(valid, packed, torch.full_like(packed, -(2**63)))


MODES = ("legacy", "phased", "fused")


def _timed_select(keys, lens, k, out, scratch, mode, launch=None, ranked=True):
    """Graph-replay time of ``topk_select`` under ``HISPARSE_TOPK=mode`` (captured and
    replayed inside the override)."""
    with switches.override(topk=mode):
        return timeit_graph(lambda: topk_select(keys, lens, k, out=out, scratch=scratch,
                                                launch=launch, ranked=ranked))


def _topk_inputs(ctx, T, W):
    g = torch.Generator(device="cuda").manual_seed(ctx + T)
    keys = orderable_keys(torch.randn((T, W), generator=g, device="cuda"))
    lens = torch.full((T,), ctx, dtype=torch.int32, device="cuda")
    return keys, lens


def _topk_case(ctx, T, table_width, k):
    W = max(ctx, table_width)
    keys, lens = _topk_inputs(ctx, T, W)
    scratch = TopkScratch(T, "cuda")
    out = torch.empty((T, k), dtype=torch.int32, device="cuda")
    want = topk_select_reference(keys[:, :ctx], lens, k)
    t = {}
    for mode in MODES:
        t[mode] = _timed_select(keys[:, :ctx], lens, k, out, scratch, mode)
        assert torch.equal(out, want), (ctx, T, k, mode)       # the last replay's result
    t["columns"] = _timed_select(keys[:, :ctx], lens, k, out, scratch, "fused", ranked=False)
    assert torch.equal(out, topk_select_reference(keys[:, :ctx], lens, k, ranked=False))
    assert scratch.stalls.item() == 0, "a fused launch's row barrier gave up waiting"
    packed, packed_w = pack(keys[:, :ctx], lens), pack(keys, lens)
    t["torch"] = timeit_graph(lambda: old_topk(packed, k))
    t["torch_table"] = timeit_graph(lambda: old_topk(packed_w, k))
    return W, t


SHAPES = ((32768, 8, 2048), (32768, 16, 2048), (32768, 24, 2048), (32768, 48, 2048),
          (32768, 64, 2048), (131072, 8, 2048), (32768, 24, 4096), (2304, 96, 2048),
          (2112, 96, 2048))


def bench_topk(res, shapes, table_width):
    print(f"\ntop-k: us per call (graph replay), x{LAYERS} layers = ms per step. torch: "
          f"torch.topk over the row's length; torch@W: over the table width (the issue's "
          f"baseline); legacy: the former radix select (HISPARSE_TOPK=legacy); phased / fused: "
          f"the new phases, one launch each / one launch; cols: fused, ranked=False (column "
          f"order, no ranking); bw: row bytes / fused time / {HBM_GBS / 1000:.1f} TB/s")
    print(f"  {'ctx':>6} {'rows':>4} {'k':>4} | {'torch':>7} {'torch@W':>7} {'legacy':>7} "
          f"{'phased':>7} {'fused':>7} {'cols':>7} | {'f/torch@W':>9} {'c/torch@W':>9} "
          f"{'f/legacy':>8} {'bw':>5} | step ms legacy -> fused -> cols")
    for ctx, T, k in shapes:
        W, t = _topk_case(ctx, T, table_width, k)
        bw = T * ctx * 4 / t["fused"] / 1e9 / HBM_GBS
        res.append(dict(bench="topk", ctx=ctx, rows=T, k=k, table_width=W, hbm_fraction=bw,
                        **{f"{n}_us": v * 1e6 for n, v in t.items()}))
        print(f"  {ctx:>6} {T:>4} {k:>4} | {t['torch'] * 1e6:7.1f} {t['torch_table'] * 1e6:7.1f} "
              f"{t['legacy'] * 1e6:7.1f} {t['phased'] * 1e6:7.1f} {t['fused'] * 1e6:7.1f} "
              f"{t['columns'] * 1e6:7.1f} | {t['fused'] / t['torch_table']:9.3f} "
              f"{t['columns'] / t['torch_table']:9.3f} {t['fused'] / t['legacy']:8.3f} "
              f"{bw:5.3f} | {t['legacy'] * LAYERS * 1e3:.2f} -> {t['fused'] * LAYERS * 1e3:.2f}"
              f" -> {t['columns'] * LAYERS * 1e3:.2f}", flush=True)


def bench_order(res, shapes):
    """What ``HISPARSE_TOPK_ORDER=positions`` adds to a host-read forward of a band policy:
    the ranked top ``k + band`` (band = k, as ``score``'s), then its first ``k`` in column order
    by ``column_order``: counted over a bitmap in the key buffer (the engine's, in place), one
    Triton sort a row, or torch (``column_order_reference``, five kernels), against the ``k``
    selected in column order alone (what a forward without host reads runs)."""
    from hisparse.ops.topk import column_order, column_order_reference

    print(f"\norder: us per call (graph replay), x{LAYERS} layers = ms per step. ranked: fused "
          f"top-(k+band), band = k; then column_order: count (bitmap, in place) / sort "
          f"(Triton) / torch; cols: the k in column order alone")
    print(f"  {'ctx':>6} {'rows':>4} {'k':>4} | {'ranked':>7} {'count':>6} {'sort':>6} "
          f"{'torch':>6} {'cols':>7} | step ms ranked+count (+sort) vs cols")
    for ctx, T, k in shapes:
        keys, lens = _topk_inputs(ctx, T, ctx)
        scratch = TopkScratch(T, "cuda")
        sel = torch.empty((T, 2 * k), dtype=torch.int32, device="cuda")
        cols = torch.empty((T, k), dtype=torch.int32, device="cuda")
        t = {"ranked": _timed_select(keys, lens, 2 * k, sel, scratch, "fused")}
        top = sel[:, :k]
        want = topk_select_reference(keys, lens, k, ranked=False)
        assert torch.equal(column_order(top), want) and torch.equal(
            column_order_reference(top), want), (ctx, T, k)
        bits = torch.empty_like(keys)   # as the engine's: a key buffer's rows
        work = top.clone()
        assert torch.equal(column_order(work, work, bits, ctx), want), (ctx, T, k)
        t["count"] = timeit_graph(lambda a=(top, work, bits, ctx): column_order(*a))
        t["sort"] = timeit_graph(lambda top=top: column_order(top))
        t["sort_torch"] = timeit_graph(lambda top=top: column_order_reference(top))
        t["cols"] = _timed_select(keys, lens, k, cols, scratch, "fused", ranked=False)
        res.append(dict(bench="order", ctx=ctx, rows=T, k=k, **{f"{n}_us": v * 1e6
                                                                for n, v in t.items()}))
        u = {n: v * 1e6 for n, v in t.items()}
        print(f"  {ctx:>6} {T:>4} {k:>4} | {u['ranked']:7.1f} {u['count']:6.1f} "
              f"{u['sort']:6.1f} {u['sort_torch']:6.1f} {u['cols']:7.1f} | "
              f"{(t['ranked'] + t['count']) * LAYERS * 1e3:.2f} "
              f"({(t['ranked'] + t['sort']) * LAYERS * 1e3:.2f}) vs "
              f"{t['cols'] * LAYERS * 1e3:.2f}", flush=True)


SWEEP = (TopkLaunch(), TopkLaunch(per_sm=2), TopkLaunch(sort_chunk=128), TopkLaunch(sort_chunk=512),
         TopkLaunch(per_sm=1), TopkLaunch(per_sm=4), TopkLaunch(warps=8),
         TopkLaunch(block=512), TopkLaunch(block=2048), TopkLaunch(per_sm=1, block=2048),
         TopkLaunch(stages=3), TopkLaunch(stages=4), TopkLaunch(per_sm=4, stages=3))


def sweep_topk(res, shapes):
    """The fused launch's hints (``TopkLaunch``) at a few shapes, ranked and in column order,
    us per call; the default first (``*``: the fastest of a shape and order)."""
    print("\ntop-k fused launch sweep (TopkLaunch: sort_chunk / per_sm / warps / block / "
          "stages), us")
    names = [f"{c.sort_chunk}/{c.per_sm or 'auto'}/{c.warps}/{c.block or CUDA_BLOCK}/{c.stages}"
             for c in SWEEP]
    print(f"  {'ctx':>6} {'rows':>4} {'k':>4} {'ord':>4} | " + " ".join(f"{n:>13}" for n in names))
    for ctx, T, k in shapes:
        keys, lens = _topk_inputs(ctx, T, ctx)
        scratch = TopkScratch(T, "cuda")
        out = torch.empty((T, k), dtype=torch.int32, device="cuda")
        for ranked in (True, False):    # the ranking's launch, then the column order's
            want = topk_select_reference(keys, lens, k, ranked=ranked)
            ts = []
            for cfg in SWEEP:
                ts.append(_timed_select(keys, lens, k, out, scratch, "fused", cfg, ranked))
                assert torch.equal(out, want) and scratch.stalls.item() == 0, (ctx, T, k, cfg)
                res.append(dict(bench="topk_sweep", ctx=ctx, rows=T, k=k, ranked=ranked,
                                config=dataclasses.asdict(cfg), us=ts[-1] * 1e6))
            best = min(ts)
            print(f"  {ctx:>6} {T:>4} {k:>4} {'rank' if ranked else 'cols'} | " + " ".join(
                f"{t * 1e6:12.1f}{'*' if t == best else ' '}" for t in ts), flush=True)


def _wide_inputs(ctx, T, k, table_width, row_extra):
    """A ``T``-row table ``max(table_width, ctx + row_extra)`` wide of randn keys, rows ``ctx +
    row_extra`` long, its scratch and output, and ``torch.topk``'s time over the width:
    ``(W, keys, lens, scratch, out, torch_us)``."""
    W = max(table_width, ctx + row_extra)
    keys, _ = _topk_inputs(ctx, T, W)
    lens = torch.full((T,), ctx + row_extra, dtype=torch.int32, device="cuda")
    scratch = TopkScratch(T, "cuda")
    out = torch.empty((T, k), dtype=torch.int32, device="cuda")
    packed = pack(keys, lens)
    return W, keys, lens, scratch, out, timeit_graph(lambda: old_topk(packed, k))


def bench_wide(res, shapes, table_width, row_extra):
    """The fused launch over the whole table (``--table-width`` columns: a CUDA graph's
    ``max_model_len``), its rows ``ctx + row_extra`` long, as the engine launches it: 2, 3
    and 4 programs an SM, both orders, against ``torch.topk`` over the width; each row of
    JSON also names the default's pick (``_topk_triton._per_sm``, which sees the width, not
    the lengths)."""
    from hisparse.ops import _topk_triton as tk

    sms = tk._num_sms(torch.cuda.current_device())

    def pick(T, W, scratch):
        return dict(pick=tk._per_sm(T, W, sms, TopkLaunch(block=CUDA_BLOCK),
                                    scratch.split_hist.shape[0]))

    bench_variants(res, shapes, table_width, row_extra,
                   {f"per_sm{p}": TopkLaunch(per_sm=p) for p in (2, 3, 4)}, (False, True),
                   "topk_wide", extra=pick)


def bench_variants(res, shapes, table_width, row_extra, variants, orders, bench, extra=None):
    """The fused launch under each named ``TopkLaunch`` of ``variants`` (``best/1st``: against
    the first) over the whole ``--table-width`` table, rows ``ctx + row_extra`` long, in each
    of ``orders`` (``ranked`` values), against ``torch.topk`` over the width; rows of JSON
    ``bench``, each with ``extra(rows, width, scratch)``'s items (printed after the shape)."""
    names = list(variants)
    print(f"\ntop-k, {bench}: us per call (graph replay), {table_width}-column table, rows ctx "
          f"+ {row_extra}")
    print(f"  {'ctx':>6} {'rows':>4} {'k':>4} {'ord':>4} | " + " ".join(f"{n:>8}" for n in names)
          + f" | {'torch@W':>7} {'best/1st':>8} {'best/t@W':>8}")
    for ctx, T, k in shapes:
        W, keys, lens, scratch, out, t_w = _wide_inputs(ctx, T, k, table_width, row_extra)
        more = extra(T, W, scratch) if extra else {}
        for ranked in orders:
            want = topk_select_reference(keys, lens, k, ranked=ranked)
            t = {}
            for name, launch in variants.items():
                t[name] = _timed_select(keys, lens, k, out, scratch, "fused", launch, ranked)
                assert torch.equal(out, want), (ctx, T, k, name, ranked)
            assert scratch.stalls.item() == 0
            res.append(dict(bench=bench, ctx=ctx, row_len=ctx + row_extra, rows=T, k=k,
                            table_width=W, ranked=ranked, torch_table_us=t_w * 1e6, **more,
                            **{f"{n}_us": v * 1e6 for n, v in t.items()}))
            best = min(t.values())
            print(f"  {ctx:>6} {T:>4} {k:>4} {'rank' if ranked else 'cols'} | "
                  + " ".join(f"{t[n] * 1e6:8.1f}" for n in names)
                  + f" | {t_w * 1e6:7.1f} {best / t[names[0]]:8.3f} {best / t_w:8.3f}"
                  + "".join(f" {key}={v}" for key, v in more.items()), flush=True)


def _score_case(ctx, T, group, bs, Hi, D, configs=(None,), kinds=("fp8", "bf16")):
    """(keys name, config, us, bytes of keys read) for FP8 and bf16 keys and each
    ``indexer_keys`` config (``None``: the default; else ``(BLOCK_S, programs per SM, warps,
    stages)``)."""
    layout = FP8KeyLayout(D, bs)
    R = T // group
    P = ctx // bs
    kc = torch.randn(R * P * bs, D, device="cuda").to(torch.bfloat16)
    bt = torch.randperm(R * P, device="cuda").view(R, P).to(torch.int32)
    q = torch.randn(T, Hi, D, device="cuda").to(torch.bfloat16)
    w = torch.randn(T, Hi, device="cuda")
    req = (torch.arange(T, device="cuda") // group).to(torch.int32)
    pos = torch.full((T,), ctx - 1, dtype=torch.int32, device="cuda")
    pos -= (group - 1 - torch.arange(T, device="cuda") % group).int()
    keys = torch.empty((T, ctx), dtype=torch.int32, device="cuda")
    lens = torch.empty(T, dtype=torch.int32, device="cuda")
    k8 = layout.pages(quantize_index_keys_reference(kc))
    rows = []
    for name, cache, kb in (("fp8", k8, layout.key_bytes), ("bf16", kc, 2 * D)):
        if name not in kinds:
            continue
        for cfg in configs:
            try:
                t = timeit_graph(lambda c=cache, cfg=cfg: indexer_keys(
                    q, w, c, bt, req, pos, bs, out=keys, lengths=lens, group=group, config=cfg))
            except Exception as e:      # a swept config may not fit (registers, shared memory)
                if cfg is None:
                    raise
                print(f"  config {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            rows.append((name, cfg, t, R * ctx * kb))
    return rows


def sweep_scoring(res, ctx, T, bs=64, Hi=64, D=128):
    """FP8 scoring at one shape over a grid of kernel configs, fastest first."""
    grid = [(s, p, w, st) for s in (64, 128, 256) for p in (4, 8, 16) for w in (4, 8)
            for st in (2, 3)]
    rows = _score_case(ctx, T, 1, bs, Hi, D, configs=[None] + grid, kinds=("fp8",))
    print(f"\nscoring config sweep, FP8 keys, ctx {ctx}, {T} tokens (BLOCK_S, per SM, warps, "
          f"stages): us, fraction of {HBM_GBS / 1000:.1f} TB/s")
    for name, cfg, t, nbytes in sorted(rows, key=lambda r: r[2]):
        gbs = nbytes / t / 1e9
        res.append(dict(bench="scoring_sweep", ctx=ctx, tokens=T, keys=name,
                        config=cfg, us=t * 1e6, gbs=gbs, hbm_fraction=gbs / HBM_GBS))
        print(f"  {str(cfg or 'default'):>18} {t * 1e6:8.1f} {gbs / HBM_GBS:6.2f}", flush=True)


def bench_scoring(res, contexts, rows_list, bs=64, Hi=64, D=128):
    print(f"\nindexer scoring ({Hi} heads, D {D}, page {bs}): us, GB/s of keys read, "
          f"fraction of {HBM_GBS / 1000:.1f} TB/s")
    print(f"  {'ctx':>7} {'tokens':>6} {'group':>5} {'keys':>4} | {'us':>8} {'GB/s':>7} "
          f"{'of HBM':>6}")
    for ctx in contexts:
        for T in rows_list:
            for group in (1, 2):
                for name, _, t, nbytes in _score_case(ctx, T, group, bs, Hi, D):
                    gbs = nbytes / t / 1e9
                    res.append(dict(bench="scoring", ctx=ctx, tokens=T, group=group, keys=name,
                                    us=t * 1e6, gbs=gbs, hbm_fraction=gbs / HBM_GBS))
                    print(f"  {ctx:>7} {T:>6} {group:>5} {name:>4} | {t * 1e6:8.1f} "
                          f"{gbs:7.0f} {gbs / HBM_GBS:6.2f}", flush=True)


def _shapes(text):
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,131072", help="scoring contexts")
    ap.add_argument("--topk-shapes", default=",".join(f"{c}x{t}x{k}" for c, t, k in SHAPES),
                    help="top-k shapes ctx x rows x k")
    ap.add_argument("--sweep-shapes",
                    default="32768x8x2048,32768x24x2048,32768x64x2048,131072x8x2048",
                    help="top-k sweep shapes (--only topk-sweep)")
    ap.add_argument("--score-rows", default="8,64", help="scoring tokens")
    ap.add_argument("--table-width", type=int, default=163840,
                    help="the old path's width (max_model_len); 0: each context's own")
    ap.add_argument("--row-extra", type=int, default=0,
                    help="--only wide, sparse, short: rows ctx + this long (a decode's rows past "
                         "the prompt)")
    ap.add_argument("--sparse", default="0,16,64,256",
                    help="--only sparse: TopkLaunch.sparse values (0 first: the baseline)")
    ap.add_argument("--short", default="4096,8192",
                    help="--only short: TopkLaunch.short_rows values (against the default)")
    ap.add_argument("--only", default="topk,scoring", help="topk, topk-sweep (the fused "
                    "top-k's launch hints), wide (the fused launch over --table-width "
                    "columns at 2-4 programs an SM), sparse (TopkLaunch.sparse values over "
                    "--table-width columns), short (TopkLaunch.short_rows values, column "
                    "order), order (positions' ranked top k + band "
                    "then its sort, at --topk-shapes), scoring, sweep (scoring configs at the "
                    "first context and the last --score-rows)")
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    global HBM_GBS
    HBM_GBS = spec_hbm_gbs(torch.cuda.get_device_name())
    contexts = [int(c) for c in args.contexts.split(",")]
    only = args.only.split(",")
    res = []
    if "topk" in only:
        bench_topk(res, _shapes(args.topk_shapes), args.table_width)
    if "wide" in only:
        bench_wide(res, _shapes(args.topk_shapes), args.table_width, args.row_extra)
    if "sparse" in only:    # later digits' sparse blocks by atomics, both orders
        bench_variants(res, _shapes(args.topk_shapes), args.table_width, args.row_extra,
                       {f"sparse{n}": TopkLaunch(sparse=int(n)) for n in args.sparse.split(",")},
                       (False, True), "topk_sparse")
    if "short" in only:     # short rows by one program a row, column order
        bench_variants(res, _shapes(args.topk_shapes), args.table_width, args.row_extra,
                       {"default": TopkLaunch()} | {f"short{n}": TopkLaunch(short_rows=int(n))
                                                    for n in args.short.split(",")},
                       (False,), "topk_short")
    if "topk-sweep" in only:
        sweep_topk(res, _shapes(args.sweep_shapes))
    if "order" in only:
        bench_order(res, _shapes(args.topk_shapes))
    if "scoring" in only:
        bench_scoring(res, contexts, [int(r) for r in args.score_rows.split(",")])
    if "sweep" in only:
        sweep_scoring(res, contexts[0], int(args.score_rows.split(",")[-1]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), command=" ".join(sys.argv),
                           results=res), f, indent=1)


if __name__ == "__main__":
    main()
