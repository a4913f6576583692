"""Triton kernel of :func:`hisparse.ops.stage.stage_rows_device` (imported lazily): member ``m`` of
a staging plan is copied into ``staging[m]`` from its resident arena row, else its host row
(zero-copy from the pinned pool), for ``m < min(count, capacity)``; ``count`` is read on the
device, so the launch has a fixed grid (``capacity`` rows) and needs no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._copy_triton import _words


@triton.jit
def _stage_copy_kernel(arena_ptr, host_ptr, staging_ptr, res_rows_ptr, host_rows_ptr, count_ptr,
                       cap, a_sr, h_sr, s_sr,
                       CHUNKS: tl.constexpr, VEC: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.minimum(tl.load(count_ptr), cap)
    c = pid.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < n * CHUNKS
    i = c // CHUNKS
    w = c % CHUNKS
    rr = tl.load(res_rows_ptr + i, mask=cm, other=-1)
    hr = tl.load(host_rows_ptr + i, mask=cm, other=-1)
    from_res = cm & (rr >= 0)
    from_host = cm & (rr < 0) & (hr >= 0)
    offs_v = tl.arange(0, VEC)
    so_r = tl.multiple_of(tl.maximum(rr, 0) * a_sr + w * VEC, VEC)
    so_h = tl.multiple_of(tl.maximum(hr, 0) * h_sr + w * VEC, VEC)
    v_r = tl.load(arena_ptr + so_r[:, None] + offs_v[None, :], mask=from_res[:, None], other=0)
    v_h = tl.load(host_ptr + so_h[:, None] + offs_v[None, :], mask=from_host[:, None], other=0)
    v = tl.where(from_res[:, None], v_r, v_h)
    do = tl.multiple_of(i * s_sr + w * VEC, VEC)
    tl.store(staging_ptr + do[:, None] + offs_v[None, :], v,
             mask=(from_res | from_host)[:, None])


def stage_copy_triton(arena: torch.Tensor, host: torch.Tensor, staging: torch.Tensor,
                      res_rows: torch.Tensor, host_rows: torch.Tensor, count: torch.Tensor,
                      block_c: int = 1024, num_warps: int = 4) -> None:
    """``arena [N, D]``, ``host [Nh, D]`` (pinned on CUDA), ``staging [S, D]``; ``res_rows`` /
    ``host_rows`` ``[cap]`` int64 on the kernel's device (-1 none), ``count [1]`` int64."""
    if arena.stride(-1) != 1 or host.stride(-1) != 1 or staging.stride(-1) != 1:
        raise ValueError("stage_rows: rows must be contiguous")
    cap = res_rows.numel()
    if cap == 0:
        return
    views = [_words(t) for t in (arena, host, staging)]
    if len({v.dtype for v in views}) != 1:
        views = [t.view(torch.uint8) for t in (arena, host, staging)]
    aw, hw, sw = views
    words = sw.shape[-1]
    aligned = (words % 4 == 0 and all(v.stride(0) % 4 == 0 for v in views)
               and all(v.data_ptr() % (4 * v.element_size()) == 0 for v in views))
    vec = 4 if aligned else 1
    chunks = words // vec
    grid = (triton.cdiv(cap * chunks, block_c),)
    _stage_copy_kernel[grid](aw, hw, sw, res_rows, host_rows, count, cap,
                             aw.stride(0), hw.stride(0), sw.stride(0),
                             CHUNKS=chunks, VEC=vec, BLOCK_C=block_c, num_warps=num_warps)
