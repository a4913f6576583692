"""Prototype: the MoE gate-up grouped GEMM with its operands swapped (``h^T = W x^T``), against
the engine's ``_moe_gate_up_kernel``, at one TP-8 rank of DeepSeek-V3.2 (E = 256 FP8 experts,
I = 256, D = 7168, 16-row tiles, each tile one expert).

Why (eighth session, compiled for sm_90 on the CPU box with Triton 3.6): with 16 token rows
on the MMA's M side the engine's kernel lowers its FP8 dot to f16 ``mma.sync`` (upcasting
both tiles in registers; 100-110 registers, pipelined, no spills). With the expert's weight
rows on M (64 or 128) and the tile's 16 tokens on N the same dot is a native FP8 warp-group
MMA fed by ``cp.async`` stages, at 40-72 registers. Whether that is faster for a kernel
near its read bandwidth (~0.8 at 24 tokens) is what this measures. The prototype keeps the
engine's math per output element (the K blocks in order, each block's product times its
activation and weight scales, ``silu(gate) * up`` rounded once) but the MMA's accumulation
differs, so its bits differ from the engine's kernel: the comparison is a tolerance one.

    PYTHONPATH=. python3 benchmarks/bench_moe_swap_ab.py [--tokens 1,8,24,64,96] [--out f.json]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/bench_moe_swap_ab.py --check-cpu

``--check-cpu`` runs both kernels under the interpreter on a small shape against a torch
reference. Not used by the engine; if it wins on the H200, the next step is the down GEMM and
the engine's kernels (and the split-K linears at M <= 64, the same lowering).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@triton.jit
def _gate_up_swapped_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, ids_ptr, te_ptr, h_ptr,
                            I, KB, stride_x, stride_xs, stride_we, stride_wn, stride_se,
                            stride_sn, stride_h,
                            TOPK: tl.constexpr, KB_TOTAL: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            SCALE_N: tl.constexpr, NBI: tl.constexpr, IEEE: tl.constexpr):
    """``h[slot, n] = silu(x_t . g_e[n]) * (x_t . u_e[n])`` for the tile's slots (token ``t
    = id // TOPK``, expert ``e`` the tile's), as ``_moe_gate_up_kernel`` without the shared
    expert; accumulated transposed: ``[BLOCK_N weight rows, BLOCK_M slots]``."""
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(te_ptr + tile)
    if e < 0:
        return
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    aid = tl.load(ids_ptr + slots)
    rmask = aid >= 0
    tok = tl.where(rmask, aid // TOPK, 0).to(tl.int64)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    wg = w_ptr + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
    wu = wg + I * stride_wn
    sg = ws_ptr + e.to(tl.int64) * stride_se + ((nb * BLOCK_N) // SCALE_N) * stride_sn
    su = sg + NBI * stride_sn
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(KB_TOTAL):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tok[:, None] * stride_x + offs_k[None, :], mask=rmask[:, None],
                    other=0.0)
        sa = tl.load(xs_ptr + tok * stride_xs + kb, mask=rmask, other=0.0)
        g = tl.load(wg + offs_k[None, :])
        u = tl.load(wu + offs_k[None, :])
        if IEEE:
            pg = tl.dot(g.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
            pu = tl.dot(u.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            pg = tl.dot(g, tl.trans(x))
            pu = tl.dot(u, tl.trans(x))
        acc_g += pg * (sa[None, :] * tl.load(sg + kb))
        acc_u += pu * (sa[None, :] * tl.load(su + kb))
    h = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + slots[None, :].to(tl.int64) * stride_h + offs_n[:, None], h,
             mask=rmask[None, :] & (offs_n < I)[:, None])


def gate_up_swapped(xq, xs, w, ws, sorted_ids, tile_expert, topk: int, block_m: int,
                    block_n: int = 64, num_warps: int = 4, num_stages: int = 3):
    """``h [slots, I]`` bf16 (rows of unused slots unwritten) of the prototype."""
    E, two_i, D = w.shape
    I = two_i // 2
    bk = 128
    h = torch.full((sorted_ids.numel(), I), float("nan"), device=xq.device,
                   dtype=torch.bfloat16)
    kb = triton.cdiv(D, bk)
    ieee = not xq.is_cuda
    _gate_up_swapped_kernel[(tile_expert.numel(), triton.cdiv(I, block_n))](
        xq, xs, w, ws, sorted_ids, tile_expert, h, I, kb, xq.stride(0), xs.stride(0),
        w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), h.stride(0),
        TOPK=topk, KB_TOTAL=kb, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, SCALE_N=128,
        NBI=triton.cdiv(I, 128), IEEE=ieee,
        **({} if ieee else dict(num_warps=num_warps, num_stages=num_stages)))
    return h


def engine_gate_up(xq, xs, w, ws, sorted_ids, tile_expert, h, topk: int, block_m: int,
                   num_warps: int = 4, num_stages: int = 3) -> None:
    """The engine's ``_moe_gate_up_kernel`` as ``grouped_moe`` launches it (FP8, activations
    quantized already, no shared expert) into ``h [slots, I]``."""
    from hisparse.ops._moe_triton import _moe_gate_up_kernel

    E, two_i, D = w.shape
    I = two_i // 2
    launch = {} if not xq.is_cuda else dict(num_warps=num_warps, num_stages=num_stages)
    _moe_gate_up_kernel[(tile_expert.numel(), triton.cdiv(I, 64))](
        xq, xs, w, ws, sorted_ids, tile_expert, h, h, w, w, ws, ws,
        I, D, triton.cdiv(D, 128), triton.cdiv(I, 128), E,
        xq.stride(0), xs.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1),
        h.stride(0), h.stride(0),
        TOPK=topk, KB_TOTAL=triton.cdiv(D, 128), BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128,
        SCALE_N=128, FP8=True, QUANT_A=False, IEEE=False, POW2=False, HAS_SHARED=False,
        SKIP_EMPTY=True, QUANT_H=False, H_DTYPE=tl.bfloat16, **launch)


def reference(x, w, ws, sorted_ids, tile_expert, topk, block_m):
    """torch: dequantized weights, the activations as quantized (``block_fp8``'s format)."""
    from hisparse.ops.block_fp8 import quantize_fp8_act
    from hisparse.ops.gemm import dequantize_fp8_weight

    E, two_i, D = w.shape
    I = two_i // 2
    xq, xs = quantize_fp8_act(x, 128, False)
    xd = (xq.float().view(x.shape[0], -1, 128) * xs[:, :, None]).view(x.shape[0], D)
    h = torch.full((sorted_ids.numel(), I), float("nan"))
    for tile, e in enumerate(tile_expert.tolist()):
        if e < 0:
            continue
        wd = dequantize_fp8_weight(w[e], ws[e], (128, 128)).float()
        for s in range(tile * block_m, (tile + 1) * block_m):
            a = int(sorted_ids[s])
            if a < 0:
                continue
            gu = wd @ xd[a // topk]
            h[s] = (torch.nn.functional.silu(gu[:I]) * gu[I:]).to(torch.bfloat16).float()
    return h, (xq, xs)


def layout(T: int, topk: int, E: int, block_m: int, device, seed: int = 0):
    """Random distinct experts per token, aligned as the engine aligns them (``moe_align``)."""
    from hisparse.ops.moe_tiles import moe_align

    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(T)]).int()
    return moe_align(ids.to(device), E, block_m)


