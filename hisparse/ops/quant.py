"""The FP8 KV format (DeepSeek-V3.2 / FlashMLA ``V32_FP8Sparse``): quantize, dequantize, write.

**MLA row** (one token, one layer), ``d_nope`` latent + ``d_rope`` rope values, as bytes::

    [ d_nope x float8_e4m3fn | n_tiles x fp32 scale | d_rope x bf16 ]      (512 + 16 + 128 = 656 B)

The latent is cut into ``n_tiles`` tiles of ``tile = min(128, d_nope)`` values; tile ``i`` stores
``e4m3(x / s_i)`` with ``s_i = 2 ** ceil(log2(max(amax_i / 448, 1e-4)))`` (amax over the tile: the
scale rounded *up* to a power of two, so ``|x / s_i| <= 448`` and dividing is exact). Dequantized
value = ``e4m3 * s_i``; the rope part is stored in bf16 unquantized. This equals FlashMLA's
``tests/quant.py`` (``quantize_k_cache``), whose ``pow(2, ceil(log2(.)))`` this module computes
exactly with ``frexp`` (no log2 rounding at exact powers of two).

**Indexer key**: ``[ d x float8_e4m3fn | one fp32 scale per tile ]`` (128 + 4 = 132 B), same scale
rule (DeepSeek-V3.2's indexer uses ue8m0, i.e. power-of-two, scales).

Rows live in uint8 tensors ``[rows, row_bytes]``: every tier and copy moves them as opaque bytes.
A dequantized e4m3 value times a power of two is exact in bf16 (and fp32), so attention over FP8
rows is defined as attention over :func:`dequantize_mla_rows_reference` of them.

Ops (PyTorch reference = spec; Triton kernel on CUDA or with HISPARSE_FORCE_TRITON=1):
:func:`quantize_write_mla_rows`, :func:`quantize_write_index_keys` (quantize new tokens and write
their byte rows at given flat row ids; CUDA-graph safe: one launch, fixed shapes, no host sync).
"""

from __future__ import annotations

import torch

from ._common import want_triton

FP8_MAX = 448.0
SCALE_MIN = 1e-4          # FlashMLA clamps amax / 448 to this before rounding up
TILE = 128


