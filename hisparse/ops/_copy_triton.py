"""Triton row-copy kernels (imported lazily by copy.py): rows, and page-split FP8 indexer keys.

The (layer, row, chunk) space is flattened: program ``(pid, layer)`` moves BLOCK_C consecutive
chunks of VEC 32-bit words (VEC = 4: one 16-byte access per lane), so short rows (656 B = 41 chunks)
waste no lanes. Pinned host pointers are valid on the device (UVA); Triton's launcher accepts
them and the loads/stores go over PCIe directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, n,
                      src_sl, src_sr, dst_sl, dst_sr,
                      CHUNKS: tl.constexpr, VEC: tl.constexpr, BLOCK_C: tl.constexpr,
                      DST_IDENT: tl.constexpr):
    pid = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    c = pid.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < n * CHUNKS
    i = c // CHUNKS
    w = c % CHUNKS
    sr = tl.load(src_rows_ptr + i, mask=cm, other=0)
    if DST_IDENT:
        dr = i
    else:
        dr = tl.load(dst_rows_ptr + i, mask=cm, other=0)
    so = layer * src_sl + sr.to(tl.int64) * src_sr + w * VEC
    do = layer * dst_sl + dr.to(tl.int64) * dst_sr + w * VEC
    so = tl.multiple_of(so, VEC)
    do = tl.multiple_of(do, VEC)
    offs_v = tl.arange(0, VEC)
    v = tl.load(src_ptr + so[:, None] + offs_v[None, :], mask=cm[:, None])
    tl.store(dst_ptr + do[:, None] + offs_v[None, :], v, mask=cm[:, None])


def _words(t: torch.Tensor):
    row_bytes = t.shape[-1] * t.element_size()
    strides_b = [s * t.element_size() for s in t.stride()[:-1]]
    if row_bytes % 4 == 0 and all(s % 4 == 0 for s in strides_b) and t.data_ptr() % 4 == 0:
        return t.view(torch.int32)
    return t.view(torch.uint8)


def copy_rows_triton(src, dst, src_rows, dst_rows, block_c: int = 1024, num_warps: int = 4):
    if src.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError("copy_rows: rows must be contiguous")
    kdev = dst.device if dst.is_cuda else src.device
    sw = _words(src)
    dw = _words(dst)
    if sw.dtype != dw.dtype:
        sw, dw = src.view(torch.uint8), dst.view(torch.uint8)
    words = sw.shape[-1]
    aligned = (all(x % 4 == 0 for x in (words, sw.stride(0), sw.stride(1), dw.stride(0),
                                        dw.stride(1)))
               and sw.data_ptr() % (4 * sw.element_size()) == 0
               and dw.data_ptr() % (4 * dw.element_size()) == 0)
    vec = 4 if aligned else 1
    chunks = words // vec
    n = src_rows.numel()
    src_rows = src_rows.to(device=kdev, dtype=torch.int64)
    ident = dst_rows is None
    dst_rows = src_rows if ident else dst_rows.to(device=kdev, dtype=torch.int64)
    L = sw.shape[0]
    grid = (triton.cdiv(n * chunks, block_c), L)
    _copy_rows_kernel[grid](sw, dw, src_rows, dst_rows, n,
                            sw.stride(0), sw.stride(1), dw.stride(0), dw.stride(1),
                            CHUNKS=chunks, VEC=vec, BLOCK_C=block_c, DST_IDENT=ident,
                            num_warps=num_warps)


@triton.jit
def _copy_keys_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, n,
                      src_sl, src_sp, dst_sl, dst_sp,
                      PAGE: tl.constexpr, VW: tl.constexpr, VWP: tl.constexpr, NT: tl.constexpr,
                      BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    """Page-split FP8 keys as int32 words (quant.FP8KeyLayout): program ``(pid, layer)`` moves
    BLOCK_K keys: the ``VW`` value words of slot ``o`` at word ``o * VW`` of its page (rows of
    16-B chunks when ``ALIGNED``) and its ``NT`` scale words at ``PAGE * VW + o * NT``. Strides
    in words: ``*_sl`` per layer, ``*_sp`` per page."""
    layer = tl.program_id(1).to(tl.int64)
    k = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    km = k < n
    sr = tl.load(src_rows_ptr + k, mask=km, other=0).to(tl.int64)
    dr = tl.load(dst_rows_ptr + k, mask=km, other=0).to(tl.int64)
    s_page = layer * src_sl + (sr // PAGE) * src_sp
    d_page = layer * dst_sl + (dr // PAGE) * dst_sp
    sv = s_page + (sr % PAGE) * VW
    dv = d_page + (dr % PAGE) * VW
    if ALIGNED:
        sv = tl.multiple_of(sv, 4)
        dv = tl.multiple_of(dv, 4)
    offs_v = tl.arange(0, VWP)
    vm = km[:, None]
    if VWP != VW:
        vm = vm & (offs_v < VW)[None, :]
    v = tl.load(src_ptr + sv[:, None] + offs_v[None, :], mask=vm)
    tl.store(dst_ptr + dv[:, None] + offs_v[None, :], v, mask=vm)
    offs_t = tl.arange(0, NT)
    ss = s_page + PAGE * VW + (sr % PAGE) * NT
    ds = d_page + PAGE * VW + (dr % PAGE) * NT
    sc = tl.load(src_ptr + ss[:, None] + offs_t[None, :], mask=km[:, None])
    tl.store(dst_ptr + ds[:, None] + offs_t[None, :], sc, mask=km[:, None])


def copy_fp8_keys_triton(src, dst, src_rows, dst_rows, layout, block_k: int = 128,
                         num_warps: int = 4) -> None:
    """``src``/``dst``: ``[L, blocks, page_bytes]`` uint8 key pages of ``layout`` (checked by
    the caller: 4-B aligned, unit last stride)."""
    if layout.head_dim % 4 or src.data_ptr() % 4 or dst.data_ptr() % 4:
        raise ValueError("copy_index_keys: FP8 keys need a head dim and addresses that are "
                         "multiples of 4 bytes")
    kdev = dst.device if dst.is_cuda else src.device
    sw, dw = src.view(torch.int32), dst.view(torch.int32)
    vw = layout.head_dim // 4
    strides = (sw.stride(0), sw.stride(1), dw.stride(0), dw.stride(1))
    aligned = (vw % 4 == 0 and all(x % 4 == 0 for x in strides)
               and src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0)
    n = src_rows.numel()
    src_rows = src_rows.to(device=kdev, dtype=torch.int64)
    dst_rows = dst_rows.to(device=kdev, dtype=torch.int64)
    grid = (triton.cdiv(n, block_k), sw.shape[0])
    _copy_keys_kernel[grid](sw, dw, src_rows, dst_rows, n, *strides,
                            PAGE=layout.block_size, VW=vw, VWP=triton.next_power_of_2(vw),
                            NT=layout.n_tiles, BLOCK_K=block_k,
                            ALIGNED=aligned, num_warps=num_warps)