def check_cpu() -> None:
    from hisparse.ops.gemm import quantize_fp8_weight

    torch.manual_seed(0)
    E, I, D, T, k, bm = 4, 128, 256, 5, 2, 16     # I: whole 128-row scale blocks
    w, ws = quantize_fp8_weight(torch.randn(E, 2 * I, D) * 0.05, (128, 128))
    x = torch.randn(T, D).to(torch.bfloat16)
    sorted_ids, tile_expert = layout(T, k, E, bm, "cpu")
    want, (xq, xs) = reference(x, w, ws, sorted_ids, tile_expert, k, bm)
    got = gate_up_swapped(xq, xs, w, ws, sorted_ids, tile_expert, k, bm, block_n=64).float()
    used = ~want.isnan()
    eng = torch.full_like(got, float("nan")).to(torch.bfloat16)
    engine_gate_up(xq, xs, w, ws, sorted_ids, tile_expert, eng, k, bm)
    print(f"engine kernel vs reference: max |err| "
          f"{(eng.float()[used] - want[used]).abs().max().item():.3g}")
    err = (got[used] - want[used]).abs().max().item()
    print(f"prototype vs reference: max |err| {err:.3g} (scale {want[used].abs().max():.3g}), "
          f"unwritten rows stay NaN: {bool(got[~used].isnan().all())}")
    assert err <= 2e-2 * want[used].abs().max().item() and bool(got[~used].isnan().all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,8,24,64,96")
    ap.add_argument("--check-cpu", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.check_cpu:
        check_cpu()
        return
    from bench_moe_launch import D, E, I, rank_layer
    from bench_ops import timeit_graph

    from hisparse.ops import _moe_triton as M  # the launch table
    from hisparse.ops.moe_layer import quantize_act
    from hisparse.ops.moe_tiles import FUSED_BLOCK_M

    dev = torch.device("cuda")
    torch.manual_seed(0)
    layer = rank_layer(dev)
    w, ws = layer["gate_up"], layer["gate_up_scale"].float()
    k, bm = 8, FUSED_BLOCK_M
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        xq, xs = quantize_act(x, 128, False)
        sorted_ids, tile_expert = layout(T, k, E, bm, dev, seed=T)
        h_eng = torch.empty(sorted_ids.numel(), I, device=dev, dtype=torch.bfloat16)
        nw, ns = M.MOE_LAUNCHES.get(("gate_up", I, D, M.t_bucket(T)), (4, 3))

        engine = functools.partial(engine_gate_up, xq, xs, w, ws, sorted_ids, tile_expert,
                                   h_eng, k, bm, nw, ns)
        row = {"T": T, "engine_us": timeit_graph(engine) * 1e6, "swapped_us": {}}
        used = sorted_ids >= 0
        for bn in (64, 128):
            for nw2, ns2 in ((4, 3), (4, 4), (8, 3), (8, 4)):
                run = functools.partial(gate_up_swapped, xq, xs, w, ws, sorted_ids, tile_expert,
                                        k, bm, bn, nw2, ns2)
                err = (run()[used].float() - h_eng[used].float()).abs().max().item()
                row["swapped_us"][f"{bn}/{nw2}/{ns2}"] = dict(us=timeit_graph(run) * 1e6,
                                                              max_err=err)
        best = min(row["swapped_us"], key=lambda n: row["swapped_us"][n]["us"])
        experts = int((tile_expert >= 0).sum())
        mb = experts * 2 * I * D / 1e6
        print(f"T={T:3d} ({experts} tiles, {mb:.0f} MB of weights): engine {row['engine_us']:.1f}"
              f" us, swapped best {best} {row['swapped_us'][best]['us']:.1f} us "
              f"(max |diff| {row['swapped_us'][best]['max_err']:.3g}; "
              f"{mb / row['swapped_us'][best]['us'] / 1e3:.2f} TB/s vs "
              f"{mb / row['engine_us'] / 1e3:.2f})", flush=True)
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
