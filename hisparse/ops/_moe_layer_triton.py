"""Triton kernels of the fused MoE layer's glue (imported lazily by moe_layer.py; contracts there).

- ``_moe_router_gemm_kernel``: router logits as fixed K-split fp32 partials ``[S, T, E]``
  (``BLOCK_T``-token tiles whatever ``T``, split count fixed by ``K``: a row's partials do not
  depend on the batch);
  with ``QUANT`` the programs of the first expert block also quantize their ``x`` tile to FP8
  per ``1 x QBK`` (what ``_moe_quant_act_kernel`` computes, bit for bit: one kernel less);
- ``_moe_route_kernel``: per token (a few per program): the partials summed in split order, sigmoid,
  correction bias, group-limited top-k (ties to the lower index), normalisation and scaling;
  appends the always-selected shared expert column;
- ``_moe_align_experts_kernel``: assignments into per-expert ``BLOCK_M``-row tiles, in token
  order within an expert, without a sort, one program per ``EB`` experts: each program
  histograms every assignment (the tile prefix over all experts: no grid-wide sync), then
  ranks its own experts' assignments by one-hot prefix sums over assignment chunks and writes
  their slots, tiles and padding, and its share of the unused tail;
- ``_moe_align_kernel``: the same layout from one program (``HISPARSE_MOE_ALIGN=single``: the
  baseline);
- ``_moe_quant_act_kernel``: activations to FP8 per ``1 x bk`` (the grouped GEMMs' in-tile math);
- ``_moe_token_sum_kernel``: each token's ``K`` assignment rows summed in fp32 in slot order.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._gemm_splitk_triton import _fp32_split_dot
from ._gemm_triton import _act_tile_fp8, _quant_rows


@triton.jit
def _moe_router_gemm_kernel(x_ptr, w_ptr, part_ptr, q_ptr, s_ptr, T, E, K, KB,
                        stride_x, stride_w, stride_ps, stride_q, stride_s,
                        K_SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
                        QBK: tl.constexpr, POW2: tl.constexpr):
    pt = tl.program_id(0)
    pe = tl.program_id(1)
    ps = tl.program_id(2)
    rows = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    if QUANT:  # x's FP8 blocks of this split, once per token tile (expert block 0)
        if pe == 0:
            for kq in tl.static_range(K_SPLIT // QBK):
                kb = ps * (K_SPLIT // QBK) + kq
                offs_q = kb * QBK + tl.arange(0, QBK)
                qm = rmask[:, None] & (offs_q < K)[None, :]
                xa = tl.load(x_ptr + rows[:, None] * stride_x + offs_q[None, :], mask=qm,
                             other=0.0)
                q, sa = _quant_rows(xa.to(tl.float32), POW2)
                tl.store(q_ptr + rows[:, None] * stride_q + offs_q[None, :], q, mask=qm)
                tl.store(s_ptr + rows * stride_s + kb, sa, mask=rmask & (rows * 0 + kb < KB))
    offs_e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = offs_e < E
    acc = _fp32_split_dot(x_ptr, w_ptr, rows, rmask, offs_e, emask, ps, K, stride_x, stride_w,
                          K_SPLIT, BLOCK_K, BLOCK_T, BLOCK_E, PRECISION)
    tl.store(part_ptr + ps * stride_ps + rows[:, None] * E + offs_e[None, :], acc,
             mask=rmask[:, None] & emask[None, :])


@triton.jit
def _moe_route_kernel(part_ptr, bias_ptr, ids_ptr, w_ptr, T, stride_ps, scaling, shared_id,
                  E: tl.constexpr, SPLITS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                  EPG: tl.constexpr, EPGP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  TOPK: tl.constexpr, KP: tl.constexpr, N_SHARED: tl.constexpr,
                  NORM: tl.constexpr, HAS_BIAS: tl.constexpr, LIBDEVICE: tl.constexpr,
                  BLOCK_T: tl.constexpr):
    # [BLOCK_T tokens, GP groups, EPGP experts of a group]; every reduction is within a token
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    g = tl.arange(0, GP)
    i = tl.arange(0, EPGP)
    e_idx = g[:, None] * EPG + i[None, :]
    valid = (g < G)[:, None] & (i < EPG)[None, :]
    valid3 = tmask[:, None, None] & valid[None, :, :]
    big = E + 1
    logit = tl.zeros((BLOCK_T, GP, EPGP), dtype=tl.float32)
    for s in tl.static_range(SPLITS):                            # fixed order: batch invariant
        logit += tl.load(part_ptr + s * stride_ps + t[:, None, None] * E + e_idx[None, :, :],
                         mask=valid3, other=0.0)
    if LIBDEVICE:  # expf as torch's sigmoid calls it (tl.exp is ex2.approx on CUDA)
        score = 1.0 / (1.0 + libdevice.exp(-logit))
    else:
        score = 1.0 / (1.0 + tl.exp(-logit))
    choice = score
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e_idx, mask=valid, other=0.0)[None, :, :]
    neg = float("-inf")
    choice = tl.where(valid[None, :, :], choice, neg)
    # group score: the sum of its two largest choice scores (one copy of a tied maximum removed)
    m1 = tl.max(choice, axis=2)
    a1 = tl.min(tl.where(choice == m1[:, :, None], i[None, None, :], EPGP), axis=2)
    m2 = tl.max(tl.where(i[None, None, :] == a1[:, :, None], neg, choice), axis=2)
    gs = tl.where((g < G)[None, :], m1 + m2, neg)                # [BLOCK_T, GP]
    sel = tl.zeros((BLOCK_T, GP), dtype=tl.int32) != 0          # all False
    for _ in tl.static_range(TOPK_GROUP):
        gm = tl.max(gs, axis=1)
        gi = tl.min(tl.where(gs == gm[:, None], g[None, :], GP), axis=1)
        hit = g[None, :] == gi[:, None]
        sel = sel | hit
        gs = tl.where(hit, neg, gs)
    cand = tl.where(sel[:, :, None] & valid[None, :, :], choice, neg)
    j = tl.arange(0, KP)
    ids = tl.zeros((BLOCK_T, KP), dtype=tl.int32) + (shared_id + j - TOPK)[None, :]
    wts = tl.zeros((BLOCK_T, KP), dtype=tl.float32) + 1.0        # shared columns after top-k
    for kk in tl.static_range(TOPK):
        cm = tl.max(tl.max(cand, axis=2), axis=1)
        ci = tl.min(tl.min(tl.where(cand == cm[:, None, None], e_idx[None, :, :], big), axis=2),
                    axis=1)
        # padded slots (EPG not a power of two) alias the next group's ids: never a hit
        hit = (e_idx[None, :, :] == ci[:, None, None]) & valid[None, :, :]
        cw = tl.sum(tl.sum(tl.where(hit, score, 0.0), axis=2), axis=1)
        ids = tl.where(j[None, :] == kk, ci[:, None], ids)
        wts = tl.where(j[None, :] == kk, cw[:, None], wts)
        cand = tl.where(hit, neg, cand)
    routed = (j < TOPK)[None, :]
    if NORM:
        den = tl.sum(tl.where(routed, wts, 0.0), axis=1) + 1e-20
        wts = tl.where(routed, wts / den[:, None], wts)
    wts = tl.where(routed, wts * scaling, wts)
    out = tmask[:, None] & (j < TOPK + N_SHARED)[None, :]
    offs = t[:, None] * (TOPK + N_SHARED) + j[None, :]
    tl.store(ids_ptr + offs, ids, mask=out)
    tl.store(w_ptr + offs, wts, mask=out)


@triton.jit
def _moe_align_experts_kernel(ids_ptr, sorted_ptr, te_ptr, A, num_slots, max_tiles,
                              expert_tiles, slot_span, tile_span,
                              E: tl.constexpr, EP: tl.constexpr, EB: tl.constexpr,
                              CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, TB: tl.constexpr,
                              FILL: tl.constexpr):
    pid = tl.program_id(0)
    a = tl.arange(0, CHUNK)
    ex = tl.arange(0, EP)
    # every expert's count (each program: the tile prefix needs all experts before its own)
    counts = tl.zeros((EP,), dtype=tl.int32)
    for a0 in range(0, A, CHUNK):
        m = a0 + a < A
        counts += tl.histogram(tl.load(ids_ptr + a0 + a, mask=m, other=0), EP, mask=m)
    counts = tl.where(ex < E, counts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_start = tl.cumsum(tiles, axis=0) - tiles
    used = tl.sum(tiles, axis=0)
    own = pid * EB + tl.arange(0, EB)
    omask = own < E
    pick = ex[None, :] == own[:, None]                                  # [EB, EP]
    o_count = tl.sum(tl.where(pick, counts[None, :], 0), axis=1)
    o_tile0 = tl.sum(tl.where(pick, tile_start[None, :], 0), axis=1)
    o_tiles = (o_count + BLOCK_M - 1) // BLOCK_M
    o_slot0 = o_tile0 * BLOCK_M
    # the own experts' tiles, and the unused slots of their last tiles
    tb = tl.arange(0, TB)
    for i0 in range(0, expert_tiles, TB):
        i = i0 + tb
        tl.store(te_ptr + o_tile0[:, None] + i[None, :], own[:, None] + 0 * i[None, :],
                 mask=omask[:, None] & (i[None, :] < o_tiles[:, None]))
    pad = o_count[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + o_slot0[:, None] + pad, tl.full((EB, BLOCK_M), -1, tl.int32),
             mask=omask[:, None] & (pad < (o_tiles * BLOCK_M)[:, None]))
    # this program's share of the slots and tiles past the last used tile
    f = tl.arange(0, FILL)
    for s0 in range(0, slot_span, FILL):
        s = pid * slot_span + s0 + f
        tl.store(sorted_ptr + s, tl.full((FILL,), -1, tl.int32),
                 mask=(s0 + f < slot_span) & (s >= used * BLOCK_M) & (s < num_slots))
    for s0 in range(0, tile_span, FILL):
        s = pid * tile_span + s0 + f
        tl.store(te_ptr + s, tl.full((FILL,), -1, tl.int32),
                 mask=(s0 + f < tile_span) & (s >= used) & (s < max_tiles))
    # an assignment's slot = its expert's first slot + #earlier assignments on that expert
    # (assignment ids t * k + j grow with the token: token order within an expert)
    carry = tl.zeros((EB,), dtype=tl.int32)
    for a0 in range(0, A, CHUNK):
        m = a0 + a < A
        e = tl.load(ids_ptr + a0 + a, mask=m, other=-1)
        hit = (e[:, None] == own[None, :]) & omask[None, :]            # [CHUNK, EB]
        h = hit.to(tl.int32)
        before = tl.cumsum(h, axis=0) - h + (carry + o_slot0)[None, :]
        slot = tl.sum(tl.where(hit, before, 0), axis=1)
        tl.store(sorted_ptr + slot, a0 + a, mask=tl.sum(h, axis=1) > 0)
        carry += tl.sum(h, axis=0)


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, te_ptr, T, num_slots, max_tiles,
                  K: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_M: tl.constexpr, FILL: tl.constexpr):
    ex = tl.arange(0, EP)
    tr = tl.arange(0, BLOCK_T)
    # pass 1: per-expert assignment counts
    counts = tl.zeros((EP,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tr
        for j in tl.static_range(K):
            e = tl.load(ids_ptr + rows * K + j, mask=rows < T, other=EP)
            counts += tl.sum((e[:, None] == ex[None, :]).to(tl.int32), axis=0)
    counts = tl.where(ex < E, counts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    tile_start = tile_end - tiles
    slot_start = tile_start * BLOCK_M
    # every slot and tile unused (-1) first, then the used ones (after a barrier: same addresses)
    f = tl.arange(0, FILL)
    for s0 in range(0, num_slots, FILL):
        tl.store(sorted_ptr + s0 + f, tl.full((FILL,), -1, tl.int32), mask=s0 + f < num_slots)
    for s0 in range(0, max_tiles, FILL):
        tl.store(te_ptr + s0 + f, tl.full((FILL,), -1, tl.int32), mask=s0 + f < max_tiles)
    tl.debug_barrier()
    for i in range(0, (T + BLOCK_M - 1) // BLOCK_M):   # an expert holds <= T assignments
        tl.store(te_ptr + tile_start + i, ex, mask=i < tiles)
    # pass 2: an assignment's slot = its expert's first slot + #earlier tokens on that expert
    # ([experts, tokens] tiles: the prefix sum runs along the last axis)
    carry = tl.zeros((EP,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tr
        rmask = rows < T
        hot = tl.zeros((EP, BLOCK_T), dtype=tl.int32)
        for j in tl.static_range(K):
            e = tl.load(ids_ptr + rows * K + j, mask=rmask, other=EP)
            hot += (ex[:, None] == e[None, :]).to(tl.int32)
        before = tl.cumsum(hot, axis=1) - hot + (carry + slot_start)[:, None]
        for j in tl.static_range(K):
            e = tl.load(ids_ptr + rows * K + j, mask=rmask, other=EP)
            slot = tl.sum(tl.where(ex[:, None] == e[None, :], before, 0), axis=0)
            tl.store(sorted_ptr + slot, rows * K + j, mask=rmask)
        carry += tl.sum(hot, axis=1)


@triton.jit
def _moe_quant_act_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, POW2: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    kb = tl.program_id(1)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    q, sa = _act_tile_fp8(x_ptr, x_ptr, rows, rmask, offs_k, kmask, kb, stride_x, 0, True, POW2)
    tl.store(q_ptr + rows[:, None] * stride_q + offs_k[None, :], q,
             mask=rmask[:, None] & kmask[None, :])
    tl.store(s_ptr + rows * stride_s + kb, sa, mask=rmask)


@triton.jit
def _moe_token_sum_kernel(y_ptr, out_ptr, D, stride_y, stride_o, K: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(y_ptr + (t * K + j) * stride_y + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=m)
