"""Triton exact top-k (imported lazily by topk.py): a radix select over 8-bit digits.

Per call, with ``SPLITS`` programs per row (each owns one contiguous chunk of the row's first
``lengths[t]`` columns, the same chunks in every phase; up to ``LIVE_MAX_ROWS`` rows the
launch's programs are spread over the rows with ``lengths > 0`` only, so a padded batch's real
rows get the padding's programs: :func:`_live_rows`), ``_topk_select_kernel`` runs these
phases: all in one launch (``fused``, the default on CUDA: the row's programs wait for each
other between phases on an arrival counter), or one launch per phase (``phased``; under the
interpreter, which runs programs one after the other, unless each row has one program):

0-3. Histogram of digit ``level`` (bits ``31-8l..24-8l`` of the key with its sign bit flipped,
   i.e. unsigned order) over the valid columns whose higher digits equal the threshold prefix
   found so far, added into the row's global histogram (atomics) and stored in the program's
   (row, split) slot. Each program first advances the threshold state by one level (the
   previous level's 256-bin global histogram and the state stored in the phase before;
   program 0 of the row stores the new one; in one launch: the state in registers, below) and
   reads no key once the row is resolved (at most ``k`` valid columns, or every column of the
   threshold bucket taken). Past digit 0 a key block with at most ``TopkLaunch.sparse`` such
   columns adds them by atomics instead (a histogram costs the same for 1 column as for all).
4. Collect: with the final state (``cgt`` columns strictly above the prefix ``P`` at the
   resolved level, ``need = k - cgt`` of those equal to it, by lower column) each program
   writes the columns above ``P`` into slots ``0..cgt-1`` (one atomic a program reserves its
   range: its count from its own split histograms) and the tied ones into ``cgt + rank``
   where ``rank`` counts ties in column order (earlier splits' tie counts come from their
   stored histograms): each as the packed int64
   ``(key << 32) | (2^32 - 1 - col)`` (distinct: ties by lower column) into the row's sort
   scratch (the ``legacy`` ranking: the column into ``out``).
5. Chunk sort: the ``min(k, valid)`` packed entries in chunks of ``CH`` slots, each sorted in
   place by one program (``tl.sort``).
6. Merge: each entry goes to its rank, the sum over the row's sorted chunks of the entries
   above it (a binary search in each), ``-1`` padding. Per program one sort of ``CH`` and
   ``log2(CH) + 1`` gathers, where the former ranking (``legacy``: phases 0-4, then
   ``_sort_kernel``) has one program per row sort all ``k`` (a bitonic network of
   ``log2(k)^2 / 2`` stages over the padded width: ~30 us on the H200 whatever the batch).

Column order (``ranked=False``, constexpr ``COLUMNS``) replaces phases 4-6: 4. each program
stores its count of columns above ``P`` (its own split histograms) in ``TopkScratch.counts``;
5. after the row's programs meet, each writes its selected columns at their final slots in
column order, from the earlier splits' counts, its running count and the ties taken before it
(``min(ties so far, need)``), and ``-1`` past the selection.

In the one launch the threshold state stays in registers (each program derives it from the
row's global histograms after a barrier, so all of a row's programs agree), and a resolved row
skips the remaining digits and their barriers: a row of at most ``k`` valid columns passes
one barrier before its collect, not four.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ._common import (
    MAX_SPLITS,
    RADIX_BINS,
    RADIX_LEVELS,
    TOPK_HIST_WIDTH,
    interpreted,
    next_pow2,
)

if TYPE_CHECKING:   # the annotation only: topk imports this module, never the reverse
    from .topk import TopkLaunch, TopkScratch

COUNTER = RADIX_LEVELS * RADIX_BINS         # hist row: [4 x 256 counts | slot counter | ...
STATE_OFFSET = COUNTER + 8                  # ... | state after level l at + 8 * (l + 1) |
BAR_OFFSET = STATE_OFFSET + 8 * (RADIX_LEVELS + 1)  # ... | fused launch: phase arrivals ]
assert BAR_OFFSET + RADIX_LEVELS + 2 <= TOPK_HIST_WIDTH, "the hist row holds every phase's arrivals"
LEGACY_SPLITS = 16                          # the former path's most programs per row
SPIN_POLLS = 1 << 20                        # a fused launch's longest wait at a row barrier
LIVE_MAX_ROWS = 512     # rows a launch maps its programs over (decode batches; one compile for all)


@triton.jit
def _row_span(len_ptr, row, sp, W, SPLITS, BLOCK: tl.constexpr):
    """Columns ``[lo, hi)`` of split ``sp`` of row ``row`` (chunks of whole blocks)."""
    n = tl.load(len_ptr + row)
    n = tl.minimum(tl.maximum(n, 0), W)
    per = ((n + SPLITS - 1) // SPLITS + BLOCK - 1) // BLOCK * BLOCK
    lo = sp * per
    hi = tl.minimum(n, lo + per)
    return lo, hi


@triton.jit
def _advance(h, K, L: tl.constexpr, level, pre, cgt, need, done, NB: tl.constexpr):
    """The threshold state after level ``L`` from the one before it and the row's global
    histogram ``h [NB]`` of digit ``L``. State: ``(level, pre, cgt, need, done)``. ``level`` 0
    (at most ``K`` valid columns): every valid column is taken. Else the columns whose
    ``level``-digit prefix is above ``pre`` (``cgt`` of them) are taken, plus the first ``need``
    (by column) equal to it; ``done``: no further level is needed."""
    offs = tl.arange(0, NB)
    cge = tl.sum(h, 0) - tl.cumsum(h, 0) + h                        # count(digit >= d)
    b = tl.max(tl.where(cge >= need, offs, -1), 0)                  # threshold digit
    gt = tl.sum(tl.where(offs > b, h, 0), 0)
    hb = tl.sum(tl.where(offs == b, h, 0), 0)
    go = done == 0
    pre = tl.where(go, pre * NB + b, pre)
    cgt = tl.where(go, cgt + gt, cgt)
    level = tl.where(go, L + 1, level)
    need = tl.where(go, need - gt, need)
    done = done | (hb == need).to(tl.int32)
    return level, pre, cgt, need, done


@triton.jit
def _state_after(h_row, K, L: tl.constexpr, NB: tl.constexpr, STATE: tl.constexpr):
    """State after levels ``0..L`` (``L + 1`` of them): level 0 from the first histogram, later
    ones from the state the previous kernel stored (``h_row[STATE + 8 * L ...]``)."""
    offs = tl.arange(0, NB)
    if L == 0:
        h = tl.load(h_row + offs, cache_modifier=".cg")
        total = tl.sum(h, 0)
        done = (total <= K).to(tl.int32)
        level = total * 0
        pre = level
        cgt = level
        need = level + K
    else:
        st = h_row + STATE + 8 * L
        level = tl.load(st, cache_modifier=".cg")
        pre = tl.load(st + 1, cache_modifier=".cg")
        cgt = tl.load(st + 2, cache_modifier=".cg")
        need = tl.load(st + 3, cache_modifier=".cg")
        done = tl.load(st + 4, cache_modifier=".cg")
        h = tl.load(h_row + L * NB + offs, cache_modifier=".cg")
    # the prefix has up to 32 bits: carried as int64, stored as its low 32 bits
    pre = pre.to(tl.int64) & 4294967295
    level, pre, cgt, need, done = _advance(h, K, L, level, pre, cgt, need, done, NB)
    return level, pre, cgt, need, done


@triton.jit
def _store_state(h_row, L: tl.constexpr, level, pre, cgt, need, done, STATE: tl.constexpr):
    st = h_row + STATE + 8 * (L + 1)
    tl.store(st, level)
    tl.store(st + 1, pre.to(tl.int32))
    tl.store(st + 2, cgt)
    tl.store(st + 3, need)
    tl.store(st + 4, done.to(tl.int32))


@triton.jit
def _load_keys(base, offs, hi):
    """Keys ``base[offs]`` below ``hi`` (``INT32_MIN`` past it) and which are valid."""
    m = offs < hi
    s = tl.load(base + offs, mask=m, other=-2147483648)
    return s, m & (s != -2147483648)


@triton.jit
def _digit(s, ok, prefix, LEVEL: tl.constexpr):
    """Digit ``LEVEL`` (bits ``31-8L..24-8L`` of the unsigned key) of keys ``s``, and which
    of the valid ``ok`` match ``prefix`` (the higher digits; 32-bit compares)."""
    u = (s ^ -2147483648).to(tl.uint32, bitcast=True)               # unsigned order
    if LEVEL > 0:
        ok = ok & ((u >> (32 - 8 * LEVEL)) == prefix.to(tl.uint32))
    return ok, ((u >> (24 - 8 * LEVEL)) & 0xFF).to(tl.int32)


@triton.jit
def _final_prefix(level, pre):
    """The resolved state's ``(prefix, shift)`` as uint32 for :func:`_place_selected`: the
    ``level`` digits of a key (level 4: all of them) against ``pre``; level 0 takes every
    valid column (shift 0 against prefix 0: only ``INT32_MIN``'s unsigned key is 0)."""
    return (tl.where(level == 0, 0, pre).to(tl.uint32),
            tl.where(level == 0, 0, 32 - 8 * level).to(tl.uint32))


@triton.jit
def _hist_block(base, start, hi, prefix, split_lv, LEVEL: tl.constexpr,
                NB: tl.constexpr, BLOCK: tl.constexpr, SPARSE: tl.constexpr):
    """Histogram of digit ``LEVEL`` over columns ``start .. start + BLOCK - 1`` (``< hi``)
    that are valid and match ``prefix`` on the higher digits. Past the first digit a block
    with at most ``SPARSE`` such columns adds them one by one into the split's histogram of
    the digit (``split_lv``; atomics, the program's own: no other program contends) and
    returns zeros: the histogram's cost is per column of the block, matching or not."""
    offs = start + tl.arange(0, BLOCK)
    s, ok = _load_keys(base, offs, hi)
    ok, d = _digit(s, ok, prefix, LEVEL)
    if LEVEL == 0:
        h = tl.histogram(d, NB, mask=ok)
    else:   # past the first digit most blocks hold few columns of the threshold bucket
        h = tl.zeros([NB], dtype=tl.int32)
        n = tl.sum(ok.to(tl.int32), 0)
        if n > SPARSE:
            h = tl.histogram(d, NB, mask=ok)
        elif n > 0:
            tl.atomic_add(split_lv + d, 1, mask=ok, sem="relaxed")
    return h


@triton.jit
def _collect_block(base, o_row, start, hi, prefix, shift, cgt, need, slot_base, tie_base, K,
                   BLOCK: tl.constexpr, PACKED: tl.constexpr, COLUMNS: tl.constexpr):
    """:func:`_place_selected` over columns ``start .. start + BLOCK - 1`` (``< hi``)."""
    tl.static_assert(BLOCK <= 16384, "a block's two counts share one int32 prefix sum")
    offs = start + tl.arange(0, BLOCK)
    s, ok = _load_keys(base, offs, hi)
    return _place_selected(o_row, s, ok, offs, prefix, shift, cgt, need, slot_base, tie_base,
                           K, PACKED, COLUMNS)


@triton.jit
def _place_selected(o_row, s, ok, offs, prefix, shift, cgt, need, slot_base, tie_base, K,
                    PACKED: tl.constexpr, COLUMNS: tl.constexpr):
    """Write the selected columns ``offs`` (keys ``s``, valid ``ok``; fewer than 65,536) into
    their slots (``PACKED``: as packed ``(key << 32) | (2^32 - 1 - col)`` int64 into the row's
    sort scratch ``o_row``; else the column into the row of ``out``): the columns above the
    prefix from ``slot_base`` on, the tied ones at ``cgt + tie_base`` on (column order);
    ``COLUMNS``: every selected column at its final slot in column order, ``slot_base``
    (columns above the prefix before these) plus the selected ties before it, ``min(tie_base
    + ties so far, need)``. ``prefix`` and ``shift`` are uint32 (:func:`_final_prefix`): a
    column is above (equal to) the prefix where its unsigned key shifted right by ``shift``
    is. Returns both bases past these columns."""
    u = (s ^ -2147483648).to(tl.uint32, bitcast=True)
    pref = u >> shift
    gt = ok & (pref > prefix)
    tie = ok & (pref == prefix)
    both = gt.to(tl.int32) | (tie.to(tl.int32) << 16)               # one scan for both counts
    run = tl.cumsum(both, 0)
    if PACKED:
        val = (s.to(tl.int64) << 32) | (4294967295 - offs.to(tl.int64))  # ties: lower column
    else:
        val = offs
    rank = tie_base + ((run >> 16) & 65535) - 1
    if COLUMNS:
        slot = slot_base + (run & 65535) + tl.minimum(rank + 1, need) - 1
        tl.store(o_row + slot, val, mask=(gt | (tie & (rank < need))) & (slot < K))
    else:
        slot = slot_base + (run & 65535) - 1
        tl.store(o_row + slot, val, mask=gt & (slot < K))  # K: a bound if a state is wrong
        tl.store(o_row + cgt + rank, val, mask=tie & (rank < need))
    total = tl.sum(both, 0)
    return slot_base + (total & 65535), tie_base + ((total >> 16) & 65535)


@triton.jit
def _barrier(h_row, idx, SPLITS, stall_ptr, BAR: tl.constexpr, SPIN: tl.constexpr):
    """Wait until the row's ``SPLITS`` programs have all finished phase ``idx`` (fused launch
    only: one arrival counter per phase in the row's hist state, zeroed by each call). Safe
    because a row's programs are adjacent in launch order and the launch is sized to be
    resident at once (``_launch_config``). A wait is bounded (``SPIN`` polls, about a second):
    one that runs out is counted in ``stall_ptr`` (``TopkScratch.stalls``, never expected)
    rather than wedging the GPU; returns 1 then (else 0)."""
    tl.debug_barrier()                      # every thread's writes of the phase precede ...
    p = h_row + BAR + idx
    tl.atomic_add(p, 1, sem="release")      # ... the program's arrival
    arrived = tl.atomic_add(p, 0, sem="acquire")
    n = tl.full([], 0, tl.int32)
    while (arrived < SPLITS) & (n < SPIN):
        arrived = tl.atomic_add(p, 0, sem="acquire")
        n += 1
    if arrived < SPLITS:
        tl.atomic_add(stall_ptr, 1, sem="relaxed")
    return (arrived < SPLITS).to(tl.int32)


@triton.jit
def _hist_phase(keys_ptr, len_ptr, h_row, split_ptr, row, sp, slot0, W, K, SPLITS, stride_k,
                stride_s, LEVEL: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                STATE: tl.constexpr, FOR_LOOP: tl.constexpr, STAGES: tl.constexpr,
                SPARSE: tl.constexpr):
    """Histogram phase ``LEVEL`` of a launch of its own: the threshold state from the state the
    previous launch stored (split 0 stores the next one), then :func:`_hist_pass`."""
    prefix = tl.full([], -1, tl.int64)
    done = tl.full([], 0, tl.int32)
    if LEVEL > 0:
        level, pre, cgt, need, done = _state_after(h_row, K, LEVEL - 1, NB, STATE)
        if sp == 0:
            _store_state(h_row, LEVEL - 1, level, pre, cgt, need, done, STATE)
        prefix = pre
    _hist_pass(keys_ptr, len_ptr, h_row, split_ptr, row, sp, slot0, W, SPLITS, stride_k,
               stride_s, prefix, done, LEVEL, NB, BLOCK, FOR_LOOP, STAGES, SPARSE)


@triton.jit
def _hist_pass(keys_ptr, len_ptr, h_row, split_ptr, row, sp, slot0, W, SPLITS, stride_k,
               stride_s, prefix, done, LEVEL: tl.constexpr, NB: tl.constexpr,
               BLOCK: tl.constexpr, FOR_LOOP: tl.constexpr, STAGES: tl.constexpr,
               SPARSE: tl.constexpr):
    """Digit ``LEVEL``'s histogram over the program's columns matching ``prefix`` (none once
    ``done``): written to the program's split slot and added into the row's global histogram
    (``SPARSE`` > 0 past the first digit: the slot is zeroed first, then added into, as the
    sparse blocks add theirs (:func:`_hist_block`), and the row's gets the slot's sum once)."""
    lo, hi = _row_span(len_ptr, row, sp, W, SPLITS, BLOCK)
    hi = tl.where(done != 0, lo, hi)                                # resolved: read nothing
    base = keys_ptr + row.to(tl.int64) * stride_k
    # the bins as tl.histogram lays them out (at 4 warps, the default: one a thread a pass):
    # the coalescer's two-wide stores and loads moved each histogram through shared memory
    offs_b = tl.max_contiguous(tl.arange(0, NB), 1)
    hist_lv = h_row + LEVEL * NB
    split_lv = split_ptr + (slot0 + sp).to(tl.int64) * stride_s + LEVEL * NB
    if LEVEL > 0 and SPARSE > 0:
        tl.store(split_lv + offs_b, tl.zeros([NB], dtype=tl.int32))
        tl.debug_barrier()      # the zeros precede every thread's additions
    acc = tl.zeros([NB], dtype=tl.int32)
    if FOR_LOOP:
        for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
            acc += _hist_block(base, start, hi, prefix, split_lv, LEVEL, NB, BLOCK, SPARSE)
    else:   # the interpreter of triton 3.6 cannot take loaded bounds in a `for`
        start = lo
        while start < hi:
            acc += _hist_block(base, start, hi, prefix, split_lv, LEVEL, NB, BLOCK, SPARSE)
            start += BLOCK
    if LEVEL > 0 and SPARSE > 0:
        tl.atomic_add(split_lv + offs_b, acc, mask=acc > 0, sem="relaxed")
        tl.debug_barrier()      # every thread's additions precede the slot's read
        acc = tl.atomic_add(split_lv + offs_b, 0, sem="relaxed")   # a read, one bin a thread
    else:
        tl.store(split_lv + offs_b, acc)
    tl.atomic_add(hist_lv + offs_b, acc, mask=acc > 0, sem="relaxed")


@triton.jit
def _own_above(split_ptr, slot0, sp, stride_s, level, prefix, LEVELS: tl.constexpr,
               NB: tl.constexpr):
    """The program's columns above the final prefix (``level`` 0: every valid column), counted
    by its own split histograms: at each level below the resolved one, the digits above the
    prefix's among the columns that match its higher digits."""
    own = split_ptr + (slot0 + sp).to(tl.int64) * stride_s
    lv2 = tl.arange(0, LEVELS)[:, None]
    d2 = tl.arange(0, NB)[None, :]
    pdig = (prefix >> (8 * tl.maximum(level - 1 - lv2, 0)).to(tl.int64)) & (NB - 1)
    above = tl.where(level == 0, lv2 == 0, (lv2 < level) & (d2 > pdig))
    return tl.sum(tl.sum(tl.load(own + lv2 * NB + d2, mask=above, other=0,
                                 cache_modifier=".cg"), 1), 0)


@triton.jit
def _count_phase(split_ptr, count_ptr, slot0, sp, stride_s, level, prefix, LEVELS: tl.constexpr,
                 NB: tl.constexpr):
    """Column order's exchange: the program's columns above the final prefix into its slot of
    ``count_ptr`` (the later splits of the row start past them)."""
    prefix = tl.where(level == 0, -1, prefix)
    tl.store(count_ptr + slot0 + sp, _own_above(split_ptr, slot0, sp, stride_s, level, prefix,
                                                LEVELS, NB))


@triton.jit
def _collect_phase(keys_ptr, len_ptr, h_row, split_ptr, count_ptr, out_ptr, sorted_ptr, row, sp,
                   slot0, W, K, SPLITS, stride_k, stride_s, stride_o, stride_q, level, prefix,
                   cgt, need, LEVELS: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                   FOR_LOOP: tl.constexpr, STAGES: tl.constexpr, MAXS: tl.constexpr,
                   PACKED: tl.constexpr, COLUMNS: tl.constexpr):
    """The collect with the final threshold state ``(level, prefix, cgt, need)``: the selected
    columns into ``out`` (the legacy ranking) or, ``PACKED``, with their keys into the sort
    scratch (the kernel's own ranking phases); ``COLUMNS``: into ``out`` at their final slots,
    in column order (after :func:`_count_phase` and its barrier), and ``-1`` past the
    selection."""
    lo, hi = _row_span(len_ptr, row, sp, W, SPLITS, BLOCK)
    prefix = tl.where(level == 0, -1, prefix)                       # level 0: all above it
    # ties (prefix == P) in earlier splits: their counts in the resolved level's histograms
    s_row = split_ptr + slot0.to(tl.int64) * stride_s
    dig = (prefix & (NB - 1)).to(tl.int32)
    lv = tl.maximum(level - 1, 0)
    s2 = tl.arange(0, MAXS)
    tie_base = tl.sum(tl.load(s_row + s2 * stride_s + lv * NB + dig, mask=s2 < sp, other=0,
                              cache_modifier=".cg"), 0)
    tie_base = tl.where(level == 0, 0, tie_base)    # level 0 has no ties (all above -1)
    prefix32, shift = _final_prefix(level, prefix)
    base = keys_ptr + row.to(tl.int64) * stride_k
    if PACKED:
        o_row = sorted_ptr + row.to(tl.int64) * stride_q
    else:
        o_row = out_ptr + row.to(tl.int64) * stride_o
    if COLUMNS:     # the earlier splits' columns above the prefix (exchanged)
        slot_base = tl.sum(tl.load(count_ptr + slot0 + s2, mask=s2 < sp, other=0,
                                   cache_modifier=".cg"), 0)
    else:           # one slot reservation for all the program's blocks
        n_gt = _own_above(split_ptr, slot0, sp, stride_s, level, prefix, LEVELS, NB)
        slot_base = tl.atomic_add(h_row + LEVELS * NB, n_gt, mask=n_gt > 0,
                                  sem="relaxed")                    # COUNTER
        slot_base = tl.where(n_gt > 0, slot_base, 0)
    if FOR_LOOP:
        for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
            slot_base, tie_base = _collect_block(base, o_row, start, hi, prefix32, shift, cgt,
                                                 need, slot_base, tie_base, K, BLOCK, PACKED,
                                                 COLUMNS)
    else:
        start = lo
        while start < hi:
            slot_base, tie_base = _collect_block(base, o_row, start, hi, prefix32, shift, cgt,
                                                 need, slot_base, tie_base, K, BLOCK, PACKED,
                                                 COLUMNS)
            start += BLOCK
    if COLUMNS:     # -1 past the selection, the row's slots shared by its programs
        n_sel = _selected(h_row, K, NB)
        c = (n_sel // BLOCK + sp) * BLOCK
        while c < K:
            j = c + tl.arange(0, BLOCK)
            tl.store(o_row + j, tl.full([BLOCK], -1, tl.int32), mask=(j >= n_sel) & (j < K))
            c += SPLITS * BLOCK


@triton.jit
def _selected(h_row, K, NB: tl.constexpr):
    """``min(k, valid)``: the row's selection size (the level-0 histogram's total)."""
    total = tl.sum(tl.load(h_row + tl.arange(0, NB), cache_modifier=".cg"), 0)
    return tl.minimum(total, K)


@triton.jit
def _chunk_sort_phase(h_row, sorted_ptr, row, sp, K, SPLITS, stride_q, NB: tl.constexpr,
                      CH: tl.constexpr, C: tl.constexpr):
    """Chunks ``sp, sp + SPLITS, ..`` of ``CH`` slots of the row's sort scratch (the packed
    selection the collect wrote), each sorted in place, descending (``INT64_MIN`` past the
    selection)."""
    n_sel = _selected(h_row, K, NB)
    q_row = sorted_ptr + row.to(tl.int64) * stride_q
    c = sp
    while c < C:
        j = c * CH + tl.arange(0, CH)
        packed = tl.load(q_row + j, mask=j < n_sel, other=-9223372036854775808,
                         cache_modifier=".cg")
        tl.store(q_row + j, tl.sort(packed, descending=True))
        c += SPLITS


@triton.jit
def _merge_phase(h_row, out_ptr, sorted_ptr, row, sp, K, SPLITS, stride_o, stride_q,
                 NB: tl.constexpr, CH: tl.constexpr, LOG_CH: tl.constexpr, C: tl.constexpr,
                 CPAD: tl.constexpr):
    """The rank of each entry of chunk ``c`` is the number of entries above it in every sorted
    chunk (its own included: packed keys are distinct), by a branchless binary search in each;
    each entry's column goes to its rank, ``-1`` into the chunk's slots past the selection."""
    n_sel = _selected(h_row, K, NB)
    o_row = out_ptr + row.to(tl.int64) * stride_o
    q_row = sorted_ptr + row.to(tl.int64) * stride_q
    i = tl.arange(0, CH)
    cc = tl.arange(0, CPAD)[None, :]
    c = sp
    while c < C:
        x = tl.load(q_row + c * CH + i, cache_modifier=".cg")
        pos = tl.zeros([CH, CPAD], dtype=tl.int32)
        for b in tl.static_range(LOG_CH + 1):
            probe = pos + (CH >> b)
            y = tl.load(q_row + cc * CH + probe - 1, mask=(probe <= CH) & (cc < C),
                        other=-9223372036854775808, cache_modifier=".cg")
            pos = tl.where(y > x[:, None], probe, pos)
        rank = tl.sum(pos, 1)
        j = c * CH + i
        tl.store(o_row + rank, (4294967295 - (x & 4294967295)).to(tl.int32), mask=j < n_sel)
        tl.store(o_row + j, tl.full([CH], -1, tl.int32), mask=(j >= n_sel) & (j < K))
        c += SPLITS


@triton.jit
def _live_rows(len_ptr, pid, T, PROGRAMS, MOST, TPAD: tl.constexpr):
    """The programs of a launch over the rows with a non-empty prefix (``lengths > 0``; a
    graph bucket's padding rows are empty): ``SPLITS = min(MOST, PROGRAMS // live rows)``
    programs per live row, program ``pid`` serving split ``pid % SPLITS`` of the ``pid //
    SPLITS``-th live row (its split slots from ``pid - sp``). Returns ``(row, sp, slot0,
    SPLITS, active, empty_row)``: ``active`` false past the live rows' programs;
    ``empty_row``, the ``pid``-th empty row (-1 none), is this program's to fill with -1."""
    offs = tl.arange(0, TPAD)
    live = tl.load(len_ptr + offs, mask=offs < T, other=0) > 0
    empty = (offs < T) & (~live)
    n_live = tl.sum(live.to(tl.int32), 0)
    splits = tl.maximum(tl.minimum(MOST, PROGRAMS // tl.maximum(n_live, 1)), 1)
    ordinal = pid // splits
    sp = pid % splits
    row = tl.sum(tl.where(live & (tl.cumsum(live.to(tl.int32), 0) == ordinal + 1), offs, 0), 0)
    empty_row = tl.sum(tl.where(empty & (tl.cumsum(empty.to(tl.int32), 0) == pid + 1),
                                offs + 1, 0), 0) - 1
    return row, sp, ordinal * splits, splits, ordinal < n_live, empty_row


@triton.jit
def _topk_select_kernel(keys_ptr, len_ptr, hist_ptr, split_ptr, count_ptr, out_ptr, sorted_ptr,
                        stall_ptr, T, W, K, SPLITS, MOST, PROGRAMS, stride_k, stride_h, stride_s,
                        stride_o, stride_q,
                        FIRST: tl.constexpr, LAST: tl.constexpr, LEVELS: tl.constexpr,
                        NB: tl.constexpr, BLOCK: tl.constexpr, STATE: tl.constexpr,
                        BAR: tl.constexpr, FOR_LOOP: tl.constexpr, STAGES: tl.constexpr,
                        CH: tl.constexpr, LOG_CH: tl.constexpr, C: tl.constexpr,
                        CPAD: tl.constexpr, MAXS: tl.constexpr, SPIN: tl.constexpr,
                        LIVE: tl.constexpr, TPAD: tl.constexpr, FILL: tl.constexpr,
                        RANKED: tl.constexpr, COLUMNS: tl.constexpr,
                        SPARSE: tl.constexpr):
    """Phases ``FIRST..LAST`` (module docstring: ``0..LEVELS-1`` histograms, collect, chunk
    sort, merge; ``COLUMNS``: histograms, count, collect in column order) of program ``(row,
    split)``, a row barrier between two phases of one launch.
    ``LIVE``: ``PROGRAMS`` programs (at most the launch's; a fused launch's all resident) serve
    the non-empty rows only (:func:`_live_rows`: a padded batch's real rows get the padding's
    programs; ``FILL``, the launch that ends the ranking, writes the empty rows' ``-1``); else
    ``(pid // SPLITS, pid % SPLITS)``, every row, empty or not. ``RANKED``: the launch's phases
    rank the selection (the collect packs it into the sort scratch); false for ``legacy``,
    whose ``_sort_kernel`` sorts the columns the collect writes into ``out``."""
    pid = tl.program_id(0)
    if LIVE:
        row, sp, slot0, SPLITS, active, empty_row = _live_rows(len_ptr, pid, T, PROGRAMS,
                                                               MOST, TPAD)
        if FILL:
            if empty_row >= 0:
                for c in tl.static_range(C):
                    j = c * CH + tl.arange(0, CH)
                    tl.store(out_ptr + empty_row.to(tl.int64) * stride_o + j,
                             tl.full([CH], -1, tl.int32), mask=j < K)
    else:
        row = pid // SPLITS
        sp = pid % SPLITS
        slot0 = row * SPLITS
        active = pid >= 0
    if active:
        h_row = hist_ptr + row * stride_h
        if FIRST == 0 and LAST >= LEVELS:
            # one launch: the threshold state stays in registers, the same in every program of
            # the row (each derives it from the row's global histograms after the barrier), so
            # once it is resolved the row's programs skip the remaining digits and barriers
            # together
            _hist_pass(keys_ptr, len_ptr, h_row, split_ptr, row, sp, slot0, W, SPLITS,
                       stride_k, stride_s, tl.full([], -1, tl.int64), tl.full([], 0, tl.int32),
                       0, NB, BLOCK, FOR_LOOP, STAGES, SPARSE)
            stalled = _barrier(h_row, 0, SPLITS, stall_ptr, BAR, SPIN)
            level, pre, cgt, need, done = _state_after(h_row, K, 0, NB, STATE)
            for L in tl.static_range(1, LEVELS):
                # a program whose wait ran out (a bug, counted: the result is not trusted)
                # may see another state than its row's: it still arrives at every barrier,
                # so that the others do not wait out theirs too
                if (done == 0) | (stalled != 0):
                    if done == 0:
                        _hist_pass(keys_ptr, len_ptr, h_row, split_ptr, row, sp, slot0, W,
                                   SPLITS, stride_k, stride_s, pre, done, L, NB, BLOCK,
                                   FOR_LOOP, STAGES, SPARSE)
                    stalled = stalled | _barrier(h_row, L, SPLITS, stall_ptr, BAR, SPIN)
                    h = tl.load(h_row + L * NB + tl.arange(0, NB), cache_modifier=".cg")
                    level, pre, cgt, need, done = _advance(h, K, L, level, pre, cgt, need, done,
                                                           NB)
            if COLUMNS:
                _count_phase(split_ptr, count_ptr, slot0, sp, stride_s, level, pre, LEVELS, NB)
                _barrier(h_row, LEVELS, SPLITS, stall_ptr, BAR, SPIN)
            _collect_phase(keys_ptr, len_ptr, h_row, split_ptr, count_ptr, out_ptr, sorted_ptr,
                           row, sp, slot0, W, K, SPLITS, stride_k, stride_s, stride_o, stride_q,
                           level, pre, cgt, need, LEVELS, NB, BLOCK, FOR_LOOP, STAGES, MAXS,
                           RANKED, COLUMNS)
            if LAST > LEVELS + 1:       # the ranking's sort and merge (not COLUMNS, legacy)
                _barrier(h_row, LEVELS, SPLITS, stall_ptr, BAR, SPIN)
                _chunk_sort_phase(h_row, sorted_ptr, row, sp, K, SPLITS, stride_q, NB, CH, C)
                _barrier(h_row, LEVELS + 1, SPLITS, stall_ptr, BAR, SPIN)
                _merge_phase(h_row, out_ptr, sorted_ptr, row, sp, K, SPLITS, stride_o, stride_q,
                             NB, CH, LOG_CH, C, CPAD)
        else:   # one launch a phase: the state goes through the row's hist state
            for phase in tl.static_range(FIRST, LAST + 1):
                if phase > FIRST:
                    _barrier(h_row, phase - 1, SPLITS, stall_ptr, BAR, SPIN)
                if phase < LEVELS:
                    _hist_phase(keys_ptr, len_ptr, h_row, split_ptr, row, sp, slot0, W, K,
                                SPLITS, stride_k, stride_s, phase, NB, BLOCK, STATE, FOR_LOOP,
                                STAGES, SPARSE)
                elif phase == LEVELS:
                    level, pre, cgt, need, _ = _state_after(h_row, K, LEVELS - 1, NB, STATE)
                    if COLUMNS:
                        _count_phase(split_ptr, count_ptr, slot0, sp, stride_s, level, pre,
                                     LEVELS, NB)
                    else:
                        _collect_phase(keys_ptr, len_ptr, h_row, split_ptr, count_ptr, out_ptr,
                                       sorted_ptr, row, sp, slot0, W, K, SPLITS, stride_k,
                                       stride_s, stride_o, stride_q, level, pre, cgt, need,
                                       LEVELS, NB, BLOCK, FOR_LOOP, STAGES, MAXS, RANKED,
                                       COLUMNS)
                elif phase == LEVELS + 1:
                    if COLUMNS:
                        level, pre, cgt, need, _ = _state_after(h_row, K, LEVELS - 1, NB, STATE)
                        _collect_phase(keys_ptr, len_ptr, h_row, split_ptr, count_ptr, out_ptr,
                                       sorted_ptr, row, sp, slot0, W, K, SPLITS, stride_k,
                                       stride_s, stride_o, stride_q, level, pre, cgt, need,
                                       LEVELS, NB, BLOCK, FOR_LOOP, STAGES, MAXS, RANKED,
                                       COLUMNS)
                    else:
                        _chunk_sort_phase(h_row, sorted_ptr, row, sp, K, SPLITS, stride_q, NB,
                                          CH, C)
                else:
                    _merge_phase(h_row, out_ptr, sorted_ptr, row, sp, K, SPLITS, stride_o,
                                 stride_q, NB, CH, LOG_CH, C, CPAD)


def short_warps(row: int) -> int:
    """Warps of the short rows' kernel for rows of ``row`` columns (8 keys a thread at
    least, up to 16 warps: 4,096 -> 8, 8,192 -> 16; SM90 compile, Triton 3.6: no spill)."""
    return min(16, max(1, row // 512))


@triton.jit
def _topk_short_kernel(keys_ptr, len_ptr, out_ptr, long_ptr, W, K, stride_k, stride_o,
                       ROW: tl.constexpr, NB: tl.constexpr, LEVELS: tl.constexpr,
                       KPAD: tl.constexpr):
    """Column order for the rows of at most ``ROW`` columns (``TopkLaunch.short_rows``): one
    program a row holds its keys in registers through the digits (no key read twice, no row
    barrier), then writes its selection in column order and ``-1`` past it (an empty row: all
    ``-1``). ``long_ptr[t]``: the row's length where it is longer than ``ROW`` (the fused
    launch's rows, read as its lengths), else 0."""
    tl.static_assert(ROW <= 32768, "a row's two counts share one int32 prefix sum")
    t = tl.program_id(0)
    n = tl.minimum(tl.maximum(tl.load(len_ptr + t), 0), W)
    tl.store(long_ptr + t, tl.where(n > ROW, n, 0))
    if n <= ROW:
        offs = tl.arange(0, ROW)
        s, ok = _load_keys(keys_ptr + t.to(tl.int64) * stride_k, offs, n)
        total = tl.sum(ok.to(tl.int32), 0)
        level = total * 0
        pre = level.to(tl.int64)
        cgt = level
        need = level + K
        done = (total <= K).to(tl.int32)        # at most k valid columns: all of them
        for L in tl.static_range(LEVELS):
            if done == 0:
                match, d = _digit(s, ok, pre, L)
                h = tl.histogram(d, NB, mask=match)
                level, pre, cgt, need, done = _advance(h, K, L, level, pre, cgt, need, done,
                                                       NB)
        o_row = out_ptr + t.to(tl.int64) * stride_o
        prefix32, shift = _final_prefix(level, pre)
        _place_selected(o_row, s, ok, offs, prefix32, shift, cgt, need, 0, 0, K, False, True)
        j = tl.arange(0, KPAD)
        tl.store(o_row + j, tl.full([KPAD], -1, tl.int32),
                 mask=(j >= tl.minimum(total, K)) & (j < K))


@triton.jit
def _sort_selection(k_row, h_row, o_row, K, NB: tl.constexpr, KPAD: tl.constexpr):
    """One program sorts a row's whole selection in place: the ``min(K, valid)`` collected
    columns of ``o_row`` by key descending, ties by the lower column, ``-1`` after them."""
    total = tl.sum(tl.load(h_row + tl.arange(0, NB), cache_modifier=".cg"), 0)
    n_sel = tl.minimum(total, K)
    j = tl.arange(0, KPAD)
    m = j < n_sel
    col = tl.load(o_row + j, mask=m, other=0, cache_modifier=".cg")
    key = tl.load(k_row + col, mask=m, other=0)
    packed = (key.to(tl.int64) << 32) | (4294967295 - col.to(tl.int64))    # ties: lower col
    none = tl.full([KPAD], -9223372036854775808, tl.int64)
    packed = tl.sort(tl.where(m, packed, none), descending=True)
    res = (4294967295 - (packed & 4294967295)).to(tl.int32)
    res = tl.where(packed == none, -1, res)
    tl.store(o_row + j, res, mask=j < K)


@triton.jit
def _sort_kernel(keys_ptr, hist_ptr, out_ptr, K, stride_k, stride_h, stride_o,
                 NB: tl.constexpr, KPAD: tl.constexpr):
    """The former ranking (``HISPARSE_TOPK=legacy``): one program per row sorts its whole
    selection."""
    row = tl.program_id(0)
    _sort_selection(keys_ptr + row.to(tl.int64) * stride_k, hist_ptr + row * stride_h,
                    out_ptr + row.to(tl.int64) * stride_o, K, NB, KPAD)


@triton.jit
def _column_order_kernel(sel_ptr, out_ptr, K, stride_s, stride_o, BLOCK: tl.constexpr):
    """Row ``t``'s selection ``sel[t, :K]`` (distinct columns, ``-1`` none) ascending, ``-1``
    after them: ``-1`` and the block's padding sort last as ``INT32_MAX``."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    m = j < K
    col = tl.load(sel_ptr + t * stride_s + j, mask=m, other=-1)
    col = tl.sort(tl.where(col < 0, 2147483647, col))
    tl.store(out_ptr + t * stride_o + j, tl.where(col == 2147483647, -1, col), mask=m)


@triton.jit
def _popcount(x):
    """Set bits of each int32 of ``x`` (SWAR on the unsigned bits), as int32."""
    u = x.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _column_order_bitmap_kernel(sel_ptr, out_ptr, bits_ptr, K, NW, stride_s, stride_o,
                                stride_b, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr):
    """Row ``t``'s selection ascending by counting, not sorting: its columns (distinct, ``<
    32 * NW``) set bits of a bitmap of ``NW`` words (``bits[t, :NW]``), the words' exclusive
    prefix popcounts go to ``bits[t, NW:2 NW]``, and each column is stored at its rank (the
    set bits below it); ``-1`` after them. Phases meet at CTA barriers (a CTA's global writes
    are visible to it after ``bar.sync``; the words are read past L1)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    m = j < K
    col = tl.load(sel_ptr + t * stride_s + j, mask=m, other=-1)
    ok = m & (col >= 0) & (col < NW * 32)
    words = bits_ptr + t * stride_b
    w = tl.arange(0, BLOCK_W)
    wm = w < NW
    tl.store(words + w, tl.zeros([BLOCK_W], tl.int32), mask=wm)
    tl.debug_barrier()
    tl.atomic_or(words + (col >> 5), 1 << (col & 31), mask=ok)
    tl.debug_barrier()
    pc = _popcount(tl.load(words + w, mask=wm, other=0, cache_modifier=".cg"))
    tl.store(words + NW + w, tl.cumsum(pc, 0) - pc, mask=wm)
    tl.debug_barrier()
    wi = col >> 5
    below = tl.load(words + NW + wi, mask=ok, other=0, cache_modifier=".cg")
    word = tl.load(words + wi, mask=ok, other=0, cache_modifier=".cg")
    low = (tl.full([BLOCK], 1, tl.uint32) << (col & 31).to(tl.uint32)) - 1
    rank = below + _popcount(word & low.to(tl.int32, bitcast=True))
    tl.store(out_ptr + t * stride_o + rank, col, mask=ok)
    n = tl.sum(ok.to(tl.int32), 0)
    tl.store(out_ptr + t * stride_o + j, tl.full([BLOCK], -1, tl.int32), mask=m & (j >= n))


def column_order_triton(selection: torch.Tensor, out: torch.Tensor,
                        bits: torch.Tensor | None = None, width: int = 0) -> torch.Tensor:
    """:func:`~hisparse.ops.topk.column_order` in one launch, one program a row (``out``:
    ``[T, k]`` int32, unit column stride): by counting over a bitmap in ``bits`` (``[>= T, >=
    2 * ceil(width / 32)]`` int32 scratch, overwritten; columns ``< width``) when given, else
    a sort of each row."""
    T, k = selection.shape
    if T and k:
        if selection.stride(1) != 1 or out.stride(1) != 1 or out.shape != (T, k):
            raise ValueError("column_order_triton: selection and out must be [T, k] with unit "
                             "column stride")
        block = next_pow2(k)
        if bits is None:
            _column_order_kernel[(T,)](selection, out, k, selection.stride(0), out.stride(0),
                                       BLOCK=block, num_warps=min(16, max(4, block // 256)))
            return out
        nw = triton.cdiv(width, 32)
        if (width < 1 or bits.dtype != torch.int32 or bits.dim() != 2 or bits.shape[0] < T
                or bits.shape[1] < 2 * nw or bits.stride(1) != 1 or bits.stride(0) < 2 * nw
                or bits.device != selection.device):
            raise ValueError(f"column_order_triton: bits must be [>= {T}, >= {2 * nw}] int32 "
                             f"rows of their own (unit column stride) on {selection.device} "
                             f"for width {width}, got {tuple(bits.shape)} {bits.dtype} "
                             f"strides {bits.stride()} on {bits.device}")
        block_w = next_pow2(nw)
        _column_order_bitmap_kernel[(T,)](selection, out, bits, k, nw, selection.stride(0),
                                          out.stride(0), bits.stride(0), BLOCK=block,
                                          BLOCK_W=block_w,
                                          num_warps=min(16, max(4, block // 256,
                                                                block_w // 1024)))
    return out


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _row_cap(W: int, cfg: TopkLaunch, mode: str) -> int:
    """The most programs a row of ``W`` columns gets by default: one block each at least."""
    most = LEGACY_SPLITS if mode == "legacy" else MAX_SPLITS
    return max(1, min(most, triton.cdiv(max(W, 1), cfg.block)))


# How many more key blocks 4 programs an SM must put on the busiest SM than 3 or 2 do before
# the launch takes fewer (see _per_sm)
PER_SM_MARGIN = 1.25


def _per_sm(T: int, W: int, sms: int, cfg: TopkLaunch, slots: int) -> int:
    """Programs an SM a fused launch of ``T`` rows (padding rows included) over a ``W``-column
    table asks for: ``cfg.per_sm``, else 4, or 3 or 2 where 4 would put at least
    :data:`PER_SM_MARGIN` times the key blocks on the busiest SM (the one of them that puts
    fewest; 3 on a tie); 4 where ``cfg.splits`` is given. With ``p`` an SM a row gets the
    splits :func:`_launch_config` gives (``p * sms // T``, at most one a block of ``W`` and
    :data:`MAX_SPLITS`), a program reads ``ceil(blocks / splits)`` blocks and an SM runs
    ``ceil(T * splits / sms)`` programs.

    ``W`` is the launch's width, not the rows' lengths (those are on the GPU): a CUDA graph's
    table is ``max_model_len`` wide, so the model assumes rows as long as the table (in a
    163,840-column table 32k rows took 0.84x the time at 2 than at the pick, 4, at 8 rows and
    0.86x at 3 at 24 rows: twenty-eighth session; splits fitted to the rows in the kernel
    gave 0.89x at 8 rows, nothing at 24, and cost 1-5% elsewhere: not kept). It is
    coarse (the hardware does not place programs evenly), hence 4 unless the margin is clear:
    measured on the H100 with rows as long as the table (docs/BENCHMARKS.md, twenty-seventh
    session), 4 was the fastest of 2-4 or within 2% at 8-48 rows x 32k, 8-32 x 64k, 8-16 x
    128k and 64-96 x 2.3k in both orders, except 24 x 32k (3 took 0.82-0.83x the time of 4;
    the model's busiest SM reads 8 blocks at 4 against 6 at 3). The former rule (2 below 34
    rows, else 4) took 1.04-1.18x the time of this pick at 8-32 x 32k and at every 64k and
    128k point. Phased and legacy launches size their splits from the pick too."""
    if cfg.per_sm is not None:
        return cfg.per_sm
    if cfg.splits is not None:  # the splits are given: the most programs resident
        return 4
    cuda, blocks = torch.device("cuda"), triton.cdiv(W, cfg.block)
    busiest = {}        # programs an SM -> key blocks its busiest SM reads
    for per_sm in (4, 3, 2):
        splits = _launch_config(T, W, cuda, cfg, slots, "fused", True, per_sm * sms)
        busiest[per_sm] = triton.cdiv(T * splits, sms) * triton.cdiv(blocks, splits)
    fewer = min((3, 2), key=busiest.get)
    return fewer if busiest[4] >= PER_SM_MARGIN * busiest[fewer] else 4


def _fits_per_sm(n_regs: int, shared: int, warps: int, regs: int = 65536,
                 threads: int = 2048, smem: int = 228 * 1024) -> int:
    """Programs of a kernel (``n_regs`` registers a thread, ``shared`` bytes, ``warps``) that
    one SM (``regs`` registers, ``threads``, ``smem`` bytes of shared memory) holds at once."""
    per_warp = -(-max(n_regs, 1) * 32 // 256) * 256        # allocated in 256-register units
    warps_by_regs = 4 * (regs // 4 // per_warp)             # per SM sub-partition (4 of them)
    return max(0, min(warps_by_regs // warps, smem // (shared + 1024),
                      threads // (32 * warps), 32))


_OCCUPANCY: dict[tuple, int] = {}


def _occupancy(args: tuple, meta: dict, device: torch.device) -> int:
    """Programs of the kernel's compile for ``args`` and ``meta`` resident on one SM of
    ``device`` (its compile is cached per meta-parameters and the integer arguments'
    specializations: equal to 1, divisible by 16; tensors: 16-byte aligned)."""
    spec = tuple((a == 1, a % 16 == 0) if isinstance(a, int) else a.data_ptr() % 16 == 0
                 for a in args)
    key = (device.index or 0, tuple(sorted(meta.items())), spec)
    if key not in _OCCUPANCY:
        compiled = _topk_select_kernel.warmup(*args, grid=(1,), **meta)
        compiled._init_handles()                        # loads it: sets n_regs
        p = torch.cuda.get_device_properties(key[0])
        _OCCUPANCY[key] = _fits_per_sm(
            compiled.n_regs, compiled.metadata.shared, meta["num_warps"],
            getattr(p, "regs_per_multiprocessor", 65536),
            getattr(p, "max_threads_per_multi_processor", 2048),
            getattr(p, "shared_memory_per_multiprocessor", 228 * 1024))
    return _OCCUPANCY[key]


def _launch_config(T: int, W: int, device: torch.device, cfg: TopkLaunch, slots: int,
                   mode: str, fused: bool, resident: int) -> int:
    """Programs per row within the scratch's ``slots`` split histograms (a fused launch:
    also at most ``resident`` programs in all when rows are split, so all are resident)."""
    splits = cfg.splits
    if splits is None:
        if device.type == "cuda":
            splits = triton.cdiv(resident, T)
        else:   # the interpreter's cost is per program and per block
            splits = 1
        splits = max(1, min(splits, _row_cap(W, cfg, mode), slots // T))
    if not 1 <= splits <= MAX_SPLITS or T * splits > slots:
        raise ValueError(f"topk_select: splits must be in 1..{MAX_SPLITS} with rows x splits "
                         f"<= {slots} (the scratch's split histograms), got {splits}")
    if fused and device.type == "cuda" and splits > 1:
        if cfg.splits is None:
            splits = max(1, min(splits, resident // T))
        elif T * splits > resident:
            raise ValueError(f"topk_select: a fused launch splits rows only while rows x splits "
                             f"<= programs resident at once ({resident}), got {T} x {splits}")
    return splits


def topk_select_triton(keys: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor,
                       scratch: TopkScratch, mode: str, cfg: TopkLaunch,
                       hist_zeroed: bool = False, ranked: bool = True) -> torch.Tensor:
    """The Triton top-k (``mode``: ``fused``, ``phased`` or ``legacy``; module docstring).
    ``hist_zeroed``: ``scratch.hist[:T]`` is zero already (the scoring kernel's work): no fill.
    ``ranked`` false: the selection in column order (no ranking phases; ``legacy``, a
    ranking, runs as ``phased``)."""
    T, W = keys.shape
    if keys.stride(1) != 1:
        raise ValueError("topk_select: keys must have unit column stride")
    ch = cfg.sort_chunk
    sq = scratch.sorted
    if ch < 16 or ch > sq.shape[1] or ch & (ch - 1):
        raise ValueError(f"topk_select: sort_chunk must be a power of two in 16..{sq.shape[1]}, "
                         f"got {ch}")
    if cfg.stages < 1:
        raise ValueError(f"topk_select: stages must be >= 1, got {cfg.stages}")
    if cfg.sparse < 0:
        raise ValueError(f"topk_select: sparse must be >= 0, got {cfg.sparse}")
    sr = cfg.short_rows
    if sr and (sr < 16 or sr > 8192 or sr & (sr - 1)):
        raise ValueError(f"topk_select: short_rows must be 0 or a power of two in 16..8192, "
                         f"got {sr}")
    if (cfg.per_sm is not None and cfg.per_sm < 1) or cfg.warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"topk_select: per_sm must be >= 1 and warps a power of two <= 16, "
                         f"got {cfg.per_sm} and {cfg.warps}")
    if cfg.block < 16 or cfg.block > 16384 or cfg.block & (cfg.block - 1):
        raise ValueError(f"topk_select: block must be a power of two in 16..16384 (a block's "
                         f"two counts share one int32 scan), got {cfg.block}")
    ch = min(ch, max(16, next_pow2(k)))
    C = triton.cdiv(k, ch)
    if not ranked:
        mode = "phased" if mode == "legacy" else mode
    elif mode != "legacy" and C * ch > sq.shape[1]:
        mode = "legacy"         # k beyond the sort scratch: one program per row sorts it
    fused = mode == "fused" and not interpreted()   # the interpreter runs programs one by one
    lengths = lengths.to(torch.int32)
    hist = scratch.hist[:T]
    sh = scratch.split_hist
    live = T <= LIVE_MAX_ROWS
    # column order's short rows: one program a row in registers, first; the launches below
    # then see only the longer rows (the others as empty, which they leave alone: no fill)
    short = min(sr, next_pow2(max(W, 16))) if sr and not ranked and live else 0
    if short:       # (a table narrower than short_rows: every row short, none wider than W)
        _topk_short_kernel[(T,)](keys, lengths, out, scratch.long_lengths, W, k, keys.stride(0),
                                 out.stride(0), ROW=short, NB=RADIX_BINS, LEVELS=RADIX_LEVELS,
                                 KPAD=max(16, next_pow2(k)), num_warps=short_warps(short))
        lengths = scratch.long_lengths[:T]
    common = dict(LEVELS=RADIX_LEVELS, NB=RADIX_BINS, BLOCK=cfg.block, STATE=STATE_OFFSET,
                  BAR=BAR_OFFSET, FOR_LOOP=not interpreted(), STAGES=cfg.stages, MAXS=MAX_SPLITS,
                  SPIN=SPIN_POLLS, LIVE=live, TPAD=LIVE_MAX_ROWS if live else 1,
                  RANKED=ranked and mode != "legacy", COLUMNS=not ranked,
                  SPARSE=min(cfg.sparse, cfg.block),     # past a block: every block by atomics
                  num_warps=cfg.warps)
    sort = dict(CH=ch, LOG_CH=ch.bit_length() - 1, C=C, CPAD=next_pow2(C))
    # the phases after the histograms: collect, chunk sort, merge (legacy: the collect; column
    # order: count, collect)
    last = RADIX_LEVELS + (1 if not ranked else 2 if mode != "legacy" else 0)
    one = dict(FIRST=0, LAST=last, FILL=live and mode != "legacy" and not short, **common,
               **sort)
    sms = _num_sms(keys.device.index or 0) if keys.is_cuda else 1
    per_sm = _per_sm(T, W, sms, cfg, sh.shape[0])
    while True:
        splits = _launch_config(T, W, keys.device, cfg, sh.shape[0], mode, fused,
                                per_sm * sms)
        # programs over the live rows (a batch's padding rows are empty): up to the per-row
        # cap a full launch has, or the caller's own split count; a fused launch of its own
        # splits spreads all the programs that are resident at once (each its own split
        # slot), a row's programs adjacent, the grid at least one program a row
        most = splits if cfg.splits is not None else _row_cap(W, cfg, mode)
        programs = T * splits
        if live and fused and cfg.splits is None:
            programs = max(1, min(per_sm * sms, sh.shape[0], T * most))
        args = (keys, lengths, hist, sh, scratch.counts, out, sq, scratch.stalls, T, W, k,
                splits, most,
                programs, keys.stride(0), hist.stride(0), sh.stride(0), out.stride(0),
                sq.stride(0))
        if not fused:
            break                       # no program waits for another
        # a row's programs wait for each other: all must be resident at once, so never ask
        # an SM for more than the compiled kernel fits
        fits = _occupancy(args, one, keys.device)
        if fits >= per_sm:
            break
        if fits < 1:
            raise RuntimeError(f"topk_select: the fused top-k kernel does not fit an SM "
                               f"(warps={cfg.warps}, block={cfg.block}); use fewer warps")
        if cfg.per_sm is not None:
            raise ValueError(f"topk_select: per_sm={cfg.per_sm} programs do not fit an SM at "
                             f"once ({fits} do): a fused launch needs all resident")
        per_sm = fits
    if not hist_zeroed:
        hist.zero_()
    grid = (max(T, programs) if live else T * splits,)
    # the interpreter runs programs one after another: one launch there only where each row
    # has one program (its row barriers then wait for no other); the empty rows' -1 come
    # from the launch that ends the ranking (legacy: _sort_kernel)
    if fused or (mode == "fused" and (most if live else splits) == 1):
        _topk_select_kernel[grid](*args, **one)
    else:
        unused = dict(CH=16, LOG_CH=4, C=1, CPAD=1)     # one compile of phases 0-4 for any k
        for phase in range(last + 1):
            _topk_select_kernel[grid](*args, FIRST=phase, LAST=phase,
                                      FILL=one["FILL"] and phase == last, **common,
                                      **(sort if phase > RADIX_LEVELS else unused))
    if mode == "legacy":
        kpad = max(16, next_pow2(k))
        _sort_kernel[(T,)](keys, hist, out, k, keys.stride(0), hist.stride(0), out.stride(0),
                           NB=RADIX_BINS, KPAD=kpad, num_warps=8 if kpad >= 2048 else 4)
    return out

