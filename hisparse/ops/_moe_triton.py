"""Triton grouped GEMMs of the fused MoE (imported lazily by moe.py; layout in its doc).

Kernel 1, per (tile, N block of I): gather the tile's token rows of ``x``, ``g = x @ gate^T``,
``u = x @ up^T`` over K = D, store ``silu(g) * u`` into the padded intermediate ``[S, I]``.
Kernel 2, per (tile, N block of D): ``h @ down^T`` over K = I, times the routing weight, stored
per assignment into ``[A, D]`` (``x.dtype``); the combine sums each token's k rows in fp32.
A tile of no expert masks every load off (no traffic).
FP8 experts: the activation tile is quantized per 1 x bk in registers on CUDA, or read
pre-quantized (``QUANT_A=False``) under the CPU interpreter (see _gemm_triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import bucket_of
from ._gemm_triton import _fp8_tile_dot, _quant_rows, pick, tuned
from .block_fp8 import quantize_fp8_act
from .moe_tiles import FUSED_BLOCK_M, moe_align, moe_block_m


@triton.jit
def _plain_tile_dot(acc, x_ptr, w_ptr, rows, rmask, offs_n, nmask, kb, K,
                    stride_x, stride_w, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :],
                mask=nmask[:, None] & kmask[None, :], other=0.0)
    a = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                mask=rmask[:, None] & kmask[None, :], other=0.0).to(w.dtype)
    if IEEE:
        return acc + tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return acc + tl.dot(a, tl.trans(w))


@triton.jit
def _moe_gate_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, ids_ptr, te_ptr, h_ptr, hs_ptr,
                        sg_ptr, su_ptr, sgs_ptr, sus_ptr,
                        I, K, KB, NBI, E_SHARED,
                        stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_h,
                        stride_hs,
                        TOPK: tl.constexpr, KB_TOTAL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr,
                        FP8: tl.constexpr, QUANT_A: tl.constexpr, IEEE: tl.constexpr,
                        POW2: tl.constexpr, HAS_SHARED: tl.constexpr,
                        SKIP_EMPTY: tl.constexpr, QUANT_H: tl.constexpr,
                        H_DTYPE: tl.constexpr):
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    if SKIP_EMPTY:  # tiles past the last used one: exit instead of looping over masked loads
        if tl.load(te_ptr + tile) < 0:
            return
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    ev = tl.load(te_ptr + tile + tl.zeros((BLOCK_M,), dtype=tl.int32))  # the tile's expert
    aid = tl.load(ids_ptr + slots)
    rmask = (aid >= 0) & (ev >= 0)
    e = tl.max(ev, axis=0)
    tok = tl.where(rmask, aid // TOPK, 0)
    e = tl.maximum(e, 0).to(tl.int64)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = (offs_n < I) & ((tl.zeros((BLOCK_N,), dtype=tl.int32) + tl.max(ev, axis=0)) >= 0)
    wg = w_ptr + e * stride_we
    wu = wg + I * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:  # weight scales loaded a K step ahead (see _gemm_triton._fp8_tile_dot)
        s_g = ws_ptr + e * stride_se + ((nb * BLOCK_N) // SCALE_N) * stride_sn
        s_u = s_g + NBI * stride_sn
    if HAS_SHARED:  # the shared expert: an always-selected expert with its own tensors
        if e == E_SHARED:
            wg = sg_ptr
            wu = su_ptr
            if FP8:
                s_g = sgs_ptr + ((nb * BLOCK_N) // SCALE_N) * stride_sn
                s_u = sus_ptr + ((nb * BLOCK_N) // SCALE_N) * stride_sn
    if FP8:
        sw_g = tl.load(s_g)
        sw_u = tl.load(s_u)
    for kb in range(KB_TOTAL):
        if FP8:
            nxt = tl.minimum(kb + 1, KB - 1)
            sw_g_next = tl.load(s_g + nxt)
            sw_u_next = tl.load(s_u + nxt)
            acc_g = _fp8_tile_dot(acc_g, x_ptr, xs_ptr, wg, sw_g, tok, rmask, offs_n, nmask, kb,
                                  K, KB, stride_x, stride_wn, stride_xs, BLOCK_K, QUANT_A, POW2)
            acc_u = _fp8_tile_dot(acc_u, x_ptr, xs_ptr, wu, sw_u, tok, rmask, offs_n, nmask, kb,
                                  K, KB, stride_x, stride_wn, stride_xs, BLOCK_K, QUANT_A, POW2)
            sw_g = sw_g_next
            sw_u = sw_u_next
        else:
            acc_g = _plain_tile_dot(acc_g, x_ptr, wg, tok, rmask, offs_n, nmask, kb, K,
                                    stride_x, stride_wn, BLOCK_K, IEEE)
            acc_u = _plain_tile_dot(acc_u, x_ptr, wu, tok, rmask, offs_n, nmask, kb, K,
                                    stride_x, stride_wn, BLOCK_K, IEEE)
    h = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(H_DTYPE)
    if QUANT_H:  # the down GEMM's FP8 activation block (BLOCK_N == its K block), as rounded
        q, sh = _quant_rows(h.to(tl.float32), POW2)
        tl.store(h_ptr + slots[:, None] * stride_h + offs_n[None, :], q,
                 mask=rmask[:, None] & (offs_n < I)[None, :])
        tl.store(hs_ptr + slots * stride_hs + nb, sh, mask=rmask)
    else:
        tl.store(h_ptr + slots[:, None] * stride_h + offs_n[None, :], h,
                 mask=rmask[:, None] & (offs_n < I)[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, hs_ptr, w_ptr, ws_ptr, ids_ptr, te_ptr, rw_ptr, out_ptr,
                     sd_ptr, sds_ptr,
                     N, K, KB, E_SHARED,
                     stride_h, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_o,
                     KB_TOTAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr,
                     FP8: tl.constexpr, QUANT_A: tl.constexpr, IEEE: tl.constexpr,
                     POW2: tl.constexpr, HAS_SHARED: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    if SKIP_EMPTY:
        if tl.load(te_ptr + tile) < 0:
            return
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    ev = tl.load(te_ptr + tile + tl.zeros((BLOCK_M,), dtype=tl.int32))  # the tile's expert
    aid = tl.load(ids_ptr + slots)
    rmask = (aid >= 0) & (ev >= 0)
    e = tl.max(ev, axis=0)
    e = tl.maximum(e, 0).to(tl.int64)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = (offs_n < N) & ((tl.zeros((BLOCK_N,), dtype=tl.int32) + tl.max(ev, axis=0)) >= 0)
    wd = w_ptr + e * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:  # weight scales loaded a K step ahead (see _gemm_triton._fp8_tile_dot)
        s_d = ws_ptr + e * stride_se + ((nb * BLOCK_N) // SCALE_N) * stride_sn
    if HAS_SHARED:
        if e == E_SHARED:
            wd = sd_ptr
            if FP8:
                s_d = sds_ptr + ((nb * BLOCK_N) // SCALE_N) * stride_sn
    if FP8:
        sw = tl.load(s_d)
    for kb in range(KB_TOTAL):
        if FP8:
            sw_next = tl.load(s_d + tl.minimum(kb + 1, KB - 1))
            acc = _fp8_tile_dot(acc, h_ptr, hs_ptr, wd, sw, slots, rmask, offs_n, nmask, kb,
                                K, KB, stride_h, stride_wn, stride_hs, BLOCK_K, QUANT_A, POW2)
            sw = sw_next
        else:
            acc = _plain_tile_dot(acc, h_ptr, wd, slots, rmask, offs_n, nmask, kb, K,
                                  stride_h, stride_wn, BLOCK_K, IEEE)
    rw = tl.load(rw_ptr + tl.where(rmask, aid, 0), mask=rmask, other=0.0)
    acc = acc * rw[:, None]
    safe = tl.where(rmask, aid, 0).to(tl.int64)
    tl.store(out_ptr + safe[:, None] * stride_o + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (offs_n < N)[None, :])


_gate_up_tuned = tuned(_moe_gate_up_kernel, ["I", "K", "BLOCK_M", "BLOCK_N", "FP8", "QUANT_A",
                                             "POW2", "HAS_SHARED", "SKIP_EMPTY", "QUANT_H"])
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_down_tuned = tuned(_moe_down_kernel, ["N", "K", "BLOCK_M", "BLOCK_N", "FP8", "QUANT_A", "POW2",
                                       "HAS_SHARED", "SKIP_EMPTY"])


# Measured launches of the fused MoE layer's grouped GEMMs (FP8 experts, the shared expert
# served as an extra expert, 16-row tiles), ``(num_warps, num_stages)`` per ``(kernel, I, D,
# token bucket)`` (``benchmarks/bench_moe_launch.py`` on the H200; the launch never changes a
# bit), used instead of the runtime autotune for those calls up to 512 tokens: the autotune
# times the first call only, whatever its token count (in an engine, a graph warm-up on
# padding), so one pick served every batch size and the pick changed from run to run (the
# real rank's MoE time by 2-6%). Other specializations (bf16 experts, no shared expert,
# prefill's unfused path) keep the autotune.
MOE_LAUNCHES: dict[tuple[str, int, int, int], tuple[int, int]] = {
    # one TP-8 rank of DeepSeek-V3.2 (I = 256, D = 7168), H200, 2026-12-02
    ("gate_up", 256, 7168, 1): (8, 4),
    ("down", 256, 7168, 1): (4, 4),
    ("gate_up", 256, 7168, 8): (8, 4),
    ("down", 256, 7168, 8): (4, 3),
    ("gate_up", 256, 7168, 16): (4, 5),
    ("down", 256, 7168, 16): (4, 3),
    ("gate_up", 256, 7168, 24): (4, 5),
    ("down", 256, 7168, 24): (4, 3),
    ("gate_up", 256, 7168, 32): (4, 5),
    ("down", 256, 7168, 32): (4, 3),
    ("gate_up", 256, 7168, 48): (4, 5),
    ("down", 256, 7168, 48): (4, 3),
    ("gate_up", 256, 7168, 64): (4, 3),
    ("down", 256, 7168, 64): (4, 3),
    ("gate_up", 256, 7168, 96): (4, 3),
    ("down", 256, 7168, 96): (4, 3),
    ("gate_up", 256, 7168, 128): (4, 3),
    ("down", 256, 7168, 128): (4, 3),
    ("gate_up", 256, 7168, 256): (4, 5),
    ("down", 256, 7168, 256): (4, 3),
    ("gate_up", 256, 7168, 512): (4, 4),
    ("down", 256, 7168, 512): (4, 3),
}
MOE_T_BUCKETS = (1, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)


def t_bucket(T: int) -> int:
    """The :data:`MOE_LAUNCHES` key of ``T`` tokens: the smallest bucket holding it."""
    return bucket_of(T, MOE_T_BUCKETS)


def _launch(name: str, kernel, tuned_kernel, device: torch.device, I: int, D: int, T: int,
            measured: bool):
    """The launchable and its options: a :data:`MOE_LAUNCHES` entry for a call of the
    ``measured`` kind (the fused layer's FP8 + shared expert specialization, at most 512
    tokens), else :func:`_gemm_triton.pick` (autotuned on CUDA unless disabled)."""
    cfg = None
    if measured and device.type == "cuda" and T <= MOE_T_BUCKETS[-1]:
        cfg = MOE_LAUNCHES.get((name, I, D, t_bucket(T)))
    if cfg is not None:
        return kernel, {"num_warps": cfg[0], "num_stages": cfg[1]}
    return pick(kernel, tuned_kernel, device)


def _block_n(n: int, scale_n: int | None, cap: int) -> int:
    b = cap
    if scale_n is not None:
        while b > 16 and scale_n % b:
            b //= 2
    return max(16, min(b, triton.next_power_of_2(n)))


def fused_moe_triton(x, topk_ids, topk_weights, gate_up, down, gate_up_scale, down_scale,
                     block, pow2_scale: bool = False) -> torch.Tensor:
    """:func:`hisparse.ops.moe.fused_moe` on Triton: torch sort-based alignment, the grouped
    GEMMs, the combine in torch (the layer path, ``moe_layer``, replaces both)."""
    T, k = topk_ids.shape
    block_m = moe_block_m(T * k, gate_up.shape[0])
    sorted_ids, tile_expert = moe_align(topk_ids, gate_up.shape[0], block_m)
    out = grouped_moe(x, sorted_ids, tile_expert, block_m, topk_weights, gate_up, down,
                      gate_up_scale, down_scale, block, pow2_scale)
    return out.view(T, k, x.shape[1]).sum(1, dtype=torch.float32).to(x.dtype)


def grouped_moe(x, sorted_ids, tile_expert, block_m, topk_weights, gate_up, down,
                gate_up_scale, down_scale, block, pow2_scale: bool = False,
                shared=None, quantize=None, skip_empty: bool = False, x_quant=None,
                h_quant: str | None = None, tile_n: tuple[int, int] | None = None) -> torch.Tensor:
    """Both grouped GEMMs over an aligned layout (``moe_align``'s contract, assignment ids
    ``t * k + j`` with ``k = topk_weights.shape[1]``): per-assignment outputs ``[T * k, D]`` in
    ``x.dtype``, each times its routing weight. ``quantize(a, bk, pow2) -> (q, s)`` (FP8
    experts, CUDA): quantize each GEMM's activations once with it instead of in every tile
    (the same math: ``_gemm_triton._act_tile_fp8``). ``shared``: a
    :class:`hisparse.ops.moe_layer.SharedExpert` served as expert id ``gate_up.shape[0]``.
    ``skip_empty``: programs of unused tiles exit at once. ``x_quant``: ``quantize(x)``
    computed already (by the router GEMM). ``h_quant`` (FP8) places the intermediate's
    quantization: None as ``quantize`` says (its kernel, or the down GEMM's tiles when None),
    ``"tile"`` the down GEMM's tiles (its K is only ``I``), ``"epilogue"`` the gate-up GEMM's
    epilogue (its N tile becomes the FP8 block; ``I`` a multiple of it); the same bits in
    each. ``tile_n``: the gate-up and down GEMMs' N tile caps (default 64, 128; each output
    element's K order is the same under any, so they never change a bit)."""
    T, D = x.shape
    k = topk_weights.shape[1]
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    A = T * k
    fp8 = gate_up_scale is not None
    max_tiles = tile_expert.numel()
    x = x.contiguous()
    quant_x = fp8 and x.is_cuda and quantize is None and x_quant is None   # in the GEMM tiles
    if h_quant not in (None, "tile", "epilogue") or (h_quant and not fp8):
        raise ValueError(f"grouped_moe: h_quant={h_quant!r} (FP8 experts: None, 'tile', "
                         f"'epilogue')")
    quant_h = h_quant == "tile" or (fp8 and x.is_cuda and quantize is None and not h_quant)
    epilogue = h_quant == "epilogue"
    # fp32 experts use IEEE fp32 dots; so does the CPU interpreter for bf16 (its bf16 tl.dot is
    # wrong in triton 3.9, see _indexer_triton)
    ieee = not fp8 and (x.dtype == torch.float32 or not x.is_cuda)
    if fp8:
        bn, bk = block
        nbi = triton.cdiv(I, bn)
        gus, dns = gate_up_scale.float(), down_scale.float()
    else:
        bn, bk = None, 64 if x.is_cuda else 32
        nbi = 0
        gus = dns = x  # unused
    bk = min(bk, max(16, triton.next_power_of_2(min(D, I)))) if not fp8 else bk
    if shared is not None:
        shared.check(gate_up, down, gus if fp8 else None, dns if fp8 else None)
        sg, su, sd = shared.gate, shared.up, shared.down
        sgs, sus, sds = ((shared.gate_scale, shared.up_scale, shared.down_scale) if fp8
                         else (x, x, x))
    else:
        sg, su, sd, sgs, sus, sds = gate_up, gate_up, down, gus, gus, dns
    cap1, cap2 = tile_n or (64, 128)
    if epilogue:
        if I % bk or (tile_n and cap1 != bk):
            raise ValueError(f"grouped_moe: h_quant='epilogue' needs I={I} a multiple of the "
                             f"FP8 block {bk} and the gate-up N tile = {bk}, got {tile_n}")
        cap1 = bk
    # ---- gate_up + silu * up into the padded layout (FP8 with its scales: epilogue)
    slots = max_tiles * block_m
    h = torch.empty(slots, I, device=x.device,
                    dtype=torch.float8_e4m3fn if epilogue else x.dtype)
    h_s = torch.empty(slots, I // bk, device=x.device) if epilogue else h
    quant = (quantize if x.is_cuda else None) or quantize_fp8_act
    if fp8 and not quant_x:
        xq, xs = x_quant or quant(x, bk, pow2_scale)
        xq = xq.contiguous()
    else:
        xq, xs = x, x
    bn1 = _block_n(I, bn, cap1)
    if epilogue and bn1 != bk:
        raise ValueError(f"grouped_moe: h_quant='epilogue' needs a gate-up N tile of the FP8 "
                         f"block {bk}; the weights' {bn}-row scale blocks allow {bn1}")
    kb1 = triton.cdiv(D, bk)
    # the specialization MOE_LAUNCHES was measured for (moe_layer's calls)
    measured = fp8 and shared is not None and skip_empty and block_m == FUSED_BLOCK_M
    kernel, opts = _launch("gate_up", _moe_gate_up_kernel, _gate_up_tuned, x.device, I, D, T,
                           measured)
    kernel[(max_tiles, triton.cdiv(I, bn1))](
        xq, xs, gate_up, gus, sorted_ids, tile_expert, h, h_s, sg, su, sgs, sus,
        I, D, kb1, nbi, E,
        xq.stride(0), xs.stride(0), gate_up.stride(0), gate_up.stride(1),
        gus.stride(0), gus.stride(1) if fp8 else 0, h.stride(0), h_s.stride(0),
        TOPK=k, KB_TOTAL=kb1, BLOCK_M=block_m, BLOCK_N=bn1, BLOCK_K=bk, SCALE_N=bn or 1,
        FP8=fp8, QUANT_A=quant_x, IEEE=ieee, POW2=pow2_scale, HAS_SHARED=shared is not None,
        SKIP_EMPTY=skip_empty, QUANT_H=epilogue, H_DTYPE=_TL_DTYPES[x.dtype], **opts)
    # ---- down, weighted, per assignment
    if epilogue:
        hq, hs = h, h_s
    elif fp8 and not quant_h:
        hq, hs = quant(h, bk, pow2_scale)
        hq = hq.contiguous()
    else:
        hq, hs = h, h
    # per-assignment outputs in x.dtype (half the memory of fp32 for large prefill batches);
    # the caller sums the k contributions of a token in fp32, in slot order
    out = torch.empty(A, D, device=x.device, dtype=x.dtype)
    bn2 = _block_n(D, bn, cap2)
    kb2 = triton.cdiv(I, bk)
    rw = topk_weights.reshape(-1).float().contiguous()
    kernel, opts = _launch("down", _moe_down_kernel, _down_tuned, x.device, I, D, T, measured)
    kernel[(max_tiles, triton.cdiv(D, bn2))](
        hq, hs, down, dns, sorted_ids, tile_expert, rw, out, sd, sds,
        D, I, kb2, E,
        hq.stride(0), hs.stride(0), down.stride(0), down.stride(1),
        dns.stride(0), dns.stride(1) if fp8 else 0, out.stride(0),
        KB_TOTAL=kb2, BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=bk, SCALE_N=bn or 1,
        FP8=fp8, QUANT_A=quant_h, IEEE=ieee, POW2=pow2_scale, HAS_SHARED=shared is not None,
        SKIP_EMPTY=skip_empty, **opts)
    return out

