"""Triton kernels of the fused glue ops (imported lazily by glue.py).

One program per token (per token and head for the queries); every value is computed with the
reference's roundings: ``_rnd`` rounds an fp32 intermediate to the model dtype wherever torch
would store one (each RoPE product and sum, the normalised value before the norm weight), so
only the norms' reductions differ in order from the reference. FP8 outputs go through the exact
integer encoders of :mod:`hisparse.ops._quant_triton`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import fp8_tile, next_pow2
from ._gemm_triton import _quant_rows
from ._quant_triton import _TL_DTYPE, _bf16_bits, _hadamard, _rnd, _store_fp8_tiles
from .block_fp8 import FP8Rows


@triton.jit
def _rope_lo(a, b, c, s, DT: tl.constexpr):
    """First half of a rotated pair ``(a, b)``: ``a*c - b*s``, each product and the sum
    rounded to DT."""
    return _rnd(_rnd(a * c, DT) - _rnd(b * s, DT), DT)


@triton.jit
def _rope_hi(a, b, c, s, DT: tl.constexpr):
    """Second half: ``b*c + a*s``."""
    return _rnd(_rnd(b * c, DT) + _rnd(a * s, DT), DT)


@triton.jit
def _rope_pair(a, b, c, s, first, DT: tl.constexpr):
    """``_rope_lo`` where ``first``, else ``_rope_hi`` (elementwise)."""
    return tl.where(first, _rope_lo(a, b, c, s, DT), _rope_hi(a, b, c, s, DT))


@triton.jit
def _rope_src(i, H2: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Output dim ``i < 2 * H2`` of a RoPE'd vector reads inputs ``p`` and ``q`` (pair ``j``)."""
    j = i % H2
    if INTERLEAVED:
        p = 2 * j
        q = 2 * j + 1
    else:
        p = j
        q = j + H2
    return j, p, q


