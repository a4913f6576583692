"""Prototype: the MoE's grouped GEMMs with their operands swapped (``h^T = W x^T``), against the
engine's ``_moe_gate_up_kernel`` and ``_moe_down_kernel``, at one TP-8 rank of DeepSeek-V3.2
(E = 256 FP8 experts, I = 256, D = 7168, 16-row tiles, each tile one expert).

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
reference. Not used by the engine; if it wins on the H200, the next step is the engine's
kernels (the shared expert, the quantization modes, the launch table). The split-K linears
already compute this way.
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


@triton.jit
def _down_swapped_kernel(h_ptr, hs_ptr, w_ptr, ws_ptr, ids_ptr, te_ptr, rw_ptr, out_ptr,
                         N, stride_h, stride_hs, stride_we, stride_wn, stride_se, stride_sn,
                         stride_o, KB_TOTAL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr,
                         IEEE: tl.constexpr):
    """``out[id, n] = rw[id] * (h_slot . d_e[n])`` per assignment ``id`` of the tile's slots
    (``_moe_down_kernel`` without the shared expert), accumulated transposed."""
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(te_ptr + tile)
    if e < 0:
        return
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    aid = tl.load(ids_ptr + slots)
    rmask = aid >= 0
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    wd = w_ptr + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
    sd = ws_ptr + e.to(tl.int64) * stride_se + ((nb * BLOCK_N) // SCALE_N) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(KB_TOTAL):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + slots[:, None].to(tl.int64) * stride_h + offs_k[None, :],
                    mask=rmask[:, None], other=0.0)
        sa = tl.load(hs_ptr + slots.to(tl.int64) * stride_hs + kb, mask=rmask, other=0.0)
        w = tl.load(wd + offs_k[None, :])
        if IEEE:
            p = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            p = tl.dot(w, tl.trans(a))
        acc += p * (sa[None, :] * tl.load(sd + kb))
    rw = tl.load(rw_ptr + tl.where(rmask, aid, 0), mask=rmask, other=0.0)
    acc = acc * rw[None, :]
    safe = tl.where(rmask, aid, 0).to(tl.int64)
    tl.store(out_ptr + safe[None, :] * stride_o + offs_n[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=rmask[None, :] & (offs_n < N)[:, None])


def down_swapped(hq, hs, w, ws, sorted_ids, tile_expert, rw, n_assign: int, block_m: int,
                 block_n: int = 128, num_warps: int = 4, num_stages: int = 3, out=None):
    """``out [assignments, D]`` bf16 of the prototype (a NaN-filled new tensor when None)."""
    E, D, I = w.shape
    if out is None:
        out = torch.full((n_assign, D), float("nan"), device=hq.device, dtype=torch.bfloat16)
    ieee = not hq.is_cuda
    _down_swapped_kernel[(tile_expert.numel(), triton.cdiv(D, block_n))](
        hq, hs, w, ws, sorted_ids, tile_expert, rw, out, D, hq.stride(0), hs.stride(0),
        w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), out.stride(0),
        KB_TOTAL=triton.cdiv(I, 128), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128,
        SCALE_N=128, IEEE=ieee,
        **({} if ieee else dict(num_warps=num_warps, num_stages=num_stages)))
    return out


def engine_down(hq, hs, w, ws, sorted_ids, tile_expert, rw, out, block_m: int,
                num_warps: int = 4, num_stages: int = 3) -> None:
    """The engine's ``_moe_down_kernel`` as ``grouped_moe`` launches it (FP8, the intermediate
    quantized already, no shared expert) into ``out [assignments, D]``."""
    from hisparse.ops._moe_triton import _moe_down_kernel

    E, D, I = w.shape
    launch = {} if not hq.is_cuda else dict(num_warps=num_warps, num_stages=num_stages)
    _moe_down_kernel[(tile_expert.numel(), triton.cdiv(D, 128))](
        hq, hs, w, ws, sorted_ids, tile_expert, rw, out, w, ws,
        D, I, triton.cdiv(I, 128), E,
        hq.stride(0), hs.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1),
        out.stride(0),
        KB_TOTAL=triton.cdiv(I, 128), BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128,
        SCALE_N=128, FP8=True, QUANT_A=False, IEEE=False, POW2=False, HAS_SHARED=False,
        SKIP_EMPTY=True, **launch)


def gate_up_swapped(xq, xs, w, ws, sorted_ids, tile_expert, topk: int, block_m: int,
                    block_n: int = 64, num_warps: int = 4, num_stages: int = 3, out=None):
    """``h [slots, I]`` bf16 of the prototype (into ``out``, else a NaN-filled new tensor:
    rows of unused slots stay unwritten)."""
    E, two_i, D = w.shape
    I = two_i // 2
    bk = 128
    h = out if out is not None else torch.full((sorted_ids.numel(), I), float("nan"),
                                               device=xq.device, dtype=torch.bfloat16)
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
    # the down GEMM over that intermediate (quantized as the layer quantizes it)
    from hisparse.ops.block_fp8 import quantize_fp8_act
    from hisparse.ops.gemm import dequantize_fp8_weight

    dw, dws = quantize_fp8_weight(torch.randn(E, D, I) * 0.05, (128, 128))
    h = torch.where(used, want, torch.zeros(())).to(torch.bfloat16)
    hq, hs = quantize_fp8_act(h, 128, False)
    hq = hq.contiguous()
    rw = torch.rand(T * k)
    hd = (hq.float().view(h.shape[0], -1, 128) * hs[:, :, None]).view(h.shape)
    ref = torch.full((T * k, D), float("nan"))
    for tile, e in enumerate(tile_expert.tolist()):
        if e < 0:
            continue
        wd = dequantize_fp8_weight(dw[e], dws[e], (128, 128)).float()
        for slot in range(tile * bm, (tile + 1) * bm):
            a = int(sorted_ids[slot])
            if a >= 0:
                ref[a] = (rw[a] * (wd @ hd[slot])).to(torch.bfloat16).float()
    eng_out = torch.full((T * k, D), float("nan"), dtype=torch.bfloat16)
    engine_down(hq, hs, dw, dws, sorted_ids, tile_expert, rw, eng_out, bm)
    got_out = down_swapped(hq, hs, dw, dws, sorted_ids, tile_expert, rw, T * k, bm)
    scale = ref.abs().max().item()
    for name, o in (("engine down", eng_out), ("prototype down", got_out)):
        e2 = (o.float() - ref).abs().max().item()
        print(f"{name} vs reference: max |err| {e2:.3g} (scale {scale:.3g})")
        assert e2 <= 2e-2 * scale


PROTO_LAUNCHES = [(bn, nw, ns) for bn in (64, 128) for nw, ns in ((4, 3), (4, 4), (8, 3), (8, 4))]


def compare(name: str, T: int, mb: float, engine, proto, out_engine, used, timeit) -> dict:
    """Time ``engine()`` (filling ``out_engine``) and ``proto(bn, nw, ns)`` (returning its
    output) at every prototype launch, rows ``used`` compared; print the best against the
    engine's."""
    row = {"engine_us": timeit(engine) * 1e6, "swapped": {}}
    for bn, nw, ns in PROTO_LAUNCHES:
        run = functools.partial(proto, bn, nw, ns)
        err = (run()[used].float() - out_engine[used].float()).abs().max().item()
        row["swapped"][f"{bn}/{nw}/{ns}"] = dict(us=timeit(run) * 1e6, max_err=err)
    best = min(row["swapped"], key=lambda n: row["swapped"][n]["us"])
    b = row["swapped"][best]
    print(f"{name:>7} T={T:3d} ({mb:5.0f} MB): engine {row['engine_us']:7.1f} us "
          f"({mb / row['engine_us'] / 1e3:.2f} TB/s), swapped best {best} {b['us']:7.1f} us "
          f"({mb / b['us'] / 1e3:.2f} TB/s; max |diff| {b['max_err']:.3g})", flush=True)
    return row


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
    gu, gus = layer["gate_up"], layer["gate_up_scale"].float()
    dn, dns = layer["down"], layer["down_scale"].float()
    k, bm = 8, FUSED_BLOCK_M
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        xq, xs = quantize_act(x, 128, False)
        sorted_ids, tile_expert = layout(T, k, E, bm, dev, seed=T)
        experts = int(tile_expert[tile_expert >= 0].unique().numel())
        used = sorted_ids >= 0
        bucket = M.t_bucket(T)
        h = torch.zeros(sorted_ids.numel(), I, device=dev, dtype=torch.bfloat16)
        gu_launch = M.MOE_LAUNCHES.get(("gate_up", I, D, bucket), (4, 3))
        row = {"T": T, "experts": experts, "gate_up": compare(
            "gate-up", T, experts * 2 * I * D / 1e6,
            functools.partial(engine_gate_up, xq, xs, gu, gus, sorted_ids, tile_expert, h, k,
                              bm, *gu_launch),
            functools.partial(gate_up_swapped, xq, xs, gu, gus, sorted_ids, tile_expert, k, bm,
                              out=torch.zeros_like(h)),
            h, used, timeit_graph)}
        hq, hs = quantize_act(h, 128, False)
        rw = torch.rand(T * k, device=dev)
        out = torch.zeros(T * k, D, device=dev, dtype=torch.bfloat16)
        dn_launch = M.MOE_LAUNCHES.get(("down", I, D, bucket), (4, 3))
        assigned = torch.zeros(T * k, dtype=torch.bool, device=dev)
        assigned[sorted_ids[used].long()] = True
        row["down"] = compare(
            "down", T, experts * I * D / 1e6,
            functools.partial(engine_down, hq, hs, dn, dns, sorted_ids, tile_expert, rw, out,
                              bm, *dn_launch),
            functools.partial(down_swapped, hq, hs, dn, dns, sorted_ids, tile_expert, rw, T * k,
                              bm, out=torch.zeros_like(out)),
            out, assigned, timeit_graph)
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
