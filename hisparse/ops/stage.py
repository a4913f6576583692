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

from ._common import want_triton
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


# ---------------------------------------------------------------------- device-side plan
# The same spec as stage_rows_reference, computed without a host sync: a fixed-capacity plan
# (sort + mask-unique into a bounded buffer, the union's size kept on the device) and one
# fixed-grid copy launch. Overflow and unreadable members are *reported* on the device and
# raise at the caller's next sync point (check_stage_status), and never write out of bounds.

_SENTINEL = torch.iinfo(torch.int64).max


def stage_plan(topk: torch.Tensor, token_slot: torch.Tensor, resident_table: torch.Tensor,
               host_table: torch.Tensor, block_size: int, capacity: int):
    """Steps 1-4 of the spec on the device, no host sync. Returns ``(rows, res_rows,
    host_rows, count)``:

    - ``rows [T, K]`` int32: as the reference (member index), all ``-1`` when ``|U| >
      capacity`` (overflow: nothing is staged);
    - ``res_rows`` / ``host_rows`` ``[capacity]`` int64: member ``m``'s resident arena row and
      host row (``-1`` none; both ``-1`` past the union);
    - ``count [1]`` int64: ``|U|`` (may exceed ``capacity``: the caller's overflow check).
    """
    T, K = topk.shape
    dev = topk.device
    num_pages = resident_table.shape[1]
    span = num_pages * block_size
    slot = token_slot.long()[:, None].expand(T, K)
    pos = topk.long()
    valid = (pos >= 0) & (slot >= 0) & (pos < span)
    keys = torch.where(valid, slot.clamp(min=0) * span + pos.clamp(min=0),
                       torch.full_like(pos, _SENTINEL)).reshape(-1)
    skeys, order = torch.sort(keys)
    live = skeys != _SENTINEL
    new = live.clone()
    new[1:] &= skeys[1:] != skeys[:-1]
    member = torch.cumsum(new, 0) - 1                       # member index of each sorted entry
    count = new.sum().reshape(1)
    overflow = count > capacity
    fits = live & (member < capacity) & ~overflow
    rows = torch.full((T * K,), -1, dtype=torch.int32, device=dev)
    rows[order] = torch.where(fits, member, -1).to(torch.int32)
    # member keys into a bounded buffer (slot `capacity` is the sink of everything else)
    mkeys = torch.full((capacity + 1,), -1, dtype=torch.int64, device=dev)
    mkeys.scatter_(0, torch.where(new & fits, member, capacity), skeys)
    mkeys = mkeys[:capacity]
    has = mkeys >= 0
    k = mkeys.clamp(min=0)
    m_slot, m_pos = k // span, k % span
    page, off = m_pos // block_size, m_pos % block_size
    res_blk = resident_table[m_slot, page].long()
    if host_table.numel():
        host_blk = host_table[m_slot, page].long()
    else:
        host_blk = torch.full_like(res_blk, -1)
    res_rows = torch.where(has & (res_blk >= 0), res_blk * block_size + off, -1)
    host_rows = torch.where(has & (res_blk < 0) & (host_blk >= 0), host_blk * block_size + off,
                            -1)
    return rows.view(T, K), res_rows, host_rows, count


def _stage_copy_torch(arena, host, staging, res_rows, host_rows) -> None:
    """The copy of :func:`stage_rows_device` with torch indexing (CPU; a fallback that syncs)."""
    r = (res_rows >= 0).nonzero().squeeze(1)
    if r.numel():
        staging[r] = arena[res_rows[r]]
    h = (host_rows >= 0).nonzero().squeeze(1)
    if h.numel():
        staging[h] = host[host_rows[h].to(host.device)].to(staging.device)


def stage_rows_device(topk: torch.Tensor, token_slot: torch.Tensor,
                      resident_table: torch.Tensor, host_table: torch.Tensor,
                      arena: torch.Tensor, host: torch.Tensor, staging: torch.Tensor,
                      block_size: int, counter: torch.Tensor | None = None,
                      status: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`stage_rows_reference`'s result (same ``rows``, same ``staging[:|U|]``, same
    ``counter``) from :func:`stage_plan` and one fixed-grid copy: no host sync on CUDA.

    ``status`` (int64 ``[2]`` on the device, optional): ``status[0] += 1`` when the union
    exceeds the staging area (then nothing is staged and every row is ``-1``), ``status[1] +=``
    the members with neither a resident nor a host row (not copied); the caller raises with
    :func:`check_stage_status` at its next sync point. Without ``status`` the check runs here
    (one sync) and raises ``ValueError`` like the reference.
    """
    cap = staging.shape[0]
    rows, res_rows, host_rows, count = stage_plan(topk, token_slot, resident_table, host_table,
                                                  block_size, cap)
    overflow = count > cap
    live = torch.arange(cap, device=topk.device) < count
    bad = (live & (res_rows < 0) & (host_rows < 0) & ~overflow).sum()
    # nothing is copied on overflow (count -> 0 for the kernel)
    n_copy = torch.where(overflow, torch.zeros_like(count), count)
    if want_triton(staging, arena):
        from ._stage_triton import stage_copy_triton
        kdev = staging.device
        stage_copy_triton(arena, host, staging, res_rows.to(kdev), host_rows.to(kdev),
                          n_copy.to(kdev))
    else:
        keep = live & ~overflow
        _stage_copy_torch(arena, host, staging, torch.where(keep, res_rows, -1),
                          torch.where(keep, host_rows, -1))
    if counter is not None:
        counter += ((host_rows >= 0) & live & ~overflow).sum().to(counter.device)
    if status is not None:
        status[0] += overflow.to(status.dtype).squeeze(0).to(status.device)
        status[1] += bad.to(status.dtype).to(status.device)
    else:
        check_stage_status(torch.stack([overflow.long().squeeze(0), bad]), cap, count)
    return rows


def check_stage_status(status: torch.Tensor, capacity: int | None = None,
                       count: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` if a :func:`stage_rows_device` call reported an overflow or an
    unreadable member into ``status`` (one host sync)."""
    over, bad = (int(x) for x in status.tolist())
    if over:
        n = f" ({int(count.item())})" if count is not None else ""
        raise ValueError(f"stage_rows: the union of selected rows{n} exceeds the staging area"
                         f"{f' ({capacity} rows)' if capacity is not None else ''}: split the "
                         "tokens (stage_rows_device, overflow reported on the device)")
    if bad:
        raise ValueError(f"stage_rows: {bad} selected row(s) neither resident nor on host")


def stage_groups_bounded(token_slot: list[int], history: list[int], topk: int,
                         capacity: int) -> list[tuple[int, int]]:
    """Consecutive token ranges whose union is *guaranteed* to fit ``capacity`` rows, from host
    data only (no sync): a range's union is at most ``min(tokens * topk, sum over its slots of
    the slot's largest history)`` (``history[t]`` = positions token ``t`` can select, e.g.
    ``pos + 1``; ``token_slot[t]`` its request). Greedy; a single token is always a range (it
    fits when ``capacity >= topk``)."""
    out: list[tuple[int, int]] = []
    a, T = 0, len(token_slot)
    while a < T:
        hist: dict[int, int] = {}
        b = a
        while b < T:
            s, h = token_slot[b], history[b]
            old = hist.get(s, 0)
            bound = sum(hist.values()) - old + max(old, h)
            if b > a and min((b - a + 1) * topk, bound) > capacity:
                break
            hist[s] = max(old, h)
            b += 1
        out.append((a, b))
        a = b
    return out