# ----------------------------------------------------------------------------- RMSNorm
@triton.jit
def _ordered_sum(ptr, m, stride_p, PARTS: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK: tl.constexpr):
    """fp32 sum of the ``PARTS`` vectors at ``ptr + p * stride_p``: each group of ``GROUP``
    parts summed from zero in order, then the groups from zero in order (the split-K reduction's
    additions, ``_fp8_splitk_reduce_kernel``; one group is the MoE combine's, whose extra
    ``0 + gsum`` is exact: a sum begun at +0 is never -0)."""
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for g in tl.static_range((PARTS + GROUP - 1) // GROUP):
        gsum = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(GROUP):
            if g * GROUP + j < PARTS:
                gsum += tl.load(ptr + (g * GROUP + j) * stride_p, mask=m,
                                other=0.0).to(tl.float32)
        total += gsum
    return total


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, h_ptr, y32_ptr, q_ptr, s_ptr, D,
                         stride_x, stride_p, stride_r, stride_y, stride_h, stride_y32, stride_q,
                         stride_s, eps, PARTS: tl.constexpr, GROUP: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_Y32: tl.constexpr,
                         QUANT: tl.constexpr, QBK: tl.constexpr, POW2: tl.constexpr,
                         BLOCK: tl.constexpr, DT: tl.constexpr):
    """``PARTS = 0``: ``x`` is the row; else the row is the pending sum of ``PARTS`` parts
    ``stride_p`` apart (:mod:`hisparse.ops.pending`), rounded to DT as its own reduction's
    store rounds (a cast), plus the bias (rounded, as torch's add). ``QUANT``: the output row
    also as FP8 per ``1 x QBK`` tile (``q``, ``s``), through the FP8 linears' own quantizer
    (``_quant_rows``) on the stored values: bitwise what a linear reading ``y`` makes of it."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    if PARTS == 0:
        x = tl.load(x_ptr + t * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    else:
        x = _ordered_sum(x_ptr + t * stride_x + offs, m, stride_p, PARTS, GROUP, BLOCK)
        x = x.to(DT).to(tl.float32)
        if HAS_BIAS:
            x = _rnd(x + tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32), DT)
    if HAS_RES:
        r = tl.load(r_ptr + t * stride_r + offs, mask=m, other=0.0).to(tl.float32)
        x = _rnd(x + r, DT)
    if HAS_RES or PARTS > 0:
        tl.store(h_ptr + t * stride_h + offs, x.to(DT), mask=m)
    ms = tl.sum(x * x, axis=0) / D
    n = _rnd(x * tl.math.rsqrt(ms + eps), DT)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = (w * n).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * stride_y + offs, y, mask=m)
    if HAS_Y32:
        tl.store(y32_ptr + t * stride_y32 + offs, y.to(tl.float32), mask=m)
    if QUANT:   # the row's tiles as the rows of a [BLOCK / QBK, QBK] tile (the tail is zeros)
        q, sa = _quant_rows(tl.reshape(y.to(tl.float32), (BLOCK // QBK, QBK)), POW2)
        tiles = tl.arange(0, BLOCK // QBK)
        # 8 columns a store (the reshape's layout): a wider vector store would move the FP8
        # tile through shared memory first (a layout conversion and two barriers)
        at = tl.max_contiguous(tiles[:, None] * QBK + tl.arange(0, QBK)[None, :], [1, 8])
        tl.store(q_ptr + t * stride_q + at, q, mask=at < D)
        tl.store(s_ptr + t * stride_s + tiles, sa, mask=tiles * QBK < D)


def _fp8_outputs(y: torch.Tensor, fp8_rows: tuple[int, bool] | None):
    """The norm's FP8 copy of ``y [T, D]``: ``(rows, (q_ptr, s_ptr), (stride_q, stride_s),
    meta)``, the kernel's arguments for it (``y`` in the pointers' places when not asked) and
    its meta-parameters, the row block included (``D`` rounded up to a power of two and to
    whole tiles; :func:`hisparse.ops.glue.add_rms_norm` checked ``block_k``)."""
    T, D = y.shape
    block = next_pow2(D)
    if fp8_rows is None:
        return None, (y, y), (0, 0), dict(QUANT=False, QBK=16, POW2=False, BLOCK=block)
    bk, pow2 = fp8_rows
    q = torch.empty(T, D, device=y.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(T, triton.cdiv(D, bk), device=y.device, dtype=torch.float32)
    meta = dict(QUANT=True, QBK=bk, POW2=bool(pow2), BLOCK=max(block, bk))
    return FP8Rows(q, s, bk, bool(pow2)), (q, s), (q.stride(0), s.stride(0)), meta


def _norm_outputs(y, h, y32, fp32_copy: bool, rows: FP8Rows | None) -> tuple:
    return (y, h) + ((y32,) if fp32_copy else ()) + ((rows,) if rows is not None else ())


def add_rms_norm_triton(x, residual, weight, eps: float, fp32_copy: bool = False,
                        fp8_rows: tuple[int, bool] | None = None):
    """``(y, h)``, then ``y32`` with ``fp32_copy``, then an :class:`FP8Rows` of ``y`` with
    ``fp8_rows = (block_k, pow2_scale)``."""
    T, D = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(T, D, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    if residual is None:
        h, r = x, x
    else:
        r = residual if residual.stride(1) == 1 else residual.contiguous()
        h = torch.empty_like(x)
    y32 = torch.empty(T, D, device=x.device, dtype=torch.float32) if fp32_copy else y
    rows, qs, q_strides, meta = _fp8_outputs(y, fp8_rows)
    _add_rms_norm_kernel[(T,)](x, r, weight, weight, y, h, y32, *qs, D, x.stride(0), 0,
                               r.stride(0), y.stride(0), h.stride(0), y32.stride(0), *q_strides,
                               float(eps), PARTS=0, GROUP=1, HAS_BIAS=False,
                               HAS_RES=residual is not None, HAS_Y32=fp32_copy,
                               DT=_TL_DTYPE[x.dtype],
                               num_warps=min(16, max(1, meta["BLOCK"] // 512)), **meta)
    return _norm_outputs(y, h, y32, fp32_copy, rows)


def add_rms_norm_sum_triton(s, residual, weight, eps: float, fp32_copy: bool = False,
                            fp8_rows: tuple[int, bool] | None = None):
    """:func:`add_rms_norm_triton` of a :class:`~hisparse.ops.pending.PendingSum` ``s``: the
    sum done in the norm's program (``h`` is always a new tensor: the sum's value)."""
    T, D = s.shape
    dtype = s.dtype
    y = torch.empty(T, D, device=s.device, dtype=torch.promote_types(weight.dtype, dtype))
    h = torch.empty(T, D, device=s.device, dtype=dtype)
    r = h if residual is None else (residual if residual.stride(1) == 1
                                    else residual.contiguous())
    y32 = torch.empty(T, D, device=s.device, dtype=torch.float32) if fp32_copy else y
    rows, qs, q_strides, meta = _fp8_outputs(y, fp8_rows)
    b = weight if s.bias is None else s.bias.to(dtype)
    _add_rms_norm_kernel[(T,)](s.base, r, weight, b, y, h, y32, *qs, D, s.row_stride,
                               s.part_stride, r.stride(0), y.stride(0), h.stride(0),
                               y32.stride(0), *q_strides, float(eps), PARTS=s.count,
                               GROUP=s.group, HAS_BIAS=s.bias is not None,
                               HAS_RES=residual is not None, HAS_Y32=fp32_copy,
                               DT=_TL_DTYPE[dtype],
                               num_warps=min(16, max(1, meta["BLOCK"] // 512)), **meta)
    return _norm_outputs(y, h, y32, fp32_copy, rows)


# ----------------------------------------------------------------------------- MLA rows
@triton.jit
def _mla_row(t, kv_ptr, w_ptr, cos_ptr, sin_ptr, rows_ptr, dst_ptr, dst_f32, dst_i16,
             stride_kv, stride_cs, stride_dst, R, eps,
             NT: tl.constexpr, TILE: tl.constexpr, H2: tl.constexpr,
             BLOCK_H2: tl.constexpr, FP8: tl.constexpr, DT: tl.constexpr):
    """Token ``t``'s row: ``kv [T, R + 2*H2]`` -> row ``rows[t]`` of ``dst``: ``[rms_norm(c) |
    rope(k_pe)]``, float (``dst_ptr`` typed) or FP8 bytes (``dst_ptr`` uint8, 656-B layout for
    512 + 64)."""
    row = tl.load(rows_ptr + t).to(tl.int64)
    src = kv_ptr + t * stride_kv
    offs_i = tl.arange(0, NT)
    offs = offs_i[:, None] * TILE + tl.arange(0, TILE)[None, :]      # [NT, TILE]
    m = offs < R
    c = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    ms = tl.sum(tl.sum(c * c, axis=1), axis=0) / R
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = _rnd(w * _rnd(c * tl.math.rsqrt(ms + eps), DT), DT)
    # RoPE (interleaved): output j of the first half / of the second half
    j = tl.arange(0, BLOCK_H2)
    jm = j < H2
    x1 = tl.load(src + R + 2 * j, mask=jm, other=0.0).to(tl.float32)
    x2 = tl.load(src + R + 2 * j + 1, mask=jm, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + t * stride_cs + j, mask=jm, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + t * stride_cs + j, mask=jm, other=0.0).to(tl.float32)
    lo = _rope_lo(x1, x2, cs, sn, DT)
    hi = _rope_hi(x1, x2, cs, sn, DT)
    if FP8:
        base = row * stride_dst
        scale_at = _store_fp8_tiles(y, dst_ptr, dst_f32, base, 0, offs, offs_i, NT * TILE, NT,
                                    NT * TILE)
        rope_at = (scale_at + 4 * NT) // 2
        tl.store(dst_i16 + rope_at + j, _bf16_bits(lo), mask=jm)
        tl.store(dst_i16 + rope_at + H2 + j, _bf16_bits(hi), mask=jm)
    else:
        out = dst_ptr + row * stride_dst
        ty = dst_ptr.dtype.element_ty
        tl.store(out + offs, y.to(ty), mask=m)
        tl.store(out + R + j, lo.to(ty), mask=jm)
        tl.store(out + R + H2 + j, hi.to(ty), mask=jm)


@triton.jit
def _mla_rows_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, rows_ptr, dst_ptr, dst_f32, dst_i16,
                     qa_ptr, qp_ptr, q_ptr, stride_kv, stride_cs, stride_dst, stride_at,
                     stride_ah, stride_pt, stride_ph, stride_qt, stride_qh, R, RQ, eps,
                     NT: tl.constexpr, TILE: tl.constexpr, H2: tl.constexpr,
                     BLOCK_H2: tl.constexpr, FP8: tl.constexpr, DT: tl.constexpr,
                     HAS_Q: tl.constexpr, BLOCK_RQ: tl.constexpr):
    """Program ``(t, 0)``: token ``t``'s cache row (:func:`_mla_row`). With ``HAS_Q``, programs
    ``(t, 1 + h)`` make head ``h`` of its absorbed query (:func:`_q_latent_head`, as
    :func:`_q_latent_kernel` does): both in one launch."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) if HAS_Q else 0      # without a query the grid is (T, 1)
    if p == 0:
        _mla_row(t, kv_ptr, w_ptr, cos_ptr, sin_ptr, rows_ptr, dst_ptr, dst_f32, dst_i16,
                 stride_kv, stride_cs, stride_dst, R, eps, NT, TILE, H2, BLOCK_H2, FP8, DT)
    else:
        _q_latent_head(t, (p - 1).to(tl.int64), qa_ptr, qp_ptr, cos_ptr, sin_ptr, q_ptr,
                       stride_at, stride_ah, stride_pt, stride_ph, stride_cs, stride_qt,
                       stride_qh, RQ, BLOCK_RQ, H2, BLOCK_H2, DT)


