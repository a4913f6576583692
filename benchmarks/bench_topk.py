"""Indexer top-k and scoring on the GPU (issue 24), per call and per step of 61 indexer layers.

Usage (repository root, CUDA):
    PYTHONPATH=. python benchmarks/bench_topk.py [--contexts 32768,131072] [--rows 8,16,32,64]
        [--score-rows 8,64] [--table-width 163840] [--out bench_topk.json]

Top-k: the old path (``torch.topk`` sorted over int64 ``(key << 32) | ~col`` keys, as
``indexer_topk`` ran it before: over the whole table width) against ``ops.topk.topk_select`` on
the same int32 keys (work follows each row's length), ``k = 2048``, every row ``ctx`` long; both
checked equal. ``old@table``: the old path over ``--table-width`` columns (``max_model_len``: the
width it really ran over), the new kernel reading the same rows. Times are per call from CUDA
graphs of 10 back-to-back calls (as the engine replays them).

Scoring: ``_indexer_triton.indexer_keys`` over FP8 page-split keys (132 B) and bf16 keys (256 B),
64 heads, D 128, page 64, one token per request (``group 1``) and MTP pairs (``group 2``: two
tokens of one request per program, keys read once for both); GB/s over the key bytes read (one
read per request) against the H200's 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_ops import timeit_graph  # noqa: E402  (the same graph-replay timer)

from hisparse.ops._indexer_triton import indexer_keys  # noqa: E402
from hisparse.ops.quant import FP8KeyLayout, quantize_index_keys_reference  # noqa: E402
from hisparse.ops.topk import (  # noqa: E402
    TopkScratch,
    orderable_keys,
    topk_select,
    topk_select_reference,
)

HBM_GBS = 4800.0
LAYERS = 61


def old_topk(packed, k):
    """The old path's top-k: sorted torch.topk over int64 keys, INT64_MIN -> -1."""
    vals, idx = torch.topk(packed, k, dim=1, largest=True, sorted=True)
    return torch.where(vals == -(2**63), torch.full_like(idx, -1), idx).to(torch.int32)


def pack(keys, lengths):
    col = torch.arange(keys.shape[1], device=keys.device)
    packed = (keys.long() << 32) | (0xFFFFFFFF - col)[None, :]
    valid = col[None, :] < lengths.long()[:, None]
    return torch.where(valid, packed, torch.full_like(packed, -(2**63)))


def _topk_case(ctx, T, table_width, k):
    g = torch.Generator(device="cuda").manual_seed(ctx + T)
    W = max(ctx, table_width)
    keys = orderable_keys(torch.randn((T, W), generator=g, device="cuda"))
    lens = torch.full((T,), ctx, dtype=torch.int32, device="cuda")
    scratch = TopkScratch(T, "cuda")
    out = torch.empty((T, k), dtype=torch.int32, device="cuda")
    got = topk_select(keys[:, :ctx], lens, k, out=out, scratch=scratch)
    assert torch.equal(got, topk_select_reference(keys[:, :ctx], lens, k)), (ctx, T)
    packed = pack(keys[:, :ctx], lens)
    packed_w = pack(keys, lens)
    t = dict(
        old=timeit_graph(lambda: old_topk(packed, k)),
        new=timeit_graph(lambda: topk_select(keys[:, :ctx], lens, k, out=out, scratch=scratch)),
        old_table=timeit_graph(lambda: old_topk(packed_w, k)),
        new_table=timeit_graph(lambda: topk_select(keys, lens, k, out=out, scratch=scratch)))
    return W, t


def bench_topk(res, contexts, rows_list, table_width, k=2048):
    print(f"\ntop-k k={k}: us per call (x{LAYERS} layers = ms per step)")
    print(f"  {'ctx':>7} {'rows':>4} | {'old':>8} {'new':>8} {'new/old':>7} | "
          f"{'old@table':>9} {'new/old@table':>13} | step ms old@table -> new")
    for ctx in contexts:
        for T in rows_list:
            W, t = _topk_case(ctx, T, table_width, k)
            res.append(dict(bench="topk", ctx=ctx, rows=T, k=k, table_width=W,
                            **{f"{n}_us": v * 1e6 for n, v in t.items()}))
            print(f"  {ctx:>7} {T:>4} | {t['old'] * 1e6:8.1f} {t['new'] * 1e6:8.1f} "
                  f"{t['new'] / t['old']:7.3f} | {t['old_table'] * 1e6:9.1f} "
                  f"{t['new_table'] / t['old_table']:13.3f} | "
                  f"{t['old_table'] * LAYERS * 1e3:.2f} -> {t['new_table'] * LAYERS * 1e3:.2f}",
                  flush=True)


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--rows", default="8,16,32,64", help="top-k rows (requests)")
    ap.add_argument("--score-rows", default="8,64", help="scoring tokens")
    ap.add_argument("--table-width", type=int, default=163840,
                    help="the old path's width (max_model_len); 0: each context's own")
    ap.add_argument("--only", default="topk,scoring", help="topk, scoring, sweep (scoring "
                    "configs at the first context and the last --score-rows)")
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    res = []
    if "topk" in args.only:
        bench_topk(res, contexts, rows, args.table_width)
    if "scoring" in args.only:
        bench_scoring(res, contexts, [int(r) for r in args.score_rows.split(",")])
    if "sweep" in args.only:
        sweep_scoring(res, contexts[0], int(args.score_rows.split(",")[-1]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), command=" ".join(sys.argv),
                           results=res), f, indent=1)


if __name__ == "__main__":
    main()
