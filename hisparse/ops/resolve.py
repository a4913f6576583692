"""Resolver + swap-in: logical top-k positions -> flat GPU arena row ids, per layer.

Spec (:func:`resolve_rows_reference`). Consecutive tokens with the same ``token_req[t] = r >= 0``
form one *request group*; each request appears in at most one group per call. For a group:

1. Walk its entries in order (token, then k). ``pos < 0`` or ``pos // block_size >= P`` -> ``-1``.
   A *resident* position (``resident_block_table[r, page] >= 0``) -> its resident row
   ``block * block_size + pos % block_size``; it touches no hot state and no counter.
2. Every other position is a *hot lookup*. Slot ``j`` of the hot buffer lives at arena row
   ``hot_block_table[r, j // block_size] * block_size + j % block_size``; it is *usable* iff that
   block is ``>= 0`` (unusable slots are never looked up, chosen or changed; keys they hold are
   ignored). A position held by a usable slot is a *hit*; otherwise, if its host block
   ``host_block_table[r, page]`` is ``>= 0`` and the group has a usable slot, it is a *miss*;
   otherwise it is *unservable* and outputs ``-1`` (the scheduler guarantees this never happens).
   Hits and misses are de-duplicated over the group; misses are numbered in first-reference order.
3. Candidates = usable slots not hit in this call, in current LRU order (oldest first). Miss ``i``
   takes candidate ``i``: its key becomes the position and the row is copied from host row
   ``host_block_table[r, page] * block_size + pos % block_size`` into the slot's arena row.
   More misses than candidates raises ``ValueError`` in the reference; the Triton kernel loads the
   first ``#candidates`` misses and outputs ``-1`` for the rest (misses still all counted).
4. New LRU order = [slots neither hit nor loaded, in old LRU order] + [loaded slots, in miss
   order] + [hit slots, in old LRU order]. Hits are thus the most recently used.
5. ``counters[0] += #unique hits``, ``counters[1] += #unique misses`` (resident lookups count in
   neither). If ``counters`` has a third entry, ``counters[2] += #corrupt LRU entries`` (below).

Policies (issue 15; keyword arguments ``band``, ``policy``, ``prefetch``, ``hot_flags``). ``band
[T, NB]`` holds each token's next-ranked positions (indexer ranks ``K .. K + NB - 1``, best
first, ``-1`` padding: the same top-``K + NB`` pass as ``topk``). After step 2, the group's band
entries are walked in order (token, then rank); a non-resident position neither selected nor seen
before is *band-held* if a usable slot holds it (band ordinal = first-reference order), else a
*band miss* if it is servable (first-reference order).

- ``policy="lru"`` (default): steps 3-4 as above; the band only feeds prefetch.
- ``policy="score"``: candidates = [usable unreferenced slots not band-held, used fewer than
  ``PROTECT_USES`` times, in LRU order] + [the other such slots, in LRU order] + [band-held
  slots, highest band ordinal (worst rank) first]: rows outside the top-``K + NB`` (the lowest
  current scores) go before any band row, and among them rows used less often go first.
  Band-held slots that are not evicted count as used: new LRU order = [untouched] + [kept
  band-held, worst rank first] + [prefetched] + [loaded] + [hit]. Without a band and without
  ``hot_flags`` it is exactly ``lru``.
- ``prefetch = B > 0`` (needs ``band`` and ``hot_flags``): after the demand misses took their
  victims, the first ``min(#band misses, B, #targets)`` band misses are copied into *targets*:
  usable slots neither hit, nor loaded, nor band-held, in LRU order (so a row the step selected
  is never evicted, and demand misses always have priority). New LRU order = [untouched] +
  [kept band-held (score)] + [prefetched, band order] + [loaded] + [hit].
- ``hot_flags [R, H]`` int32 (per-slot policy state) ``= uses << 1 | prefetched``: a demand
  load sets ``uses = 1, prefetched = 0``; a prefetch sets ``uses = 0, prefetched = 1``; a hit
  counts a prefetch hit if ``prefetched``, clears it and adds a use (saturating at
  ``USE_COUNT_CAP``). Without ``hot_flags`` every use count reads 0.
- With ``counters`` of 5 entries: ``counters[3] += #prefetched``, ``counters[4] += #prefetch
  hits``. ``counters[1]`` stays the demand (critical-path) misses.

Off the critical path: with ``prefetch_plan`` (``[2, G, prefetch]`` int64, ``G >= min(T, R)``)
the prefetched rows are not copied; the ``g``-th request group of the call (in token order) lists
them in ``prefetch_plan[0, g, :n]`` (host rows) and ``prefetch_plan[1, g, :n]`` (arena rows) and
``-1`` in the rest of row ``g``; rows of no group are left as they are. Keys, LRU order, flags
and counters are updated exactly as if the rows were copied, so the next call's state is the
fused call's. :func:`prefetch_copy` then moves them and *consumes* the plan (resets it to all
``-1``: a plan is all ``-1`` between a copy and the next resolve, so stale rows are never
replayed). On GPU the copy runs on a side stream: the targets are slots no token of the step
reads, so attention need not wait; the next call on the same layer's hot state (and any hot
reset, and the next write of the plan) must (the worker joins the side stream at the end of
every forward).

Fail-safe: an LRU entry outside ``[0, H)`` (corrupt state) is never read or written through: it is
not a candidate, keeps its place among the untouched entries of the new order, and is counted in
``counters[2]``. (A slot missing from the LRU because of it is never a victim; if such a slot is
hit, the new LRU order is unspecified but stays a list of in-range writes: the Triton kernel
can then leave a stale entry that repeats a slot (seen in the interpreter), and the reference
may raise under the score policy; the engine reports the count as
``LLM.stats()["hot_lru_corrupt"]`` and logs it as an error.) A step whose misses outnumber
the unreferenced usable slots the corrupt LRU still lists (the reference raises) loads
nothing in the Triton kernel: its misses get ``-1``, the LRU order stays as it was (the use
flags of the slots it would have loaded still read "just loaded"). Duplicate in-range LRU
entries or keys are not detected (the op trusts them, like the keys). The engine never writes
such entries: a nonzero ``counters[2]`` is a bug upstream.

Padding tokens (``token_req == -1``) output a row of ``-1`` and touch nothing. Within one token's
row positions must be unique (the indexer guarantees it). ``hot_keys`` must be reset to ``-1``
whenever the hot blocks change or a host block is reused (DESIGN I6): the op trusts the keys.

The Triton path is two launches, entirely on device (no host sync, fixed shapes, a fixed number
of launches): the resolver (one program per request group: lookups, victims, LRU, outputs; it
writes the group's rows to load as a copy list) and the miss gather (``MISS_COPY_SPLIT`` programs
per group, each moving a share of the list, so a group's misses stream through many SMs instead
of one). Misses are copied straight from the (pinned, on CUDA) ``host`` tensor through unified
addressing, in flat 16-byte chunks. A group with no usable hot slot (a request not in host-read
mode in a mixed batch), or whose selections are all resident, only writes its outputs.
Position map, scratch and copy list live in a caller-owned :class:`ResolveWorkspace`, allocated
once for the largest call (as FlashMLA's ``FlashMLASchedMeta`` holds kernel state for its
caller): CUDA-graph capturable, and graphs captured at any batch size stay valid.
"""