def _tiles(d: int, fp8: bool) -> tuple[int, int]:
    """``(NT, TILE)`` covering ``d`` values: FP8 scale tiles, else one power-of-two block."""
    if fp8:
        tile = fp8_tile(d)
        return d // tile, tile
    return 1, next_pow2(d)


def _q_latent_inputs(q_abs, q_pe):
    """``(q_abs, q_pe, out)`` for :func:`_q_latent_head`: inputs with a contiguous last dim, the
    output ``[T, H, R + rope]`` (a new tensor)."""
    T, H, R = q_abs.shape
    if q_abs.stride(2) != 1:
        q_abs = q_abs.contiguous()
    if q_pe.stride(2) != 1:
        q_pe = q_pe.contiguous()
    out = torch.empty(T, H, R + q_pe.shape[2], device=q_pe.device, dtype=q_pe.dtype)
    return q_abs, q_pe, out


def write_mla_rows_triton(kv, norm_weight, eps, cos, sin, dst, rows, kv_lora_rank: int,
                          q_abs=None, q_pe=None):
    """The rows' write; with ``q_abs`` / ``q_pe`` also the absorbed query in the same launch
    (returned; else None)."""
    T, D = kv.shape
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    cos = cos.contiguous()
    sin = sin.contiguous()
    fp8 = dst.dtype == torch.uint8
    nt, tile = _tiles(kv_lora_rank, fp8)
    h2 = (D - kv_lora_rank) // 2
    rows = rows.to(device=dst.device, dtype=torch.int64)
    aux = (dst.view(torch.float32), dst.view(torch.int16)) if fp8 else (dst, dst)
    heads, rq, q_args, q_strides = 0, 1, (kv, kv, kv), (0,) * 6
    out = None
    if q_abs is not None:
        q_abs, q_pe, out = _q_latent_inputs(q_abs, q_pe)
        heads, rq = q_abs.shape[1], q_abs.shape[2]
        q_args = (q_abs, q_pe, out)
        q_strides = (q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1),
                     out.stride(0), out.stride(1))
    _mla_rows_kernel[(T, 1 + heads)](kv, norm_weight, cos, sin, rows, dst, *aux, *q_args,
                                     kv.stride(0), cos.stride(0), dst.stride(0), *q_strides,
                                     kv_lora_rank, rq, float(eps), NT=nt, TILE=tile, H2=h2,
                                     BLOCK_H2=next_pow2(h2), FP8=fp8, DT=_TL_DTYPE[kv.dtype],
                                     HAS_Q=out is not None, BLOCK_RQ=next_pow2(rq),
                                     num_warps=4)
    return out


