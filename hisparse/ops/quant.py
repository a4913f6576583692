"""The FP8 KV format (DeepSeek-V3.2 / FlashMLA ``V32_FP8Sparse``): quantize, dequantize, write.

**MLA row** (one token, one layer), ``d_nope`` latent + ``d_rope`` rope values, as bytes::

    [ d_nope x float8_e4m3fn | n_tiles x fp32 scale | d_rope x bf16 ]      (512 + 16 + 128 = 656 B)

The latent is cut into ``n_tiles`` tiles of ``tile = min(128, d_nope)`` values; tile ``i`` stores
``e4m3(x / s_i)`` with ``s_i = 2 ** ceil(log2(max(amax_i / 448, 1e-4)))`` (amax over the tile: the
scale rounded *up* to a power of two, so ``|x / s_i| <= 448`` and dividing is exact). Dequantized
value = ``e4m3 * s_i``; the rope part is stored in bf16 unquantized. This equals FlashMLA's
``tests/quant.py`` (``quantize_k_cache``), whose ``pow(2, ceil(log2(.)))`` this module computes
exactly with ``frexp`` (no log2 rounding at exact powers of two).

**Indexer key**: ``d x float8_e4m3fn`` plus one fp32 scale per tile (128 + 4 = 132 B), same scale
rule (DeepSeek-V3.2's indexer uses ue8m0, i.e. power-of-two, scales), of the *rotated* key: an
FP8 key stores ``indexer_rotation(k)`` (:mod:`hisparse.ops.rotation`, the Walsh-Hadamard
transform DeepSeek-V3.2 and SGLang apply before ``act_quant``; ``d`` a power of two), so its
dequantized values live in the rotated basis and the indexer rotates the queries scored against
them (:mod:`hisparse.ops.indexer`). One key in *row format*
(:func:`quantize_index_keys_reference`) is ``[ d x e4m3 | scales ]``; the caches keep keys
*page-split* (:class:`FP8KeyLayout`, as vLLM / DeepGEMM's indexer cache): a page of
``block_size`` keys stores its ``[block_size, d]`` e4m3 values first, then its
``[block_size, n_tiles]`` fp32 scales, so every key's values are 16-B aligned (still 132 B per
key).

MLA rows live in uint8 tensors ``[rows, row_bytes]``: every tier and copy moves them as opaque
bytes.
A dequantized e4m3 value times a power of two is exact in bf16 (and fp32), so attention over FP8
rows is defined as attention over :func:`dequantize_mla_rows_reference` of them.

Ops (PyTorch reference = spec; Triton kernel on CUDA or with HISPARSE_FORCE_TRITON=1):
:func:`quantize_write_mla_rows`, :func:`quantize_write_index_keys` (quantize new tokens and write
their byte rows at given flat row ids; CUDA-graph safe: one launch, fixed shapes, no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import TILE as TILE  # the format's tile, public here
from ._common import fp8_tile, want_triton
from ._common import mla_row_bytes as mla_row_bytes  # the format's helper, public here
from .rotation import check_rotation_dim, indexer_rotation

FP8_MAX = 448.0
SCALE_MIN = 1e-4          # FlashMLA clamps amax / 448 to this before rounding up
# What an FP8 indexer key's bytes mean; part of the P/D compatibility hash, so a prefill and a
# decode that store keys differently (e.g. before and after the rotation) refuse each other.
# Change it whenever the stored bits of a key change.
FP8_INDEX_KEY_FORMAT = "e4m3 page-split, pow2 scale per 128, hadamard-rotated"


def index_key_bytes(d: int) -> int:
    """Bytes of one FP8 indexer key: 132 for 128."""
    return d + 4 * (d // fp8_tile(d))


@dataclass(frozen=True)
class FP8KeyLayout:
    """Page-split FP8 indexer keys: the one description of where a key's bytes live.

    A page (block) of ``block_size`` keys of ``head_dim`` values is ``page_bytes = block_size *
    index_key_bytes(head_dim)`` bytes (132 per key for 128 values, as in row format)::

        [ block_size x head_dim e4m3 (value plane) | block_size x n_tiles fp32 (scale plane) ]

    Flat row ``r = block * block_size + o`` (the flat row id every table and plan uses) has its
    e4m3 values at byte ``block * page_bytes + o * head_dim`` and its ``n_tiles`` fp32 scales at
    byte ``block * page_bytes + block_size * head_dim + o * 4 * n_tiles`` of its layer's tensor
    (:meth:`value_offset`, :meth:`scale_offset`). One layer's keys are a uint8 tensor
    ``[num_blocks, page_bytes]``; several layers ``[L, num_blocks, page_bytes]`` (each layer
    at its own stride). ``block_size == 1`` is exactly the row format ``[rows, key_bytes]``.

    Alignment: with a 16-B aligned layer and ``page_bytes % 16 == 0`` (``block_size % 4 == 0``
    for 128-value keys) every key's values are 16-B aligned (128-B aligned from block_size 32),
    which is what lets the Triton kernels use plain 16-B vector loads.
    """

    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        fp8_tile(self.head_dim)
        check_rotation_dim(self.head_dim)       # keys are stored rotated
        if self.block_size < 1 or (self.block_size * self.head_dim) % 4:
            raise ValueError(f"FP8 key pages: block_size ({self.block_size}) x head_dim "
                             f"({self.head_dim}) must be a positive multiple of 4 (the scale "
                             "plane is fp32)")

    @property
    def n_tiles(self) -> int:
        return self.head_dim // fp8_tile(self.head_dim)

    @property
    def key_bytes(self) -> int:
        return index_key_bytes(self.head_dim)

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.key_bytes

    @property
    def scale_plane(self) -> int:
        """Byte offset of the scale plane inside a page."""
        return self.block_size * self.head_dim

    @classmethod
    def of(cls, cache: torch.Tensor, head_dim: int) -> FP8KeyLayout:
        """The layout of a page-split key tensor ``[..., num_blocks, page_bytes]`` uint8 (its
        block size is ``page_bytes // key_bytes``); checks dtype, shape and 4-B alignment."""
        kb = index_key_bytes(head_dim)
        if (cache.dtype != torch.uint8 or cache.dim() < 2 or cache.shape[-1] % kb
                or cache.shape[-1] == 0):
            raise ValueError(f"FP8 keys must be uint8 [..., blocks, block_size * {kb}] pages, "
                             f"got {tuple(cache.shape)} {cache.dtype}")
        if cache.stride(-1) != 1 or any(s % 4 for s in cache.stride()[:-1]) \
                or cache.storage_offset() % 4:
            raise ValueError("FP8 key pages must be contiguous and 4-byte aligned")
        return cls(head_dim, cache.shape[-1] // kb)

    def shape(self, num_blocks: int, *lead: int) -> tuple[int, ...]:
        """Shape of a tensor of ``num_blocks`` pages (``lead``: e.g. the number of layers)."""
        return (*lead, num_blocks, self.page_bytes)

    def value_offset(self, rows: torch.Tensor) -> torch.Tensor:
        """Byte offset (int64) of the values of flat rows ``rows`` in a contiguous layer."""
        rows = rows.long()
        return rows // self.block_size * self.page_bytes + rows % self.block_size * self.head_dim

    def scale_offset(self, rows: torch.Tensor) -> torch.Tensor:
        """Byte offset (int64) of the first fp32 scale of flat rows ``rows``."""
        rows = rows.long()
        return (rows // self.block_size * self.page_bytes + self.scale_plane
                + rows % self.block_size * 4 * self.n_tiles)

    def planes(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``values [..., blocks, block_size, head_dim]`` uint8 and ``scales [..., blocks,
        block_size, 4 * n_tiles]`` uint8 (the fp32 scales' bytes) of a page-split tensor."""
        if FP8KeyLayout.of(cache, self.head_dim) != self:
            raise ValueError(f"FP8 key pages: expected block_size {self.block_size}, got "
                             f"{tuple(cache.shape)}")
        values = cache[..., :self.scale_plane].unflatten(-1, (self.block_size, self.head_dim))
        scales = cache[..., self.scale_plane:].unflatten(-1, (self.block_size, 4 * self.n_tiles))
        return values, scales

    def gather(self, cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Row-format keys ``[..., n, key_bytes]`` of flat rows ``rows [n]``."""
        values, scales = self.planes(cache)
        rows = rows.to(device=cache.device, dtype=torch.long)
        b, o = rows // self.block_size, rows % self.block_size
        return torch.cat([values[..., b, o, :], scales[..., b, o, :]], dim=-1)

    def scatter(self, cache: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """``cache[rows] = keys``: row-format keys ``[..., n, key_bytes]`` into flat rows
        ``rows [n]``. A row listed twice gets one of its keys per plane (values and scale may
        come from different tokens: only sink rows, which nothing reads, are written twice)."""
        values, scales = self.planes(cache)
        rows = rows.to(device=cache.device, dtype=torch.long)
        b, o = rows // self.block_size, rows % self.block_size
        keys = keys.to(cache.device)
        values[..., b, o, :] = keys[..., :self.head_dim]
        scales[..., b, o, :] = keys[..., self.head_dim:]

    def pages(self, keys: torch.Tensor) -> torch.Tensor:
        """Row-format keys ``[num_blocks * block_size, key_bytes]`` -> pages ``[num_blocks,
        page_bytes]`` (flat row ``r`` = key ``r``)."""
        n = keys.shape[0] // self.block_size
        if keys.shape != (n * self.block_size, self.key_bytes):
            raise ValueError(f"pages: expected [blocks * {self.block_size}, {self.key_bytes}] "
                             f"keys, got {tuple(keys.shape)}")
        k = keys.view(n, self.block_size, self.key_bytes)
        return torch.cat([k[..., :self.head_dim].reshape(n, -1),
                          k[..., self.head_dim:].reshape(n, -1)], dim=1)


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
    """``k [T, d]`` (any float dtype; ``d`` a power of two) -> FP8 keys ``[T,
    index_key_bytes(d)]`` uint8 of ``indexer_rotation(k)`` (rotated in ``k.dtype``, then
    quantized)."""
    T, d = k.shape
    tile = fp8_tile(d)
    q, scale = _quantize_tiles(indexer_rotation(k), tile)
    return torch.cat([q, scale.contiguous().view(torch.uint8)], dim=1)


def quantize_index_queries_reference(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries ``q [T, Hi, d]`` (any float dtype) -> (e4m3 codes ``[T, Hi, d]`` uint8,
    fp32 scales ``[T, Hi, d // tile]``) of ``indexer_rotation(q)``: the keys' rule per (token,
    head, tile) -- one scale per head for ``d <= 128``, as DeepSeek-V3.2's ``act_quant`` of the
    rotated indexer query (ue8m0 scales) -- so FP8-key scoring is an FP8 x FP8 dot
    (:mod:`hisparse.ops.indexer`)."""
    T, H, d = q.shape
    codes, scale = _quantize_tiles(indexer_rotation(q.reshape(T * H, d)), fp8_tile(d))
    return codes.view(T, H, d), scale.view(T, H, -1)


def dequantize_index_queries_reference(codes: torch.Tensor, scales: torch.Tensor,
                                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_index_queries_reference` up to the rotation: ``e4m3 * scale``
    ``[T, Hi, d]`` (the rotated query's approximation, exact in bf16)."""
    T, H, d = codes.shape
    nt = scales.shape[-1]
    v = codes.contiguous().view(torch.float8_e4m3fn).float().view(T, H, nt, d // nt)
    return (v * scales.float()[..., None]).view(T, H, d).to(dtype)


def dequantize_index_keys_reference(keys: torch.Tensor, d: int,
                                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 keys ``[N, key_bytes]`` uint8 -> ``[N, d]`` ``dtype``: the stored, rotated keys'
    values (``indexer_rotation`` undoes the rotation: it is its own inverse)."""
    N = keys.shape[0]
    tile = fp8_tile(d)
    nt = d // tile
    q = keys[:, :d].contiguous().view(torch.float8_e4m3fn).float()
    scale = keys[:, d:d + 4 * nt].contiguous().view(torch.float32)
    return (q.reshape(N, nt, tile) * scale[..., None]).reshape(N, d).to(dtype)


def _check_rows(x: torch.Tensor, rows: torch.Tensor) -> None:
    if rows.shape != (x.shape[0],):
        raise ValueError(f"rows must be [T={x.shape[0]}], got {tuple(rows.shape)}")


def check_mla_rows_dst(dst: torch.Tensor, d_nope: int, d_rope: int) -> None:
    """``dst`` must be one layer's FP8 byte rows: uint8 ``[rows, row_bytes]``, 4-byte aligned."""
    row_bytes = mla_row_bytes(d_nope, d_rope)
    if dst.dtype != torch.uint8 or dst.dim() != 2 or dst.shape[1] != row_bytes:
        raise ValueError(f"FP8 destination must be uint8 [rows, {row_bytes}], got "
                         f"{tuple(dst.shape)} {dst.dtype}")
    if dst.stride(1) != 1 or dst.stride(0) % 4 or dst.storage_offset() % 4:
        raise ValueError("FP8 destination rows must be contiguous and 4-byte aligned")


def quantize_write_mla_rows(kv: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor,
                            d_nope: int) -> None:
    """``dst[rows[t]] = quantize(kv[t])``: ``kv [T, d_nope + d_rope]`` float, ``dst [N, row_bytes]``
    uint8 (one layer's byte rows), ``rows [T]`` flat row ids (several tokens may share a sink row:
    any one of them wins)."""
    T, D = kv.shape
    check_mla_rows_dst(dst, d_nope, D - d_nope)
    _check_rows(kv, rows)
    if T == 0:
        return
    if want_triton(kv, dst):
        from ._quant_triton import quantize_write_mla_triton
        quantize_write_mla_triton(kv, dst, rows, d_nope)
        return
    dst.index_copy_(0, rows.to(device=dst.device, dtype=torch.long),
                    quantize_mla_rows_reference(kv, d_nope).to(dst.device))


def quantize_write_index_keys(k: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
    """Key of flat row ``rows[t]`` = ``quantize(indexer_rotation(k[t]))``
    (:func:`quantize_index_keys_reference`): ``k [T, d]`` float, ``dst`` one layer's
    page-split keys ``[num_blocks, block_size * index_key_bytes(d)]`` uint8
    (:class:`FP8KeyLayout`; ``[rows, 132]`` is block size 1), ``rows [T]`` flat row ids."""
    T, d = k.shape
    layout = FP8KeyLayout.of(dst, d)
    if dst.dim() != 2:
        raise ValueError(f"FP8 keys: one layer [blocks, page_bytes] expected, got "
                         f"{tuple(dst.shape)}")
    _check_rows(k, rows)
    if T == 0:
        return
    if want_triton(k, dst):
        from ._quant_triton import quantize_write_keys_triton
        quantize_write_keys_triton(k, dst, rows, layout.block_size)
        return
    layout.scatter(dst, rows, quantize_index_keys_reference(k))
