"""Prefill staging (issue 14): a prefill chunk's selected history rows -> a bounded GPU staging
area, so a chunk can attend to history whose pages are host-only.

Spec (:func:`stage_rows_reference`), per layer, for the *staged tokens* of a step (tokens of
prefill chunks whose history has host-only pages; ``token_slot[t]`` is the request's slot, -1 a
padding token):

1. An entry ``topk[t, k] = pos`` is *valid* iff ``pos >= 0``, ``token_slot[t] >= 0`` and
   ``pos // block_size < P`` (``P`` = pages of the tables). Invalid entries output ``-1``.
2. The *union* ``U`` = the distinct ``(slot, pos)`` of the valid entries, sorted by
   ``(slot, pos)`` (deterministic, independent of token order). ``|U|`` must be
   ``<= staging.shape[0]``, else ``ValueError`` (nothing is written): the caller splits the
   tokens into groups whose union fits (:func:`staging_union_size`).
3. Member ``i`` of ``U`` is copied into ``staging[i]``: from its *resident* arena row
   ``resident_table[slot, page] * block_size + pos % block_size`` when that block is ``>= 0``
   (a device copy), else from its *host* row ``host_table[slot, page] * block_size + pos %
   block_size`` (zero-copy from the pinned host pool on CUDA). A member with neither raises
   ``ValueError`` (the scheduler guarantees every computed row is readable, DESIGN I1).
4. Output ``rows [T, K]`` int32: the staging row of each valid entry (``i`` of its member),
   ``-1`` otherwise. Attention of the staged tokens then reads ``staging`` with these rows; the
   order of each token's entries is kept, so the result is bit-identical to attention over the
   same rows read in place.
5. ``counter`` (int64 ``[1]``, optional) ``+= #members copied from host`` (no host sync).

Design: the staging area is one ``[S, D]`` buffer shared by every layer (layers run one after
another on one stream), allocated once with the caches (``KVCaches.staging``); it holds the whole
union (resident members too), so attention reads one tensor and the decode path (resolver, hot
buffers, CUDA graphs) is untouched. Host traffic is only the host-only members. Resident
members cost a device copy no larger than what attention reads anyway. Prefill steps run
eagerly: computing the union (``torch.unique``) synchronizes with the host, which is allowed
there (never on the captured decode path). The copies go through :func:`copy_rows` (its Triton
kernel moves rows in flat 16-byte chunks, reading pinned host memory directly).
"""

from __future__ import annotations

import torch

from .copy import copy_rows


def _union(topk: torch.Tensor, token_slot: torch.Tensor, num_pages: int, block_size: int):
    T, K = topk.shape
    span = num_pages * block_size
    slot = token_slot.long()[:, None].expand(T, K)
    pos = topk.long()
    valid = (pos >= 0) & (slot >= 0) & (pos < span)
    keys = slot.clamp(min=0) * span + pos.clamp(min=0)
    uniq, inv = torch.unique(keys[valid], sorted=True, return_inverse=True)
    return valid, uniq, inv, span


def staging_union_size(topk: torch.Tensor, token_slot: torch.Tensor, num_pages: int,
                       block_size: int) -> int:
    """``|U|`` of step 2 for these tokens (one host sync)."""
    return int(_union(topk, token_slot, num_pages, block_size)[1].numel())


def stage_rows_reference(topk: torch.Tensor, token_slot: torch.Tensor,
                         resident_table: torch.Tensor, host_table: torch.Tensor,
                         arena: torch.Tensor, host: torch.Tensor, staging: torch.Tensor,
                         block_size: int, counter: torch.Tensor | None = None) -> torch.Tensor:
    """The spec above. ``arena [N, D]`` / ``host [Nh, D]`` are one layer's views, ``staging
    [S, D]`` of the same dtype. Returns ``rows [T, K]`` int32 into ``staging``."""
    T, K = topk.shape
    num_pages = resident_table.shape[1]
    valid, uniq, inv, span = _union(topk, token_slot, num_pages, block_size)
    n = uniq.numel()
    if n > staging.shape[0]:
        raise ValueError(f"stage_rows: the union of selected rows ({n}) exceeds the staging "
                         f"area ({staging.shape[0]} rows): split the tokens")
    rows = torch.full((T, K), -1, dtype=torch.int32, device=topk.device)
    if n == 0:
        return rows
    u_slot, u_pos = uniq // span, uniq % span
    page, off = u_pos // block_size, u_pos % block_size
    res_blk = resident_table[u_slot, page].long()
    host_blk = host_table[u_slot, page].long() if host_table.numel() else torch.full_like(
        res_blk, -1)
    on_gpu = res_blk >= 0
    from_host = ~on_gpu
    if bool((from_host & (host_blk < 0)).any()):
        raise ValueError("stage_rows: a selected row is neither resident nor on host")
    dst = torch.arange(n, device=topk.device, dtype=torch.long)
    stage3 = staging.view(1, *staging.shape)
    if bool(on_gpu.any()):
        copy_rows(arena.view(1, *arena.shape), stage3, (res_blk * block_size + off)[on_gpu],
                  dst[on_gpu])
    if bool(from_host.any()):
        copy_rows(host.view(1, *host.shape), stage3, (host_blk * block_size + off)[from_host],
                  dst[from_host])
        if counter is not None:
            counter += from_host.sum()
    rows[valid] = inv.to(torch.int32)
    return rows


def stage_rows(topk, token_slot, resident_table, host_table, arena, host, staging, block_size,
               counter=None) -> torch.Tensor:
    """Dispatcher: the reference's union and indexing with :func:`copy_rows`'s kernels for the
    row movement (Triton on CUDA, torch indexing on CPU)."""
    return stage_rows_reference(topk, token_slot, resident_table, host_table, arena, host,
                                staging, block_size, counter)


def stage_groups(topk: torch.Tensor, token_slot: torch.Tensor, num_pages: int, block_size: int,
                 capacity: int) -> list[tuple[int, int]]:
    """Split tokens ``[0, T)`` into consecutive ranges whose union fits ``capacity`` rows
    (halving a range until it fits; one token's entries always fit when ``capacity >= K``)."""
    out, stack = [], [(0, topk.shape[0])]
    while stack:
        a, b = stack.pop()
        if b - a <= 1 or staging_union_size(topk[a:b], token_slot[a:b], num_pages,
                                            block_size) <= capacity:
            out.append((a, b))
        else:
            mid = (a + b) // 2
            stack += [(mid, b), (a, mid)]
    return out