# ----------------------------------------------------------------------------- indexer keys
@triton.jit
def _ln_at(src, w_ptr, b_ptr, idx, m, mean, rstd, DT: tl.constexpr):
    """The LayerNorm output (rounded to DT) at dims ``idx``."""
    x = tl.load(src + idx, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + idx, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + idx, mask=m, other=0.0).to(tl.float32)
    return _rnd((x - mean) * rstd * w + b, DT)


@triton.jit
def _index_keys_kernel(k_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, rows_ptr, dst_ptr, dst_f32,
                       stride_k, stride_cs, stride_page, Di, eps,
                       NT: tl.constexpr, TILE: tl.constexpr, H2: tl.constexpr,
                       INTERLEAVED: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
                       DT: tl.constexpr, LOG_D: tl.constexpr, ROT_SCALE: tl.constexpr):
    """``k [T, Di]`` -> key of flat row ``rows[t]``: LayerNorm, RoPE on the first ``2*H2``
    dims; float rows ``[N, Di]`` or FP8 page-split pages (``PAGE`` keys per page) of the rotated
    key (:mod:`hisparse.ops.rotation`, in DT; ``LOG_D``, ``ROT_SCALE``: its size and scale)."""
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + t).to(tl.int64)
    src = k_ptr + t * stride_k
    offs_i = tl.arange(0, NT)
    i = offs_i[:, None] * TILE + tl.arange(0, TILE)[None, :]            # [NT, TILE]
    m = i < Di
    x = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(tl.sum(x, axis=1), axis=0) / Di
    xc = tl.where(m, x - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(tl.sum(xc * xc, axis=1), axis=0) / Di + eps)
    y = _ln_at(src, w_ptr, b_ptr, i, m, mean, rstd, DT)
    inr = i < 2 * H2
    j, p, q = _rope_src(i, H2, INTERLEAVED)
    a = _ln_at(src, w_ptr, b_ptr, p, inr, mean, rstd, DT)
    b = _ln_at(src, w_ptr, b_ptr, q, inr, mean, rstd, DT)
    cs = tl.load(cos_ptr + t * stride_cs + j, mask=inr, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + t * stride_cs + j, mask=inr, other=0.0).to(tl.float32)
    y = tl.where(inr, _rope_pair(a, b, cs, sn, i < H2, DT), y)
    if FP8:
        y = tl.reshape(_hadamard(tl.reshape(y, (1, NT * TILE)), 1, NT * TILE, LOG_D, ROT_SCALE,
                                 DT), (NT, TILE))
        _store_fp8_tiles(y, dst_ptr, dst_f32, (row // PAGE) * stride_page, row % PAGE, i,
                         offs_i, NT * TILE, NT, PAGE * NT * TILE)
    else:
        tl.store(dst_ptr + row * stride_page + i, y.to(dst_ptr.dtype.element_ty), mask=m)


def write_index_keys_triton(k, ln_weight, ln_bias, eps, cos, sin, rope_dim: int,
                            interleaved: bool, dst, rows, block_size: int) -> None:
    T, d = k.shape
    k = k if k.stride(1) == 1 else k.contiguous()
    cos = cos.contiguous()
    sin = sin.contiguous()
    fp8 = dst.dtype == torch.uint8
    nt, tile = _tiles(d, fp8)
    rows = rows.to(device=dst.device, dtype=torch.int64)
    aux = dst.view(torch.float32) if fp8 else dst
    _index_keys_kernel[(T,)](k, ln_weight, ln_bias, cos, sin, rows, dst, aux, k.stride(0),
                             cos.stride(0), dst.stride(0), d, float(eps), NT=nt, TILE=tile,
                             H2=rope_dim // 2, INTERLEAVED=interleaved,
                             PAGE=block_size if fp8 else 1, FP8=fp8, DT=_TL_DTYPE[k.dtype],
                             LOG_D=max(0, d.bit_length() - 1), ROT_SCALE=d ** -0.5,
                             num_warps=1 if d <= 256 else 4)


# ----------------------------------------------------------------------------- queries
@triton.jit
def _rope_heads_kernel(q_ptr, cos_ptr, sin_ptr, out_ptr, stride_qt, stride_qh, stride_cs,
                       stride_ot, stride_oh, D, H2: tl.constexpr, INTERLEAVED: tl.constexpr,
                       BLOCK: tl.constexpr, DT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    src = q_ptr + t * stride_qt + h * stride_qh
    i = tl.arange(0, BLOCK)
    m = i < D
    inr = i < 2 * H2
    j, p, q = _rope_src(i, H2, INTERLEAVED)
    y = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    a = tl.load(src + p, mask=inr, other=0.0).to(tl.float32)
    b = tl.load(src + q, mask=inr, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + t * stride_cs + j, mask=inr, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + t * stride_cs + j, mask=inr, other=0.0).to(tl.float32)
    y = tl.where(inr, _rope_pair(a, b, cs, sn, i < H2, DT), y)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + i, y.to(out_ptr.dtype.element_ty), mask=m)


def rope_heads_triton(q, cos, sin, rope_dim: int, interleaved: bool):
    T, Hn, D = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    cos = cos.contiguous()
    sin = sin.contiguous()
    out = torch.empty(T, Hn, D, device=q.device, dtype=q.dtype)
    _rope_heads_kernel[(T, Hn)](q, cos, sin, out, q.stride(0), q.stride(1), cos.stride(0),
                                out.stride(0), out.stride(1), D, H2=rope_dim // 2,
                                INTERLEAVED=interleaved, BLOCK=next_pow2(D),
                                DT=_TL_DTYPE[q.dtype], num_warps=1)
    return out


@triton.jit
def _q_latent_head(t, h, qa_ptr, qp_ptr, cos_ptr, sin_ptr, out_ptr, stride_at, stride_ah,
                   stride_pt, stride_ph, stride_cs, stride_ot, stride_oh, R,
                   BLOCK_R: tl.constexpr, H2: tl.constexpr, BLOCK_H2: tl.constexpr,
                   DT: tl.constexpr):
    """Head ``h`` of token ``t``'s absorbed query: ``[q_abs | rope_interleaved(q_pe)]``."""
    out = out_ptr + t * stride_ot + h * stride_oh
    ty = out_ptr.dtype.element_ty
    r = tl.arange(0, BLOCK_R)
    rm = r < R
    qa = tl.load(qa_ptr + t * stride_at + h * stride_ah + r, mask=rm, other=0.0)
    tl.store(out + r, qa.to(ty), mask=rm)
    j = tl.arange(0, BLOCK_H2)
    jm = j < H2
    src = qp_ptr + t * stride_pt + h * stride_ph
    x1 = tl.load(src + 2 * j, mask=jm, other=0.0).to(tl.float32)
    x2 = tl.load(src + 2 * j + 1, mask=jm, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + t * stride_cs + j, mask=jm, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + t * stride_cs + j, mask=jm, other=0.0).to(tl.float32)
    tl.store(out + R + j, _rope_lo(x1, x2, cs, sn, DT).to(ty), mask=jm)
    tl.store(out + R + H2 + j, _rope_hi(x1, x2, cs, sn, DT).to(ty), mask=jm)


@triton.jit
def _q_latent_kernel(qa_ptr, qp_ptr, cos_ptr, sin_ptr, out_ptr, stride_at, stride_ah,
                     stride_pt, stride_ph, stride_cs, stride_ot, stride_oh, R,
                     BLOCK_R: tl.constexpr, H2: tl.constexpr, BLOCK_H2: tl.constexpr,
                     DT: tl.constexpr):
    _q_latent_head(tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), qa_ptr,
                   qp_ptr, cos_ptr, sin_ptr, out_ptr, stride_at, stride_ah, stride_pt,
                   stride_ph, stride_cs, stride_ot, stride_oh, R, BLOCK_R, H2, BLOCK_H2, DT)


