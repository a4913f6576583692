"""Triton row-copy kernel (imported lazily by copy.py).

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