from __future__ import annotations

import torch

from ._common import (
    MISS_COPY_SPLIT,
    PROTECT_USES,
    USE_COUNT_CAP,
    check_prefetch_plan,
    position_map_max_epoch,
    position_map_shift,
    want_triton,
)

POLICIES = ("lru", "score")
HOT_POLICIES = ("lru", "score", "score+prefetch")


def hot_policy_params(name: str, index_topk: int,
                      prefetch_rows: int | None = None) -> tuple[str, int, int]:
    """Engine hot policy name -> ``(policy, band, prefetch)`` for :func:`resolve_rows`: the band
    is ``index_topk`` next-ranked rows (the indexer returns top-``2 * index_topk``, sorted) and
    prefetch moves at most ``prefetch_rows`` rows per (layer, request) step, by default
    ``max(1, index_topk // 64)`` (the settings measured by ``hisparse bench-policy``: docs in
    the report of issue 15); ``prefetch_rows`` is ignored by the policies without prefetch."""
    if name not in HOT_POLICIES:
        raise ValueError(f"hot_policy must be one of {HOT_POLICIES}, got {name!r}")
    if prefetch_rows is not None and (not isinstance(prefetch_rows, int)
                                      or isinstance(prefetch_rows, bool) or prefetch_rows < 0):
        raise ValueError(f"hot_prefetch_rows must be None or an integer >= 0, "
                         f"got {prefetch_rows!r}")
    if name == "lru":
        return "lru", 0, 0
    pf = 0
    if name == "score+prefetch":
        pf = max(1, index_topk // 64) if prefetch_rows is None else int(prefetch_rows)
    return "score", int(index_topk), pf


class ResolveWorkspace:
    """Device state of the Triton resolver, owned by the caller and allocated once.

    ``position_map [max_groups, max_positions]`` int32 and ``map_epoch [max_groups]`` int32:
    row ``g`` belongs to the call's ``g``-th request group; each call advances that row's epoch
    and tags what it writes with it, so an entry of an earlier call reads as unmapped and no
    call resets the map (:func:`~hisparse.ops._common.position_map_shift`; a row is cleared
    when its epoch wraps); ``scratch [6, max_groups, hot_buffer_size]`` int32 (victims, miss
    positions, new LRU order, band ordinals, band-miss positions, prefetch targets);
    ``copy_rows [2, max_groups, hot_buffer_size]`` int64 (per group, the host rows and arena rows
    the miss gather moves; ``-1`` skip) and ``copy_count [max_groups, MISS_COPY_SPLIT]`` int32,
    all 0 between calls (the resolver writes a group's list length into its row, each gather
    program reads and zeroes its own cell). A call needs
    ``max_groups >= min(T, R)`` (request groups of the call), ``max_positions >= P * block_size``
    and the same ``H``; a workspace is never grown (a captured CUDA graph keeps its addresses),
    a call that does not fit raises ``ValueError``. One workspace serves every layer (calls on
    one stream run in order).
    """

    def __init__(self, max_groups: int, max_positions: int, hot_buffer_size: int,
                 device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.max_groups = max(1, int(max_groups))
        self.max_positions = max(1, int(max_positions))
        self.hot_buffer_size = max(1, int(hot_buffer_size))
        position_map_max_epoch(self.hot_buffer_size)       # the map's layout fits (or raises)
        self.position_map = torch.zeros((self.max_groups, self.max_positions),
                                        dtype=torch.int32, device=self.device)
        self.map_epoch = torch.zeros(self.max_groups, dtype=torch.int32, device=self.device)
        self.scratch = torch.empty((6, self.max_groups, self.hot_buffer_size), dtype=torch.int32,
                                   device=self.device)
        self.copy_rows = torch.empty((2, self.max_groups, self.hot_buffer_size),
                                     dtype=torch.int64, device=self.device)
        self.copy_count = torch.zeros((self.max_groups, MISS_COPY_SPLIT), dtype=torch.int32,
                                      device=self.device)

    def map_is_clean(self) -> bool:
        """Every entry reads as unmapped in each row's next call (no entry carries an epoch
        beyond its row's): what a call must leave behind (tests). The map's layout follows
        the workspace's ``hot_buffer_size``, whatever a call's ``H``."""
        written = self.position_map >> position_map_shift(self.hot_buffer_size)
        return bool((written <= self.map_epoch[:, None]).all())

    def check(self, groups: int, positions: int, hot_buffer_size: int, device) -> None:
        if (groups > self.max_groups or positions > self.max_positions
                or max(1, hot_buffer_size) > self.hot_buffer_size
                or torch.device(device) != self.position_map.device):
            raise ValueError(
                f"resolve_rows: workspace ({self.max_groups} groups, {self.max_positions} "
                f"positions, H={self.hot_buffer_size}, {self.position_map.device}) is too small "
                f"for a call with {groups} groups, {positions} positions, H={hot_buffer_size} "
                f"on {device}; size it for the largest batch up front")


def _check_policy(policy: str, band, prefetch: int, hot_flags) -> None:
    if policy not in POLICIES:
        raise ValueError(f"resolve_rows: policy must be one of {POLICIES}, got {policy!r}")
    if prefetch < 0:
        raise ValueError(f"resolve_rows: prefetch must be >= 0, got {prefetch}")
    if prefetch and band is None:
        raise ValueError("resolve_rows: prefetch needs the band (next-ranked positions)")
    if prefetch and hot_flags is None:
        raise ValueError("resolve_rows: prefetch needs hot_flags (per-slot prefetch marks)")


def resolve_rows_reference(topk, token_req, resident_block_table, host_block_table,
                           hot_block_table, hot_keys, hot_lru, arena, host, block_size, counters,
                           band=None, policy: str = "lru", prefetch: int = 0, hot_flags=None,
                           prefetch_plan=None):
    """Plain PyTorch/Python spec of :func:`resolve_rows` (any device; loops in Python)."""
    _check_policy(policy, band, prefetch, hot_flags)
    check_prefetch_plan(prefetch_plan, prefetch, topk.shape[0], resident_block_table.shape[0])
    T, K = topk.shape
    P = resident_block_table.shape[1]
    HB = hot_block_table.shape[1]
    H = hot_keys.shape[1]
    out = [[-1] * K for _ in range(T)]
    topk_l = topk.tolist()
    band_l = band.tolist() if band is not None else [[] for _ in range(T)]
    req_l = token_req.tolist()
    n_hits = n_misses = n_bad = n_pf_total = n_pf_used = 0
    group = -1                                         # ordinal of the current request group
    t = 0
    while t < T:
        r = req_l[t]
        if r < 0:
            t += 1
            continue
        t1 = t + 1
        while t1 < T and req_l[t1] == r:
            t1 += 1
        group += 1
        res_row = resident_block_table[r].tolist()
        host_row = host_block_table[r].tolist()
        hot_row = hot_block_table[r].tolist()
        keys = hot_keys[r].tolist()
        lru = hot_lru[r].tolist()
        usable = [(j // block_size) < HB and hot_row[j // block_size] >= 0 for j in range(H)]
        n_bad += sum(1 for s in lru if not 0 <= s < H)    # corrupt entries: skipped, counted
        any_usable = any(usable)
        slot_of = {keys[j]: j for j in range(H) if usable[j] and keys[j] >= 0}
        hit_slots: set[int] = set()
        miss_ord: dict[int, int] = {}
        misses: list[int] = []
        pending = []                                   # (t, k, pos) hot lookups to fill later
        for tt in range(t, t1):
            for k, pos in enumerate(topk_l[tt]):
                if pos < 0 or pos // block_size >= P:
                    continue
                page = pos // block_size
                if res_row[page] >= 0:
                    out[tt][k] = res_row[page] * block_size + pos % block_size
                    continue
                if pos in slot_of:
                    hit_slots.add(slot_of[pos])
                    pending.append((tt, k, pos))
                elif host_row[page] >= 0 and any_usable:
                    if pos not in miss_ord:
                        miss_ord[pos] = len(misses)
                        misses.append(pos)
                    pending.append((tt, k, pos))
        # band walk: next-ranked positions already hot (band-held slots, by first reference)
        # and band misses (prefetch candidates, first-reference order)
        band_ord: dict[int, int] = {}
        band_miss: list[int] = []
        seen: set[int] = set()
        for tt in range(t, t1):
            for pos in band_l[tt]:
                if pos < 0 or pos // block_size >= P or pos in seen:
                    continue
                page = pos // block_size
                if res_row[page] >= 0 or pos in miss_ord:
                    continue
                if pos in slot_of:
                    if slot_of[pos] not in hit_slots:
                        seen.add(pos)
                        band_ord[slot_of[pos]] = len(band_ord)
                elif host_row[page] >= 0 and any_usable:
                    seen.add(pos)
                    band_miss.append(pos)
        cands = [s for s in lru if 0 <= s < H and usable[s] and s not in hit_slots]
        flags = hot_flags[r].tolist() if hot_flags is not None else [0] * H
        if policy == "score":       # outside the band first (LRU order), then the band, worst first
            nb = [s for s in cands if s not in band_ord]
            cands = ([s for s in nb if flags[s] >> 1 < PROTECT_USES]
                     + [s for s in nb if flags[s] >> 1 >= PROTECT_USES]
                     + sorted((s for s in cands if s in band_ord), key=lambda s: -band_ord[s]))
        if len(misses) > len(cands):
            raise ValueError(
                f"resolve_rows: request slot {r} needs {len(misses)} new hot rows but only "
                f"{len(cands)} unreferenced usable hot slots exist (hot buffer too small for the "
                f"union of its tokens' selections)")
        victims = cands[:len(misses)]
        loaded = set(victims)
        pf_victims: list[int] = []
        if prefetch:
            pf_cands = [s for s in lru if 0 <= s < H and usable[s] and s not in hit_slots
                        and s not in loaded and s not in band_ord]
            n_pf = min(len(band_miss), prefetch, len(pf_cands))
            pf_victims = pf_cands[:n_pf]
        pf_pos = band_miss[:len(pf_victims)]
        fills = list(zip(misses, victims)) + list(zip(pf_pos, pf_victims))
        copies = fills
        if prefetch_plan is not None and prefetch:      # prefetch copies go to the plan
            copies = list(zip(misses, victims))
            src = [host_row[p // block_size] * block_size + p % block_size for p in pf_pos]
            dst = [hot_row[s // block_size] * block_size + s % block_size for s in pf_victims]
            n = len(src)
            prefetch_plan[:, group] = -1
            if n:
                prefetch_plan[0, group, :n] = torch.tensor(src, dtype=torch.int64)
                prefetch_plan[1, group, :n] = torch.tensor(dst, dtype=torch.int64)
        if copies:
            src = torch.tensor([host_row[p // block_size] * block_size + p % block_size
                                for p, _ in copies],
                               dtype=torch.long, device=host.device)
            dst = torch.tensor([hot_row[s // block_size] * block_size + s % block_size
                                for _, s in copies],
                               dtype=torch.long, device=arena.device)
            arena[dst] = host[src].to(device=arena.device, dtype=arena.dtype)
        for p, s in fills:
            if keys[s] >= 0:
                slot_of.pop(keys[s], None)
            keys[s] = p
            slot_of[p] = s
        if hot_flags is not None:
            for s in hit_slots:
                n_pf_used += flags[s] & 1
                flags[s] = min((flags[s] >> 1) + 1, USE_COUNT_CAP) << 1
            for s in victims:
                flags[s] = 1 << 1
            for s in pf_victims:
                flags[s] = 1
            hot_flags[r] = torch.tensor(flags, dtype=hot_flags.dtype, device=hot_flags.device)
        n_pf_total += len(pf_victims)
        moved = loaded | set(pf_victims)
        kept_band: list[int] = []
        if policy == "score":       # band rows that stay hot count as used, worst rank first
            kept_band = sorted((s for s in band_ord if s not in loaded),
                               key=lambda s: -band_ord[s])
            moved |= set(kept_band)
        new_lru = ([s for s in lru if s not in hit_slots and s not in moved] + kept_band
                   + pf_victims + victims + [s for s in lru if s in hit_slots])
        for tt, k, pos in pending:
            s = slot_of[pos]
            out[tt][k] = hot_row[s // block_size] * block_size + s % block_size
        hot_keys[r] = torch.tensor(keys, dtype=hot_keys.dtype, device=hot_keys.device)
        hot_lru[r] = torch.tensor(new_lru, dtype=hot_lru.dtype, device=hot_lru.device)
        n_hits += len(hit_slots)
        n_misses += len(misses)
        t = t1
    counters[0] += n_hits
    counters[1] += n_misses
    if counters.numel() > 2:
        counters[2] += n_bad
    if counters.numel() > 4:
        counters[3] += n_pf_total
        counters[4] += n_pf_used
    return torch.tensor(out, dtype=torch.int32, device=topk.device).view(T, K)


def resolve_rows(topk: torch.Tensor, token_req: torch.Tensor, resident_block_table: torch.Tensor,
                 host_block_table: torch.Tensor, hot_block_table: torch.Tensor,
                 hot_keys: torch.Tensor, hot_lru: torch.Tensor, arena: torch.Tensor,
                 host: torch.Tensor, block_size: int, counters: torch.Tensor,
                 out: torch.Tensor | None = None,
                 workspace: ResolveWorkspace | None = None, band: torch.Tensor | None = None,
                 policy: str = "lru", prefetch: int = 0,
                 hot_flags: torch.Tensor | None = None,
                 prefetch_plan: torch.Tensor | None = None) -> torch.Tensor:
    """Resolve ``topk [T, K]`` logical positions to flat arena rows ``[T, K]`` int32 (``-1`` skip).

    Mutates ``hot_keys``, ``hot_lru``, ``counters`` and the hot rows of ``arena``. See the module
    docstring for the exact semantics. Triton on CUDA (``host`` must then be pinned CPU memory or
    a CUDA tensor), the reference otherwise. ``workspace``: the Triton kernel's state (see
    :class:`ResolveWorkspace`); required for CUDA-graph capture; without one a call allocates a
    temporary workspace sized for itself.
    """
    _check_policy(policy, band, prefetch, hot_flags)
    check_prefetch_plan(prefetch_plan, prefetch, topk.shape[0], resident_block_table.shape[0])
    if want_triton(arena, topk):
        from ._resolve_triton import resolve_rows_triton
        if workspace is None:
            workspace = ResolveWorkspace(min(topk.shape[0], resident_block_table.shape[0]),
                                         resident_block_table.shape[1] * block_size,
                                         hot_keys.shape[1], arena.device)
        return resolve_rows_triton(topk, token_req, resident_block_table, host_block_table,
                                   hot_block_table, hot_keys, hot_lru, arena, host, block_size,
                                   counters, workspace, out=out, band=band, policy=policy,
                                   prefetch=prefetch, hot_flags=hot_flags,
                                   prefetch_plan=prefetch_plan)
    res = resolve_rows_reference(topk, token_req, resident_block_table, host_block_table,
                                 hot_block_table, hot_keys, hot_lru, arena, host, block_size,
                                 counters, band=band, policy=policy, prefetch=prefetch,
                                 hot_flags=hot_flags, prefetch_plan=prefetch_plan)
    if out is not None:
        out.copy_(res)
        return out
    return res


def prefetch_copy_reference(plan: torch.Tensor, arena: torch.Tensor, host: torch.Tensor) -> None:
    """Spec of :func:`prefetch_copy`: ``arena[plan[1, e]] = host[plan[0, e]]`` where both are
    ``>= 0``, then ``plan`` is reset to all ``-1`` (consumed)."""
    src, dst = plan[0].reshape(-1), plan[1].reshape(-1)
    keep = (src >= 0) & (dst >= 0)
    if bool(keep.any()):
        arena[dst[keep].to(arena.device)] = host[src[keep].to(host.device)].to(
            device=arena.device, dtype=arena.dtype)
    plan.fill_(-1)


def prefetch_copy(plan: torch.Tensor, arena: torch.Tensor, host: torch.Tensor) -> None:
    """Executes and consumes a ``prefetch_plan`` written by :func:`resolve_rows`: host rows
    ``plan[0]`` into arena rows ``plan[1]`` (``-1`` skip), then the plan is all ``-1``. Fixed
    shapes, one launch, no host sync on CUDA (Triton, zero-copy reads of pinned ``host``);
    launch it on a side stream ordered after the resolver."""
    if want_triton(arena, plan):
        from ._resolve_triton import prefetch_copy_triton
        return prefetch_copy_triton(plan, arena, host)
    return prefetch_copy_reference(plan, arena, host)