def mla_q_latent_triton(q_abs, q_pe, cos, sin):
    T, H, R = q_abs.shape
    q_abs, q_pe, out = _q_latent_inputs(q_abs, q_pe)
    cos = cos.contiguous()
    sin = sin.contiguous()
    h2 = q_pe.shape[2] // 2
    _q_latent_kernel[(T, H)](q_abs, q_pe, cos, sin, out, q_abs.stride(0), q_abs.stride(1),
                             q_pe.stride(0), q_pe.stride(1), cos.stride(0), out.stride(0),
                             out.stride(1), R, BLOCK_R=next_pow2(R), H2=h2,
                             BLOCK_H2=next_pow2(h2), DT=_TL_DTYPE[q_pe.dtype], num_warps=4)
    return out


# ----------------------------------------------------------------------------- resident rows
@triton.jit
def _resident_rows_kernel(topk_ptr, table_ptr, slot_ptr, out_ptr, K, stride_t, stride_tab,
                          stride_o, P, BS: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    m = k < K
    pos = tl.load(topk_ptr + t * stride_t + k, mask=m, other=-1).to(tl.int64)
    slot = tl.maximum(tl.load(slot_ptr + t).to(tl.int64), 0)
    p = tl.maximum(pos, 0)
    page = p // BS
    blk = tl.load(table_ptr + slot * stride_tab + page, mask=m & (page < P), other=-1)
    row = blk.to(tl.int64) * BS + p % BS
    out = tl.where((pos >= 0) & (row >= 0), row, -1)
    tl.store(out_ptr + t * stride_o + k, out.to(tl.int32), mask=m)


def resident_rows_triton(topk, table, token_slot, block_size: int):
    T, K = topk.shape
    if topk.stride(1) != 1:
        topk = topk.contiguous()
    if table.stride(1) != 1:
        table = table.contiguous()
    out = torch.empty(T, K, device=topk.device, dtype=torch.int32)
    _resident_rows_kernel[(T,)](topk, table, token_slot, out, K, topk.stride(0),
                                table.stride(0), out.stride(0), table.shape[1], BS=block_size,
                                BLOCK_K=next_pow2(K), num_warps=4)
    return out