def fp8_tile(d: int) -> int:
    """Values per scale tile for ``d`` quantized values (128, or ``d`` itself below 128)."""
    tile = min(TILE, d)
    if d % tile or (d // tile) & (d // tile - 1):
        raise ValueError(f"FP8 format: {d} values must be a power-of-two number of "
                         f"{TILE}-value tiles (or a single tile below {TILE})")
    return tile


def mla_row_bytes(d_nope: int, d_rope: int) -> int:
    """Bytes of one FP8 MLA row: 656 for 512 + 64."""
    return d_nope + 4 * (d_nope // fp8_tile(d_nope)) + 2 * d_rope


def index_key_bytes(d: int) -> int:
    """Bytes of one FP8 indexer key: 132 for 128."""
    return d + 4 * (d // fp8_tile(d))


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(max(amax / 448, 1e-4)))`` in fp32, exactly (frexp, not log2)."""
    x = torch.clamp_min(amax.float() / FP8_MAX, SCALE_MIN)
    m, e = torch.frexp(x)                     # x = m * 2**e, m in [0.5, 1)
    e = torch.where(m == 0.5, e - 1, e)       # exact powers of two stay
    return torch.ldexp(torch.ones_like(x), e)


def _quantize_tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, d]`` -> (e4m3 bytes ``[T, d]`` uint8, scales ``[T, d // tile]`` fp32)."""
    T, d = x.shape
    xt = x.float().reshape(T, d // tile, tile)
    scale = pow2_scale(xt.abs().amax(dim=-1))
    q = (xt / scale[..., None]).to(torch.float8_e4m3fn)
    return q.reshape(T, d).view(torch.uint8), scale


def quantize_mla_rows_reference(kv: torch.Tensor, d_nope: int) -> torch.Tensor:
    """``kv [T, d_nope + d_rope]`` (any float dtype) -> FP8 rows ``[T, row_bytes]`` uint8."""
    T, D = kv.shape
    d_rope = D - d_nope
    tile = fp8_tile(d_nope)
    out = torch.empty((T, mla_row_bytes(d_nope, d_rope)), dtype=torch.uint8, device=kv.device)
    q, scale = _quantize_tiles(kv[:, :d_nope], tile)
    nt = d_nope // tile
    out[:, :d_nope] = q
    out[:, d_nope:d_nope + 4 * nt] = scale.contiguous().view(torch.uint8)
    out[:, d_nope + 4 * nt:] = kv[:, d_nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def dequantize_mla_rows_reference(rows: torch.Tensor, d_nope: int, d_rope: int,
                                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 rows ``[N, row_bytes]`` uint8 -> ``[N, d_nope + d_rope]`` ``dtype`` (exact in bf16)."""
    N = rows.shape[0]
    tile = fp8_tile(d_nope)
    nt = d_nope // tile
    nope = rows[:, :d_nope].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[:, d_nope:d_nope + 4 * nt].contiguous().view(torch.float32)
    rope = rows[:, d_nope + 4 * nt:d_nope + 4 * nt + 2 * d_rope].contiguous().view(torch.bfloat16)
    nope = (nope.reshape(N, nt, tile) * scale[..., None]).reshape(N, d_nope)
    return torch.cat([nope, rope.float()], dim=1).to(dtype)


def quantize_index_keys_reference(k: torch.Tensor) -> torch.Tensor:
    """``k [T, d]`` -> FP8 keys ``[T, index_key_bytes(d)]`` uint8."""
    T, d = k.shape
    tile = fp8_tile(d)
    q, scale = _quantize_tiles(k, tile)
    return torch.cat([q, scale.contiguous().view(torch.uint8)], dim=1)


def dequantize_index_keys_reference(keys: torch.Tensor, d: int,
                                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 keys ``[N, key_bytes]`` uint8 -> ``[N, d]`` ``dtype``."""
    N = keys.shape[0]
    tile = fp8_tile(d)
    nt = d // tile
    q = keys[:, :d].contiguous().view(torch.float8_e4m3fn).float()
    scale = keys[:, d:d + 4 * nt].contiguous().view(torch.float32)
    return (q.reshape(N, nt, tile) * scale[..., None]).reshape(N, d).to(dtype)


def _check_write(x: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, row_bytes: int) -> None:
    if dst.dtype != torch.uint8 or dst.dim() != 2 or dst.shape[1] != row_bytes:
        raise ValueError(f"FP8 destination must be uint8 [rows, {row_bytes}], got "
                         f"{tuple(dst.shape)} {dst.dtype}")
    if dst.stride(1) != 1 or dst.stride(0) % 4:
        raise ValueError("FP8 destination rows must be contiguous and 4-byte aligned")
    if rows.shape != (x.shape[0],):
        raise ValueError(f"rows must be [T={x.shape[0]}], got {tuple(rows.shape)}")


def quantize_write_mla_rows(kv: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor,
                            d_nope: int) -> None:
    """``dst[rows[t]] = quantize(kv[t])``: ``kv [T, d_nope + d_rope]`` float, ``dst [N, row_bytes]``
    uint8 (one layer's byte rows), ``rows [T]`` flat row ids (several tokens may share a sink row:
    any one of them wins)."""
    T, D = kv.shape
    _check_write(kv, dst, rows, mla_row_bytes(d_nope, D - d_nope))
    if T == 0:
        return
    if want_triton(kv, dst):
        from ._quant_triton import quantize_write_mla_triton
        quantize_write_mla_triton(kv, dst, rows, d_nope)
        return
    dst.index_copy_(0, rows.to(device=dst.device, dtype=torch.long),
                    quantize_mla_rows_reference(kv, d_nope).to(dst.device))


def quantize_write_index_keys(k: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[rows[t]] = quantize(k[t])``: ``k [T, d]``, ``dst [N, index_key_bytes(d)]`` uint8."""
    T, d = k.shape
    _check_write(k, dst, rows, index_key_bytes(d))
    if T == 0:
        return
    if want_triton(k, dst):
        from ._quant_triton import quantize_write_keys_triton
        quantize_write_keys_triton(k, dst, rows)
        return
    dst.index_copy_(0, rows.to(device=dst.device, dtype=torch.long),
                    quantize_index_keys_reference(k).to(dst.device))
