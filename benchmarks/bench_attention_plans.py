"""Sparse MLA attention launch plans on the GPU (FP8 rows, top-k 2048): the Triton kernels under
batch-invariant plans (``AttnConfig``: chunks of ``k_per_split`` indices, fixed per head count)
against the former batch-dependent pick (split count grown until ~2 programs per SM, emulated
here as ``former``) and FlashMLA's FP8 decode (heads padded to 64 at allocation), each timed
inside CUDA graphs (``bench_ops.timeit_graph``). 16 heads: every plan of a small grid; 64/128
heads: chunk sizes 256-1024. Indices: uniform over a 262,144-row pool (default), or with
``--context C`` as a decode step reads them, each token its own ``C`` rows (a request's pages,
contiguous) of which it selects 2048 distinct ones in random order (the pool is then T x C rows:
516 MB a layer at 24 x 32k, past the L2 as in the real rank).

Usage (repository root, CUDA): ``PYTHONPATH=. python benchmarks/bench_attention_plans.py
[--shapes 16x8,16x24,16x42,16x96,64x8,64x64,128x8,128x64] [--context 32768] [--plans 64/4/2/64,...]
[--out plans.json]``
(~70 s)
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ops import _raw_flashmla, timeit_graph  # noqa: E402

from hisparse.ops import quantize_mla_rows_reference  # noqa: E402
from hisparse.ops._attention_triton import (  # noqa: E402
    AttnConfig,
    attn_config,
    sparse_mla_attention_fp8_triton,
    sparse_mla_attention_triton,
)

K, N = 2048, 64 * 4096


def former_config(T: int, H: int) -> AttnConfig:
    """The pick before batch invariance: splits doubled while T x head blocks x splits stayed
    under 2 (1 at 64+ heads) programs per SM of 132 and chunks kept >= 256 indices."""
    bh, bn, nw, ns = (16, 32, 4, 2) if H <= 16 else (32, 64, 8, 2) if H <= 32 else (64, 64, 8, 2)
    programs, target, splits = T * triton.cdiv(H, bh), (2 if bh <= 32 else 1) * 132, 1
    while programs * splits < target and K // (splits * 2) >= 256 and splits < 16:
        splits *= 2
    return AttnConfig(bh, bn, nw, ns, triton.cdiv(triton.cdiv(K, splits), bn) * bn)


def plans(H: int, only: str | None = None) -> list[AttnConfig]:
    """The grid timed at ``H`` heads, or ``only``'s plans (``"bn/warps/stages/kps,..."``, the
    names the table prints)."""
    if only:
        bh = 16 if H <= 16 else 32 if H <= 32 else 64
        return [AttnConfig(bh, *(int(v) for v in p.split("/"))) for p in only.split(",")]
    if H <= 16:
        # 8 warps too: at 4 warps the 64-row block spills (benchmarks/attention_resources.py)
        return [AttnConfig(16, bn, nw, ns, kps) for kps, bn, nw, ns in
                itertools.product((64, 128, 256), (32, 64), (4, 8), (2, 3)) if kps >= bn]
    return [AttnConfig(64, 64, 8, 2, kps) for kps in (256, 512, 1024)]


def indices(T: int, context: int | None) -> torch.Tensor:
    """``[T, K]`` int32: uniform over ``N`` rows, or token t's K distinct rows of
    ``[t * context, (t + 1) * context)`` in random order."""
    if context is None:
        return torch.randint(0, N, (T, K), dtype=torch.int32, device="cuda")
    local = torch.rand(T, context, device="cuda").argsort(dim=1)[:, :K]
    base = torch.arange(T, device="cuda")[:, None] * context
    return (local + base).int()


def bench_shape(H: int, T: int, kvb: torch.Tensor, kv8: torch.Tensor,
                context: int | None = None, only: str | None = None) -> dict:
    """us per call of every plan at ``H`` heads x ``T`` tokens (and the bf16 kernel at 16)."""
    scale = 576 ** -0.5
    idx = indices(T, context)
    qp = torch.randn(T, max(64, H), 576, device="cuda").to(torch.bfloat16)
    q = qp[:, :H].contiguous()
    row = {"H": H, "T": T, "us": {}}
    try:
        row["flashmla"] = timeit_graph(_raw_flashmla(qp, kvb, idx, scale, kv8)[1]) * 1e6
    except Exception as e:  # noqa: BLE001  (flash_mla missing or refusing the shape)
        print(f"  flashmla H={H}: {type(e).__name__}: {str(e)[:120]}")
    named = {"former": former_config(T, H), "default": attn_config(H, K, True, False)}
    for c in plans(H, only):
        named.setdefault(f"{c.block_n}/{c.num_warps}/{c.num_stages}/{c.k_per_split}", c)
    for name, c in named.items():
        row["us"][name] = timeit_graph(
            lambda c=c: sparse_mla_attention_fp8_triton(q, kv8, idx, scale, config=c)) * 1e6
    if H <= 16:
        fb = former_config(T, H)
        row["bf16 former"] = timeit_graph(
            lambda: sparse_mla_attention_triton(q, kvb, idx, scale, config=fb)) * 1e6
        row["bf16 default"] = timeit_graph(
            lambda: sparse_mla_attention_triton(q, kvb, idx, scale)) * 1e6
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16x8,16x24,16x42,16x96,64x8,64x64,128x8,128x64",
                    help="HxT: heads x tokens")
    ap.add_argument("--context", type=int, default=None,
                    help="each token's indices within its own CONTEXT rows (a decode step)")
    ap.add_argument("--plans", default=None,
                    help="bn/warps/stages/kps,... instead of the grid (each compiles once)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
    rows = N if args.context is None else max(T for _, T in shapes) * args.context
    kvb = torch.randn(rows, 576, device="cuda").to(torch.bfloat16)
    kv8 = quantize_mla_rows_reference(kvb, 512)
    res = []
    for H, T in shapes:
        row = bench_shape(H, T, kvb, kv8, args.context, args.plans)
        res.append(row)
        us = row["us"]
        best = min((k for k in us if k not in ("former", "default")), key=us.get)
        print(f"H={H:3d} T={T:3d}: former {us['former']:6.1f} us, default {us['default']:6.1f}"
              f" ({us['default'] / us['former']:.2f}x), best plan {best} {us[best]:6.1f},"
              f" flashmla {row.get('flashmla', float('nan')):6.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
