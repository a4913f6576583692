"""Triton quantize-and-write of FP8 rows and keys (imported lazily by quant.py).

One program per token: it loads the token's values, computes each tile's power-of-two scale and
writes ``[e4m3 | fp32 scales | bf16 rope]`` bytes into its flat row (MLA rows), or the e4m3
values and the scales into the value and scale planes of its page (page-split indexer keys,
:class:`~hisparse.ops.quant.FP8KeyLayout`). The e4m3 and bf16 encodings
are done with integer bit operations (round to nearest even), so the kernel is bit-exact against
the PyTorch reference on the GPU and under the CPU interpreter (whose fp8 casts are not).
Indexer keys are rotated first (:mod:`hisparse.ops.rotation`; ``_hadamard`` is its butterfly,
shared with the fused key write and the indexer's query kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import fp8_tile

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _rnd(x, DT: tl.constexpr):
    """Round fp32 ``x`` to the model dtype ``DT`` and back (what storing a torch op's result
    does); bf16 by integer round-to-nearest-even (the interpreter's cast truncates)."""
    if DT == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        y = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    else:
        y = x.to(DT).to(tl.float32)
    return y


@triton.jit
def _hadamard(x, M: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr, SCALE: tl.constexpr,
              DT: tl.constexpr):
    """:func:`hisparse.ops.rotation.indexer_rotation` of the rows of ``x [M, D]`` fp32
    (``D = 2 ** LOG_D``, ``SCALE = D ** -0.5``): the same butterfly, stages ``h = 1, 2, ..``,
    then the scale, then the rounding to ``DT`` (bit for bit the reference)."""
    for s in tl.static_range(LOG_D):
        x4 = tl.permute(tl.reshape(x, (M, D // (2 << s), 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(x4)                                   # [M, D / 2h, h] each
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (M, D))
    return _rnd(x * SCALE, DT)


@triton.jit
def _e4m3_code(y):
    """fp32 ``y`` with ``|y| <= 448`` -> float8_e4m3fn bit pattern (int32 0..255), RNE."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a_bits = bits & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    # normal range (a >= 2^-6): round the fp32 mantissa to 3 bits, then rebias 127 -> 7
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - 960
    # subnormal range: code = RNE(a * 2^9) (8 rolls over into the smallest normal, as it should)
    t = a * 512.0
    fl = t.to(tl.int32)
    frac = t - fl.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))
    sub = fl + up.to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    return code | sign


@triton.jit
def _pow2_scale(amax):
    """``(scale, 1 / scale)`` of tiles with absolute maxima ``amax`` (fp32, any shape):
    :func:`~hisparse.ops.quant.pow2_scale` bit for bit, and its exact inverse."""
    s = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1e-4)
    sb = s.to(tl.int32, bitcast=True)
    e = sb & 0x7F800000
    sb = tl.where((sb & 0x7FFFFF) != 0, e + 0x800000, e)               # round up to 2^k
    return sb.to(tl.float32, bitcast=True), ((254 << 23) - sb).to(tl.float32, bitcast=True)


@triton.jit
def _store_fp8_tiles(x, dst_u8, dst_f32, base, slot, offs, offs_i, D_NOPE: tl.constexpr,
                     NT: tl.constexpr, SCALE_OFF: tl.constexpr):
    """Quantize ``x [NT, TILE]`` fp32 per tile (power-of-two scales, as
    :func:`~hisparse.ops.quant.pow2_scale`) and store its e4m3 codes at byte ``base + slot *
    D_NOPE + offs`` and its scales at ``base + SCALE_OFF + slot * 4 * NT``; returns the byte
    offset of the scales (the MLA row's rope follows them)."""
    scale, inv = _pow2_scale(tl.max(tl.abs(x), axis=1))                # [NT]
    code = _e4m3_code(x * inv[:, None])
    tl.store(dst_u8 + base + slot * D_NOPE + offs, code.to(tl.uint8))
    scale_at = base + SCALE_OFF + slot * (4 * NT)
    tl.store(dst_f32 + scale_at // 4 + offs_i, scale)
    return scale_at


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit pattern (int16), round to nearest even (integer ops: exact under the
    interpreter too)."""
    rb = x.to(tl.int32, bitcast=True)
    return ((rb + 0x7FFF + ((rb >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _quant_write_kernel(x_ptr, rows_ptr, dst_u8, dst_f32, dst_i16, stride_xt, stride_page,
                        D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, TILE: tl.constexpr,
                        NT: tl.constexpr, PAGE: tl.constexpr, SCALE_OFF: tl.constexpr,
                        ROTATE: tl.constexpr, LOG_D: tl.constexpr, ROT_SCALE: tl.constexpr,
                        DT: tl.constexpr):
    """Flat row ``r`` lives in page ``r // PAGE`` (``stride_page`` bytes apart), slot
    ``o = r % PAGE``: values at byte ``o * D_NOPE`` of the page, scales at ``SCALE_OFF + o * 4 *
    NT``, rope (``D_ROPE > 0``, MLA rows: ``PAGE == 1``) right after the scales. ``ROTATE``
    (indexer keys): the ``D_NOPE`` values are rotated (in ``DT``, the input's dtype) before
    quantization."""
    t = tl.program_id(0)
    row = tl.load(rows_ptr + t).to(tl.int64)
    page = row // PAGE
    slot = row % PAGE
    x_base = x_ptr + t.to(tl.int64) * stride_xt
    offs_i = tl.arange(0, NT)
    offs_j = tl.arange(0, TILE)
    offs = offs_i[:, None] * TILE + offs_j[None, :]
    x = tl.load(x_base + offs).to(tl.float32)                         # [NT, TILE]
    if ROTATE:
        x = tl.reshape(_hadamard(tl.reshape(x, (1, NT * TILE)), 1, NT * TILE, LOG_D, ROT_SCALE,
                                 DT), (NT, TILE))
    scale_at = _store_fp8_tiles(x, dst_u8, dst_f32, page * stride_page, slot, offs, offs_i,
                                D_NOPE, NT, SCALE_OFF)
    if D_ROPE > 0:
        offs_r = tl.arange(0, D_ROPE)
        r = tl.load(x_base + D_NOPE + offs_r).to(tl.float32)
        tl.store(dst_i16 + (scale_at + 4 * NT) // 2 + offs_r, _bf16_bits(r))


def _launch(x: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, d_nope: int,
            page: int = 1, rotate: bool = False) -> None:
    T, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    tile = fp8_tile(d_nope)
    d_rope = D - d_nope
    if d_rope & (d_rope - 1):
        raise ValueError(f"FP8 rows: the rope part ({d_rope}) must be a power of two")
    rows = rows.to(device=dst.device, dtype=torch.int64)
    _quant_write_kernel[(T,)](
        x, rows, dst, dst.view(torch.float32), dst.view(torch.int16), x.stride(0), dst.stride(0),
        D_NOPE=d_nope, D_ROPE=d_rope, TILE=tile, NT=d_nope // tile, PAGE=page,
        SCALE_OFF=page * d_nope, ROTATE=rotate, LOG_D=d_nope.bit_length() - 1,
        ROT_SCALE=d_nope ** -0.5, DT=_TL_DTYPE[x.dtype], num_warps=4)


def quantize_write_mla_triton(kv, dst, rows, d_nope: int) -> None:
    """MLA byte rows ``dst [rows, row_bytes]`` (a page of one row)."""
    _launch(kv, dst, rows, d_nope)


def quantize_write_keys_triton(k, dst, rows, block_size: int) -> None:
    """Page-split keys ``dst [blocks, block_size * key_bytes]`` (quant.FP8KeyLayout) of the
    rotated keys (``k``'s head size a power of two: checked by the layout)."""
    _launch(k, dst, rows, k.shape[1], page=block_size, rotate=True)
