"""Row copies between tiers: mirrors (GPU -> pinned host), restores (pinned host -> GPU),
host -> host, and a zero-copy row gather (host rows -> GPU) for the bandwidth benchmark.

``copy_rows(src, dst, src_rows, dst_rows)``: ``dst[:, dst_rows] = src[:, src_rows]`` for every
layer ``L`` in one launch. ``src``/``dst`` are ``[L, rows, D]`` views (any layer stride: each
layer is addressed through the view's own stride, so per-layer views into one packed allocation
keep their offsets). When either side is on CUDA a single Triton kernel moves the rows in flat
16-byte chunks, reading or writing the pinned host side directly through unified addressing (no
staging copy, no CPU work, no host sync). Both sides on CPU: one torch indexing op.

``copy_index_keys``: the same for indexer keys, which are rows (bf16) or page-split FP8 keys
(:class:`~hisparse.ops.quant.FP8KeyLayout`: a key's values and its scale sit in two planes of
its page, so a key is two pieces): one launch moves each key's values in 16-byte chunks and its
scale as a word.
"""

from __future__ import annotations

import torch

from ._common import want_triton
from .quant import FP8KeyLayout


def copy_rows_reference(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                        dst_rows: torch.Tensor) -> None:
    """``dst[:, dst_rows] = src[:, src_rows]`` with torch indexing (any devices)."""
    if src_rows.numel() == 0:
        return
    vals = src[:, src_rows.to(device=src.device, dtype=torch.long)]
    dst[:, dst_rows.to(device=dst.device, dtype=torch.long)] = vals.to(device=dst.device,
                                                                       dtype=dst.dtype)


def _zero_copy_ok(t: torch.Tensor) -> bool:
    return t.is_cuda or t.is_pinned()


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
              dst_rows: torch.Tensor) -> None:
    """``dst[:, dst_rows] = src[:, src_rows]`` for all layers in one launch.

    Args:
        src, dst: ``[L, rows, D]`` tensors of one dtype; either may be (pinned) host or CUDA.
        src_rows, dst_rows: ``[n]`` int64 row ids (moved to the kernel's device if needed).
    Triton path when either side is CUDA and the other is CUDA or pinned (or with
    HISPARSE_FORCE_TRITON=1); torch indexing otherwise (e.g. host -> host, unpinned host).
    """
    if src.dim() != 3 or dst.dim() != 3:
        raise ValueError("copy_rows expects [L, rows, D] tensors")
    if src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2] or src.dtype != dst.dtype:
        raise ValueError(f"copy_rows: incompatible src {tuple(src.shape)} {src.dtype} and "
                         f"dst {tuple(dst.shape)} {dst.dtype}")
    if src_rows.numel() != dst_rows.numel():
        raise ValueError("copy_rows: src_rows and dst_rows differ in length")
    if src_rows.numel() == 0:
        return
    if _use_triton(src, dst):
        from ._copy_triton import copy_rows_triton
        copy_rows_triton(src, dst, src_rows, dst_rows)
        return
    copy_rows_reference(src, dst, src_rows, dst_rows)


def _use_triton(src: torch.Tensor, dst: torch.Tensor) -> bool:
    gpu = src.is_cuda or dst.is_cuda
    return (want_triton(src, dst) and (not gpu or (_zero_copy_ok(src) and _zero_copy_ok(dst)))
            and (gpu or src.device == dst.device))


def copy_index_keys_reference(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                              dst_rows: torch.Tensor, head_dim: int) -> None:
    """:func:`copy_index_keys` with torch indexing (any devices)."""
    if src.dtype != torch.uint8:
        copy_rows_reference(src, dst, src_rows, dst_rows)
        return
    if src_rows.numel() == 0:
        return
    layout = FP8KeyLayout.of(src, head_dim)
    layout.scatter(dst, dst_rows, layout.gather(src, src_rows))


def copy_index_keys(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                    dst_rows: torch.Tensor, head_dim: int) -> None:
    """Key of flat row ``dst_rows[i]`` = key of ``src_rows[i]``, in every layer, one launch.

    Args:
        src, dst: ``[L, rows, D]`` unquantized keys (then this is :func:`copy_rows`), or FP8 key
            pages ``[L, blocks, block_size * index_key_bytes(head_dim)]`` uint8 of one block
            size; either may be (pinned) host or CUDA; each layer at its own stride.
        src_rows, dst_rows: ``[n]`` int64 flat row ids ``block * block_size + offset``.
    """
    if src.dtype != torch.uint8:
        copy_rows(src, dst, src_rows, dst_rows)
        return
    layout = FP8KeyLayout.of(src, head_dim)
    if (src.dim() != 3 or dst.shape[0] != src.shape[0] or dst.dim() != 3
            or FP8KeyLayout.of(dst, head_dim) != layout):
        raise ValueError(f"copy_index_keys: incompatible FP8 key pages {tuple(src.shape)} and "
                         f"{tuple(dst.shape)} (expected [L, blocks, page_bytes] of one layout)")
    if src_rows.numel() != dst_rows.numel():
        raise ValueError("copy_index_keys: src_rows and dst_rows differ in length")
    if src_rows.numel() == 0 or src.shape[0] == 0:
        return
    if _use_triton(src, dst):
        from ._copy_triton import copy_fp8_keys_triton
        copy_fp8_keys_triton(src, dst, src_rows, dst_rows, layout)
        return
    copy_index_keys_reference(src, dst, src_rows, dst_rows, head_dim)


def gather_rows(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[i] = src[rows[i]]``: ``src [N, ...]`` (pinned host on the CUDA path), ``dst [n, ...]``.

    Zero-copy gather in flat 16-byte chunks (656-B FP8 rows = 41 chunks, 1152-B bf16 rows = 72).
    """
    src3 = src.reshape(1, src.shape[0], -1)
    dst3 = dst.reshape(1, dst.shape[0], -1)
    ident = torch.arange(rows.numel(), device=rows.device, dtype=torch.long)
    copy_rows(src3, dst3, rows, ident)
