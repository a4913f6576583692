"""Triton scoring kernels of the lightning indexer (imported lazily by indexer.py): the scoring
kernel and, for FP8 keys, the query rotation (and quantization) that runs before it."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import check_rotation_dim, fp8_tile, interpreted, next_pow2
from ._glue_triton import _ordered_sum, _rope_pair, _rope_src
from ._quant_triton import _TL_DTYPE, _e4m3_code, _hadamard, _pow2_scale
from .pending import PendingSum, summed


@triton.jit
def _score_block(sb, qv, w, k_ptr, ks_ptr, bt_ptr, key_ptr, tok0, r, n, n_tok,
                 stride_kr, stride_ksp, stride_btr, stride_keyt, D, PAGE: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, G: tl.constexpr,
                 BLOCK_H: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
                 TILE: tl.constexpr, NT: tl.constexpr, EVEN_D: tl.constexpr):
    """Keys of columns ``sb * BLOCK_S ..`` for the ``G`` tokens ``tok0 ..`` (rows of ``qv`` /
    ``w``): token ``g`` writes its columns ``< n_tok[g]`` (0 for a token not scored here)."""
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    offs_s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    valid = offs_s < n
    page = offs_s // PAGE
    blk = tl.load(bt_ptr + r.to(tl.int64) * stride_btr + page, mask=valid, other=-1)
    valid = valid & (blk >= 0)
    slot = offs_s % PAGE
    kmask = valid[:, None] & dmask[None, :]
    if FP8:
        vptrs = k_ptr + (blk.to(tl.int64) * stride_kr + slot * D)[:, None] + offs_d[None, :]
        if EVEN_D:      # a row mask only: nothing stops 16-B vector loads
            f8 = tl.load(vptrs, mask=valid[:, None], other=0)
        else:
            f8 = tl.load(vptrs, mask=kmask, other=0)
        f8 = f8.to(tl.float8e4nv, bitcast=True)
        srow = blk.to(tl.int64) * stride_ksp + (PAGE * D // 4) + slot * NT
        if NT == 1:
            sc = tl.load(ks_ptr + srow, mask=valid, other=0.0)          # [BLOCK_S]
            if IEEE:
                s = tl.dot(qv, tl.trans(f8.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(qv, tl.trans(f8.to(qv.dtype)))
            s = s * sc[None, :]
        else:
            sc = tl.load(ks_ptr + srow[:, None] + (offs_d // TILE)[None, :], mask=kmask,
                         other=0.0)
            if IEEE:
                s = tl.dot(qv, tl.trans(f8.to(tl.float32) * sc), input_precision="ieee")
            else:
                s = tl.dot(qv, tl.trans((f8.to(tl.float32) * sc).to(qv.dtype)))
    else:
        k = tl.load(k_ptr + (blk.to(tl.int64) * PAGE + slot)[:, None] * stride_kr
                    + offs_d[None, :], mask=kmask, other=0.0)
        if IEEE:
            s = tl.dot(qv, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(qv, tl.trans(k.to(qv.dtype)))
    s = tl.maximum(s, 0.0) * w[:, None]                          # [G * BLOCK_H, BLOCK_S]
    offs_m = tl.arange(0, G * BLOCK_H)
    for g in tl.static_range(G):    # masked reductions: no reshape of the dot's layout
        if G == 1:
            score = tl.sum(s, axis=0)                            # [BLOCK_S] fp32
        else:
            score = tl.sum(tl.where((offs_m // BLOCK_H == g)[:, None], s, 0.0), axis=0)
        _store_keys(score, valid, offs_s, g, n_tok, key_ptr, tok0, stride_keyt, G)


@triton.jit
def _store_keys(score, valid, offs_s, g: tl.constexpr, n_tok, key_ptr, tok0, stride_keyt,
                G: tl.constexpr):
    """Token ``tok0 + g``'s orderable int32 keys of ``score [BLOCK_S]`` at columns ``offs_s``
    below its length (``n_tok[g]``; 0 unless scored here); ``INT32_MIN`` where not ``valid``."""
    score = tl.where(score == 0.0, 0.0, score)                   # -0.0 -> +0.0
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)            # order-preserving int32
    key = tl.where(score != score, 2147483647, key)              # NaN: above +inf
    key = tl.where(valid, key, -2147483648)                      # unmapped page
    n_g = tl.sum(tl.where(tl.arange(0, G) == g, n_tok, 0), 0)
    tl.store(key_ptr + (tok0 + g).to(tl.int64) * stride_keyt + offs_s, key, mask=offs_s < n_g)


@triton.jit
def _score_block_f8q(sb, qt, w, k_ptr, ks_ptr, bt_ptr, key_ptr, tok0, r, n, n_tok,
                     stride_kr, stride_ksp, stride_btr, stride_keyt, D, PAGE: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, G: tl.constexpr,
                     BLOCK_H: tl.constexpr, EVEN_D: tl.constexpr):
    """FP8 keys x FP8 queries (one scale tile): the keys of columns ``sb * BLOCK_S ..`` are
    the M side of one e4m3 dot with every head of the ``G`` tokens (``qt [BLOCK_D, G *
    BLOCK_H]``, e4m3), fp32 accumulation; ``relu``, the head weights (query scales folded in:
    ``w``), the sum over each token's heads (a row reduction, inside a warp), times the key's
    power-of-two scale."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    valid = offs_s < n
    blk = tl.load(bt_ptr + r.to(tl.int64) * stride_btr + offs_s // PAGE, mask=valid, other=-1)
    valid = valid & (blk >= 0)
    slot = offs_s % PAGE
    vptrs = k_ptr + (blk.to(tl.int64) * stride_kr + slot * D)[:, None] + offs_d[None, :]
    # e4m3 pointers (no bitcast between the load and the dot: the loads stay pipelined)
    if EVEN_D:      # a row mask only: nothing stops 16-B vector loads
        f8 = tl.load(vptrs, mask=valid[:, None], other=0.0)     # [BLOCK_S, BLOCK_D]
    else:
        f8 = tl.load(vptrs, mask=valid[:, None] & (offs_d < D)[None, :], other=0.0)
    sc = tl.load(ks_ptr + blk.to(tl.int64) * stride_ksp + (PAGE * D // 4) + slot, mask=valid,
                 other=0.0)                                      # [BLOCK_S]
    s = tl.dot(f8, qt)                                           # [BLOCK_S, G * BLOCK_H] fp32
    s = tl.maximum(s, 0.0) * w[None, :]
    offs_m = tl.arange(0, G * BLOCK_H)
    for g in tl.static_range(G):
        if G == 1:
            score = tl.sum(s, axis=1)
        else:
            score = tl.sum(tl.where((offs_m // BLOCK_H == g)[None, :], s, 0.0), axis=1)
        _store_keys(score * sc, valid, offs_s, g, n_tok, key_ptr, tok0, stride_keyt, G)


@triton.jit
def _score_one_block(sb, qv, w, k_ptr, ks_ptr, bt_ptr, key_ptr, tok0, r, n, n_tok, stride_kr,
                     stride_ksp, stride_btr, stride_keyt, D, PAGE: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, G: tl.constexpr,
                     BLOCK_H: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
                     TILE: tl.constexpr, NT: tl.constexpr, EVEN_D: tl.constexpr,
                     F8Q: tl.constexpr):
    if F8Q:
        _score_block_f8q(sb, qv, w, k_ptr, ks_ptr, bt_ptr, key_ptr, tok0, r, n, n_tok,
                         stride_kr, stride_ksp, stride_btr, stride_keyt, D, PAGE, BLOCK_D,
                         BLOCK_S, G, BLOCK_H, EVEN_D)
    else:
        _score_block(sb, qv, w, k_ptr, ks_ptr, bt_ptr, key_ptr, tok0, r, n, n_tok,
                     stride_kr, stride_ksp, stride_btr, stride_keyt, D, PAGE, BLOCK_D,
                     BLOCK_S, G, BLOCK_H, IEEE, FP8, TILE, NT, EVEN_D)


@triton.jit
def _score_tokens(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, key_ptr, r, tok, n_tok, rows, T,
                  stride_qt, stride_qh, stride_wt, stride_kr, stride_ksp, stride_btr,
                  stride_keyt, HI, D, NPROG,
                  G: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
                  FP8: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
                  EVEN_D: tl.constexpr, FOR_LOOP: tl.constexpr, STAGES: tl.constexpr,
                  F8Q: tl.constexpr):
    """Keys of the tokens ``tok [G]`` flagged in ``rows [G]``, all of block-table row ``r``:
    each key tile is loaded once and scored for all their heads (one dot with the ``[G *
    BLOCK_H, BLOCK_D]`` queries); this program's blocks are ``pid(1), pid(1) + NPROG, ...``
    below the group's longest length, and token ``g`` writes its columns ``< n_tok[g]`` only.
    ``F8Q``: ``q_ptr`` (and ``k_ptr``) e4m3, ``w_ptr`` the weights times the query scales
    (:func:`quantize_queries`)."""
    tok0 = tl.min(tok, 0)
    offs_m = tl.arange(0, G * BLOCK_H)
    tok_m = tok0 + offs_m // BLOCK_H
    h_m = offs_m % BLOCK_H
    mmask = (h_m < HI) & (tok_m < T)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q_row = q_ptr + tok_m.to(tl.int64)[:, None] * stride_qt + h_m[:, None] * stride_qh
    qv = tl.load(q_row + offs_d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
    if F8Q:
        qv = tl.trans(qv)                                        # [BLOCK_D, G * BLOCK_H] e4m3
    elif IEEE:
        qv = qv.to(tl.float32)
    w = tl.load(w_ptr + tok_m.to(tl.int64) * stride_wt + h_m, mask=mmask, other=0.0)
    n_tok = tl.where(rows, n_tok, 0)
    n = tl.max(n_tok, 0)
    nblk = (n + BLOCK_S - 1) // BLOCK_S
    if FOR_LOOP:
        for sb in tl.range(tl.program_id(1), nblk, NPROG, num_stages=STAGES):
            _score_one_block(sb, qv, w, k_ptr, ks_ptr, bt_ptr, key_ptr, tok0, r, n, n_tok,
                             stride_kr, stride_ksp, stride_btr, stride_keyt, D, PAGE, BLOCK_D,
                             BLOCK_S, G, BLOCK_H, IEEE, FP8, TILE, NT, EVEN_D, F8Q)
    else:   # the interpreter of triton 3.6 cannot take loaded bounds in a `for`
        sb = tl.program_id(1)
        while sb < nblk:
            _score_one_block(sb, qv, w, k_ptr, ks_ptr, bt_ptr, key_ptr, tok0, r, n, n_tok,
                             stride_kr, stride_ksp, stride_btr, stride_keyt, D, PAGE, BLOCK_D,
                             BLOCK_S, G, BLOCK_H, IEEE, FP8, TILE, NT, EVEN_D, F8Q)
            sb += NPROG


@triton.jit
def _indexer_keys_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, req_ptr, pos_ptr, key_ptr, len_ptr,
                         hist_ptr, T, W, HI, D, NPROG,
                         stride_qt, stride_qh, stride_wt, stride_kr, stride_ksp, stride_btr,
                         stride_keyt, stride_h, HIST_W,
                         G: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
                         FP8: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
                         EVEN_D: tl.constexpr, FOR_LOOP: tl.constexpr, STAGES: tl.constexpr,
                         F8Q: tl.constexpr, ZERO_HIST: tl.constexpr, HIST_BLOCK: tl.constexpr):
    """Program ``(i, j)``: tokens ``i * G .. i * G + G - 1``; those of the first one's request
    are scored together (MTP / prefill token groups share every key load), any other one alone.
    Length of token ``t``: ``min(pos + 1, W)`` (0 for padding), written to ``len_ptr[t]``.

    Unquantized keys: ``k_ptr`` rows of ``stride_kr`` elements, flat row ``blk * PAGE + o``.
    ``FP8``: page-split keys (:class:`hisparse.ops.quant.FP8KeyLayout`): ``k_ptr`` the uint8
    pages (``stride_kr`` bytes apart), ``ks_ptr`` the same memory as fp32 (``stride_ksp`` words
    per page). Slot ``o`` of page ``blk`` has its ``D`` e4m3 values at byte ``o * D`` (16-B
    aligned rows: plain vector loads) and its ``NT`` scales at word ``PAGE * D / 4 + o * NT``.
    ``F8Q`` (one tile, e4m3 queries): one e4m3 x e4m3 dot per key tile, keys on the M side,
    the query scales in ``w``, the key's scale after the head sum. Otherwise one tile
    (``NT == 1``): one dot over the e4m3 values upcast, times the key's power-of-two scale
    after the dot (exact: ``relu(c * x) = c * relu(x)`` for ``c > 0``, and scaling by a power
    of two commutes with fp32 rounding); several tiles: each value is scaled by its tile's
    scale before the dot (exact in bf16 as well).

    ``ZERO_HIST``: programs ``(i, 0)`` also zero rows ``tok`` of the next top-k's histogram
    scratch (``hist_ptr [T, HIST_W]`` int32, :class:`hisparse.ops.topk.TopkScratch`'s
    ``hist``), which nothing here reads: the top-k, the next launch, skips its fill."""
    tok0 = tl.program_id(0) * G
    offs_g = tl.arange(0, G)
    tok = tok0 + offs_g
    tmask = tok < T
    if ZERO_HIST:
        offs_z = tl.arange(0, HIST_BLOCK)
        zrow = tmask & (offs_g * 0 + tl.program_id(1) == 0)
        tl.store(hist_ptr + tok.to(tl.int64)[:, None] * stride_h + offs_z[None, :],
                 tl.zeros([G, HIST_BLOCK], dtype=tl.int32),
                 mask=zrow[:, None] & (offs_z < HIST_W)[None, :])
    req = tl.load(req_ptr + tok, mask=tmask, other=-1)
    pos = tl.load(pos_ptr + tok, mask=tmask, other=-1)
    n_tok = tl.where(req >= 0, tl.minimum(tl.maximum(pos + 1, 0), W), 0)
    tl.store(len_ptr + tok, n_tok, mask=tmask & (offs_g * 0 + tl.program_id(1) == 0))
    r0 = tl.load(req_ptr + tok0)
    _score_tokens(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, key_ptr, r0, tok, n_tok,
                  (req == r0) & (req >= 0), T, stride_qt, stride_qh, stride_wt, stride_kr,
                  stride_ksp, stride_btr, stride_keyt, HI, D, NPROG, G, PAGE, BLOCK_H, BLOCK_D,
                  BLOCK_S, IEEE, FP8, TILE, NT, EVEN_D, FOR_LOOP, STAGES, F8Q)
    for i in tl.static_range(1, G):
        ri = tl.load(req_ptr + tok0 + i, mask=tok0 + i < T, other=-1)
        if (ri != r0) & (ri >= 0):          # a token of another request: alone
            _score_tokens(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, key_ptr, ri, tok, n_tok,
                          offs_g == i, T, stride_qt, stride_qh, stride_wt, stride_kr,
                          stride_ksp, stride_btr, stride_keyt, HI, D, NPROG, G, PAGE, BLOCK_H,
                          BLOCK_D, BLOCK_S, IEEE, FP8, TILE, NT, EVEN_D, FOR_LOOP, STAGES,
                          F8Q)


@triton.jit
def _indexer_queries_kernel(q_ptr, w_ptr, out_ptr, scale_ptr, wq_ptr, cos_ptr, sin_ptr, HI,
                            stride_qt, stride_qh, stride_wt, stride_wp, stride_cs, w_scale,
                            D: tl.constexpr, TILE: tl.constexpr,
                            NT: tl.constexpr, BLOCK_H: tl.constexpr, LOG_D: tl.constexpr,
                            ROT_SCALE: tl.constexpr, DT: tl.constexpr, QUANT: tl.constexpr,
                            FOLD: tl.constexpr, H2: tl.constexpr, INTERLEAVED: tl.constexpr,
                            W_SCALE: tl.constexpr, W_PARTS: tl.constexpr):
    """Token ``pid(0)``, heads ``pid(1) * BLOCK_H ..``: ``H2 > 0``: first the RoPE of each
    head's first ``2 * H2`` dims (bit for bit :func:`hisparse.ops.glue.rope_heads`: every
    product and sum rounded to ``DT``); each head rotated (the indexer rotation in ``DT``, bit
    for bit :func:`hisparse.ops.rotation.indexer_rotation`), then, with ``QUANT``, its e4m3
    codes ``[T, HI, D]`` and power-of-two scales ``[T, HI, NT]`` per (head, tile) (the keys'
    rule, bit for bit) and, ``FOLD`` (one tile), ``wq = w * scale`` (``W_SCALE``: ``(w *
    w_scale) * scale``, the fp32 multiplies of ``(w.float() * w_scale)`` then the fold;
    ``W_PARTS > 0``: ``w`` is the sum of that many fp32 parts ``stride_wp`` apart, from zero
    in order: a :class:`~hisparse.ops.pending.PendingSum` of one group); without, the rotated
    values ``[T, HI, D]`` in ``DT``."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, NT)
    offs_j = tl.arange(0, TILE)
    offs = (offs_i[:, None] * TILE + offs_j[None, :])[None, :, :]        # [1, NT, TILE]
    hmask = offs_h < HI
    h3 = offs_h[:, None, None]
    src = q_ptr + t * stride_qt + h3 * stride_qh
    x = tl.load(src + offs, mask=hmask[:, None, None], other=0.0).to(tl.float32)
    if H2 > 0:      # the rope_heads kernel's values, in registers instead of a store and load
        inr = offs < 2 * H2
        j, p, q = _rope_src(offs, H2, INTERLEAVED)
        m = hmask[:, None, None] & inr
        a = tl.load(src + p, mask=m, other=0.0).to(tl.float32)
        b = tl.load(src + q, mask=m, other=0.0).to(tl.float32)
        cs = tl.load(cos_ptr + t * stride_cs + j, mask=inr, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + t * stride_cs + j, mask=inr, other=0.0).to(tl.float32)
        x = tl.where(inr, _rope_pair(a, b, cs, sn, offs < H2, DT), x)   # [BLOCK_H, NT, TILE]
    x = tl.reshape(_hadamard(tl.reshape(x, (BLOCK_H, D)), BLOCK_H, D, LOG_D, ROT_SCALE, DT),
                   (BLOCK_H, NT, TILE))
    if QUANT:
        scale, inv = _pow2_scale(tl.max(tl.abs(x), axis=2))            # [BLOCK_H, NT]
        code = _e4m3_code(x * inv[:, :, None])
        tl.store(out_ptr + (t * HI + h3) * D + offs, code.to(tl.uint8),
                 mask=hmask[:, None, None])
        tl.store(scale_ptr + (t * HI + offs_h[:, None]) * NT + offs_i[None, :], scale,
                 mask=hmask[:, None])
        if FOLD:
            if W_PARTS > 0:
                w = _ordered_sum(w_ptr + t * stride_wt + offs_h, hmask, stride_wp, W_PARTS,
                                 W_PARTS, BLOCK_H)
            else:
                w = tl.load(w_ptr + t * stride_wt + offs_h, mask=hmask, other=0.0).to(tl.float32)
            if W_SCALE:
                w = w * w_scale
            tl.store(wq_ptr + t * HI + offs_h, w * tl.sum(scale, axis=1), mask=hmask)
    else:
        tl.store(out_ptr + (t * HI + h3) * D + offs, x.to(out_ptr.dtype.element_ty),
                 mask=hmask[:, None, None])


def _queries(q, weights, quant: bool, rope=None, weight_scale=None):
    T, HI, D = q.shape
    check_rotation_dim(D)
    tile = fp8_tile(D)
    nt = D // tile
    if (rope is not None or weight_scale is not None) and not (quant and nt == 1):
        raise ValueError("quantize_queries: the RoPE and the weight scale fold into one "
                         f"scale tile's quantization only (D <= 128), got D = {D}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    if quant:
        out = torch.empty((T, HI, D), dtype=torch.uint8, device=q.device)
        scales = torch.empty((T, HI, nt), dtype=torch.float32, device=q.device)
        wq = torch.empty((T, HI), dtype=torch.float32, device=q.device) if nt == 1 else None
    else:
        out, scales, wq = torch.empty_like(q), None, None
    if rope is None:
        cos = sin = q
        h2, interleaved = 0, False
    else:
        cos, sin, rope_dim, interleaved = rope
        if tuple(cos.shape) != (T, rope_dim // 2) or tuple(sin.shape) != (T, rope_dim // 2):
            raise ValueError(f"quantize_queries: cos/sin must be [{T}, {rope_dim // 2}], got "
                             f"{tuple(cos.shape)} / {tuple(sin.shape)}")
        cos, sin, h2 = cos.contiguous(), sin.contiguous(), rope_dim // 2
    if isinstance(weights, PendingSum):
        if (wq is None or weights.group != weights.count or weights.shape != (T, HI)
                or weights.bias is not None or weights.dtype != torch.float32):
            raise ValueError(f"quantize_queries: pending weights fold into one scale tile's "
                             f"quantization as one group of fp32 [{T}, {HI}] parts, no bias, only")
        w_base, stride_wt, stride_wp, w_parts = (weights.base, weights.row_stride,
                                                 weights.part_stride, weights.count)
    else:
        w_base, w_parts, stride_wp = (q if weights is None else weights), 0, 0
        stride_wt = 0 if weights is None else weights.stride(0)
    if T:
        block_h = min(16, next_pow2(HI))
        _indexer_queries_kernel[(T, triton.cdiv(HI, block_h))](
            q, w_base, out, out if scales is None else scales,
            out if wq is None else wq, cos, sin, HI, q.stride(0), q.stride(1),
            stride_wt, stride_wp, cos.stride(0),
            1.0 if weight_scale is None else float(weight_scale), D=D, TILE=tile, NT=nt,
            BLOCK_H=block_h, LOG_D=D.bit_length() - 1, ROT_SCALE=D ** -0.5,
            DT=_TL_DTYPE[q.dtype], QUANT=quant, FOLD=quant and nt == 1, H2=h2,
            INTERLEAVED=interleaved, W_SCALE=weight_scale is not None, W_PARTS=w_parts,
            num_warps=4)
    return out, scales, wq


def quantize_queries(q, weights, rope=None, weight_scale=None):
    """``q [T, HI, D]`` -> (e4m3 codes ``[T, HI, D]`` uint8, scales ``[T, HI, NT]`` fp32,
    ``weights * scale`` ``[T, HI]`` fp32 when one tile (``NT == 1``), else None) of the rotated
    queries: bit for bit :func:`hisparse.ops.quant.quantize_index_queries_reference`. One
    launch, no host sync.

    Folded in (one tile only): ``rope = (cos, sin, rope_dim, interleaved)`` (``cos`` / ``sin``
    ``[T, rope_dim // 2]``): ``q`` is ``wq_b``'s output and the queries quantized are
    ``glue.rope_heads(q, cos, sin, rope_dim, interleaved)``, bit for bit; ``weight_scale``
    (a float): ``weights`` are unscaled and the result is ``(weights.float() * weight_scale)
    * scale``, the same fp32 multiplies as scaling first."""
    return _queries(q, weights, True, rope, weight_scale)


def rotate_queries(q):
    """``q [T, HI, D]`` -> ``indexer_rotation(q)`` (same dtype; bit for bit the reference): the
    unquantized queries scored against FP8 keys. One launch, no host sync."""
    return _queries(q, None, False)[0]


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# (BLOCK_S, programs per SM, num_warps, num_stages): CUDA defaults per path, and the CPU one.
# FP8 queries: the [BLOCK_S, G * 64] fp32 accumulator grows with the token group; from G = 4
# on, 128 x 256 at 4 warps spills (ptxas, sm_90a): smaller tiles and 8 warps there.
CONFIG_CUDA = (128, 8, 4, 2)
CONFIG_CUDA_F8Q = (128, 8, 4, 2)
CONFIG_CUDA_F8Q_WIDE = (64, 8, 8, 3)
CONFIG_CPU = (64, 1, 4, 1)


def indexer_keys(q, weights, k_cache, block_table, token_req, token_pos, block_size, config=None,
                 out=None, lengths=None, group: int = 1, fp8_query: bool = True, rope=None,
                 weight_scale=None, hist=None):
    """Orderable int32 score keys ``[T, W]`` (``W = P * block_size``; :func:`hisparse.ops.topk.
    orderable_keys` of the fp32 score, ``INT32_MIN`` for an unmapped page) and each token's
    length ``[T]`` int32 (``min(pos + 1, W)``, 0 for padding). Only columns ``< length`` are
    written: the work and traffic of a token follow its own length, not ``W``.

    ``k_cache``: one layer's keys ``[rows, D]``, or FP8 page-split keys ``[blocks, block_size *
    key_bytes]`` uint8 (``quant.FP8KeyLayout``). ``out`` / ``lengths``: preallocated ``[T, W]``
    (unit column stride, e.g. a workspace view) and ``[T]`` int32 buffers. ``group``: tokens per
    program (a power of two): consecutive tokens of one request (MTP verify, prefill chunks) read
    each key once for all of them. ``config``: ``(BLOCK_S, programs per SM (on CPU: per
    token group), num_warps, num_stages)``.

    FP8 keys hold rotated keys (:mod:`hisparse.ops.rotation`): the queries are rotated first
    (one small launch, fused with their quantization). ``fp8_query`` (FP8 keys only): the
    rotated queries are quantized to e4m3 like the keys (:func:`quantize_queries`) and scored
    against them: one scale tile (``D <= 128``) runs one e4m3 x e4m3 dot per key tile with the
    query scales folded into the head weights; several tiles score the dequantized queries on
    the upcast path. False: the rotated queries stay in their dtype against the upcast keys
    (:func:`rotate_queries`; the path before, a baseline).

    ``rope = (cos, sin, rope_dim, interleaved)`` / ``weight_scale``: ``q`` and ``weights`` are
    ``wq_b``'s and ``weights_proj``'s outputs, their RoPE and scale still to apply, done in the
    query quantization (:func:`quantize_queries`; FP8 keys and queries of one tile only, else
    a ``ValueError``); ``weights`` may then be a :class:`~hisparse.ops.pending.PendingSum` of
    one group (:func:`hisparse.ops.fp32_linear`'s partials), summed in that kernel (other
    paths materialize it). ``hist``: the next top-k's ``TopkScratch.hist[:T]``, zeroed by the
    scoring kernel (then call :func:`hisparse.ops.topk.topk_select` with ``hist_zeroed``)."""
    T, HI, D = q.shape
    W = block_table.shape[1] * block_size
    if out is None:
        keys = torch.empty((T, W), dtype=torch.int32, device=q.device)
    else:
        if out.shape != (T, W) or out.stride(-1) != 1 or out.dtype != torch.int32:
            raise ValueError(f"indexer_keys: out must be [{T}, {W}] int32 with unit column "
                             f"stride, got {tuple(out.shape)} {out.dtype}")
        keys = out
    if lengths is None:
        lengths = torch.empty(T, dtype=torch.int32, device=q.device)
    elif lengths.shape != (T,) or lengths.dtype != torch.int32:
        raise ValueError(f"indexer_keys: lengths must be [{T}] int32")
    if group < 1 or group & (group - 1):
        raise ValueError(f"indexer_keys: group must be a power of two, got {group}")
    if T == 0:
        return keys, lengths
    fp8 = k_cache.dtype == torch.uint8
    tile = nt = 1
    if fp8:
        from .quant import FP8KeyLayout
        layout = FP8KeyLayout.of(k_cache, D)
        if layout.block_size != block_size or k_cache.dim() != 2:
            raise ValueError(f"indexer_keys: FP8 keys must be one layer's pages [blocks, "
                             f"{block_size} * {layout.key_bytes}], got {tuple(k_cache.shape)}")
        if q.is_cuda and (layout.page_bytes % 16 or k_cache.stride(0) % 16
                          or k_cache.data_ptr() % 16):
            # 16-B aligned value rows are the point of the layout; smaller pages (block_size
            # < 4) would only be 4- or 8-B aligned, and Triton's alignment analysis has issued
            # 16-B loads on such rows before (misaligned address on the H200).
            raise ValueError(f"indexer_keys: FP8 key pages on CUDA must be 16-B aligned "
                             f"(block_size {block_size} x {layout.key_bytes} B)")
        tile = fp8_tile(D)
        nt = D // tile
        k_scale = k_cache.view(torch.float32)
        stride_ksp = k_scale.stride(0)
    else:
        if k_cache.dtype != q.dtype and q.dtype != torch.float32:
            k_cache = k_cache.to(q.dtype)
        k_scale, stride_ksp = k_cache, 0
    # the CPU interpreter's bf16 tl.dot is wrong (triton 3.9): upcast there too
    ieee = q.dtype == torch.float32 or k_cache.dtype == torch.float32 or not q.is_cuda
    f8q = fp8 and fp8_query
    if not (isinstance(weights, PendingSum) and f8q and nt == 1):
        weights = summed(weights).float()   # only the one-tile FP8 query kernel sums parts
    if (rope is not None or weight_scale is not None) and not (f8q and nt == 1):
        raise ValueError("indexer_keys: the queries' RoPE and weight scale fold into FP8 "
                         "queries of one scale tile only")
    if hist is not None and (hist.dim() != 2 or hist.shape[0] != T or hist.stride(1) != 1
                             or hist.dtype != torch.int32):
        raise ValueError(f"indexer_keys: hist must be [{T}, *] int32 with unit column stride, "
                         f"got {tuple(hist.shape)} {hist.dtype}")
    if f8q:
        codes, scales, wq = quantize_queries(q, weights, rope, weight_scale)
        if nt == 1:
            q, weights = codes.view(torch.float8_e4m3fn), wq
            k_cache = k_cache.view(torch.float8_e4m3fn)
        else:   # per-tile scales do not factor out of the dot: dequantized queries (exact)
            from .quant import dequantize_index_queries_reference
            q = dequantize_index_queries_reference(codes, scales, q.dtype)
            f8q = False
    elif fp8:       # FP8 keys are stored rotated: so are the queries scored against them
        q = rotate_queries(q)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_h = max(16 // group, next_pow2(HI))           # G * BLOCK_H >= 16 rows for tl.dot
    block_d = max(32 if f8q else 16, next_pow2(D))      # e4m3 dots take K in steps of 32
    if config is None:
        if not q.is_cuda:
            config = CONFIG_CPU
        elif f8q:
            config = CONFIG_CUDA_F8Q if group * block_h <= 128 else CONFIG_CUDA_F8Q_WIDE
        else:
            config = CONFIG_CUDA
    block_s, per_sm, nw, stages = config
    programs = triton.cdiv(T, group)
    nblk = triton.cdiv(W, block_s)
    # a fixed grid (CUDA-graph safe); each program strides over its tokens' blocks up to their
    # length, so the grid only needs enough programs to fill the GPU
    nprog = per_sm if not q.is_cuda else triton.cdiv(per_sm * _num_sms(q.device.index or 0),
                                                     programs)
    nprog = max(1, min(nblk, nprog))
    zero = hist is not None
    _indexer_keys_kernel[(programs, nprog)](
        q, weights, k_cache, k_scale, block_table, token_req, token_pos, keys, lengths,
        hist if zero else lengths, T, W, HI, D, nprog,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), stride_ksp,
        block_table.stride(0), keys.stride(0), hist.stride(0) if zero else 0,
        hist.shape[1] if zero else 0,
        G=group, PAGE=block_size, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_S=block_s, IEEE=ieee,
        FP8=fp8, TILE=tile, NT=nt, EVEN_D=block_d == D, FOR_LOOP=not interpreted(),
        STAGES=stages, F8Q=f8q, ZERO_HIST=zero,
        HIST_BLOCK=next_pow2(hist.shape[1]) if zero else 1, num_warps=nw,
    )
    return keys, lengths
