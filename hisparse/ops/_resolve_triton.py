"""Triton resolver + zero-copy swap-in kernels (imported lazily by resolve.py).

``_resolve_kernel``: one program per request group (grid = T; non-leader tokens exit at once).
A group with no usable hot slot writes its resident rows (and ``-1``) and stops; a group whose
walk (B, B2) finds no hot lookup and no hot or servable band row stops there (nothing else
changes). Otherwise phases, separated by CTA barriers (global writes of a CTA are visible to
the CTA after ``bar.sync``):

A  map the usable hot slots' keys into a per-group position map ``M[g, pos] = slot``;
B  walk the group's entries (token, then k, in blocks): resident rows are written out; a mapped
   position is a hit (``M = H + slot``, counted once); an unmapped servable one a miss
   (``M = -2 - ordinal``, ordinal = first-reference order via a block prefix sum);
C  walk the LRU once: candidates (usable, not hit) get ordinals by prefix sum; the first n_load
   become victims; every slot's new LRU position is computed in the same pass;
D  load the misses: keys updated, the (host row, arena row) pairs to copy written to the
   group's copy list and its length to the group's ``copy_count`` row; write the outputs of hot
   lookups;
E  copy the new LRU order back.

``M`` is persistent and never reset: each entry carries the epoch of the call that wrote it
(row ``g``'s epoch advances once a call; :func:`_map_get` reads an older entry as unmapped),
so no pass clears what a call touched (measured on the H200: those passes were a quarter of
a program's 40 us). Loads whose address is known are not masked by another load's result
(a slot's key is read whatever its block; the masks are applied to the values), so a phase
waits on fewer dependent round trips.

``_resolve_gather_kernel`` (grid ``(groups, MISS_COPY_SPLIT)``, launched right after on the same
stream): program ``(g, s)`` reads and zeroes ``copy_count[g, s]`` and copies its contiguous share
of group ``g``'s list host -> arena in flat 16-byte chunks. One program per group moving every
miss made a group's misses (up to a whole cold hot buffer) wait on one SM's loads in flight; the
kernel time was the slowest group's.

``M``, the per-group scratch and the copy list live in a caller-owned
:class:`~hisparse.ops.resolve.ResolveWorkspace` (allocated once for the largest call; never a
module global: DESIGN section 7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    MISS_COPY_SPLIT,
    PROTECT_USES,
    USE_COUNT_CAP,
    check_prefetch_plan,
    next_pow2,
    position_map_max_epoch,
    position_map_shift,
)


@triton.jit
def _map_get(ptrs, mask, ep, SHIFT: tl.constexpr, BIAS: tl.constexpr):
    """The position-map values at ``ptrs`` written by this call (epoch ``ep``); ``-1`` for an
    entry of an earlier call and for masked lanes."""
    w = tl.load(ptrs, mask=mask, other=0, volatile=True)
    return tl.where((w >> SHIFT) == ep, (w & ((1 << SHIFT) - 1)) - BIAS, -1)


@triton.jit
def _map_put(ptrs, value, mask, ep, SHIFT: tl.constexpr, BIAS: tl.constexpr):
    tl.store(ptrs, (ep << SHIFT) | (value + BIAS), mask=mask)


@triton.jit
def _field(packed, AT: tl.constexpr):
    """The 16-bit count at bit ``AT`` of packed int64 counts (one prefix sum serves several)."""
    return ((packed >> AT) & 0xFFFF).to(tl.int32)


@triton.jit
def _resolve_kernel(topk_ptr, req_ptr, res_bt_ptr, host_bt_ptr, hot_bt_ptr,
                    keys_ptr, lru_ptr, out_ptr, cnt_ptr,
                    m_ptr, ep_ptr, v_ptr, mp_ptr, nl_ptr, bo_ptr, bp_ptr, pv_ptr,
                    band_ptr, flags_ptr, plan_ptr, cr_ptr, cc_ptr,
                    T, P, HB, G_MAX, M_W,
                    stride_topk, stride_res, stride_host, stride_hot, stride_keys, stride_lru,
                    stride_out, stride_m, stride_scr,
                    stride_band, stride_flags, plan_half, PLAN_W, stride_cr, copy_half, stride_cc,
                    K: tl.constexpr, H: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HB: tl.constexpr,
                    COUNT_BAD: tl.constexpr,
                    NB: tl.constexpr, BLOCK_B: tl.constexpr, SCORE: tl.constexpr,
                    PF: tl.constexpr, FLAGS: tl.constexpr, COUNT_PF: tl.constexpr,
                    PROTECT: tl.constexpr, COUNT_CAP: tl.constexpr, PLAN: tl.constexpr,
                    BLOCK_P: tl.constexpr, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr,
                    COPY_PF: tl.constexpr, SHIFT: tl.constexpr, BIAS: tl.constexpr,
                    EPOCH_MAX: tl.constexpr, BLOCK_W: tl.constexpr):
    # Loop bounds are constexpr (K, H) or ``while`` conditions: the Triton interpreter (3.6)
    # cannot use a tensor-valued ``range`` bound.
    t = tl.program_id(0)
    r = tl.load(req_ptr + t)
    prev = tl.load(req_ptr + tl.maximum(t - 1, 0))
    prev = tl.where(t > 0, prev, -1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_h = tl.arange(0, BLOCK_H)
    # group ordinal = number of group leaders before t (only leaders use it)
    g = t * 0
    if (r >= 0) & (prev != r):
        b0 = t * 0
        while b0 < t:
            offs = b0 + offs_k
            m = offs < t
            cur = tl.load(req_ptr + offs, mask=m, other=-1)
            prv = tl.load(req_ptr + offs - 1, mask=m & (offs > 0), other=-1)
            g += tl.sum((m & (cur >= 0) & (cur != prv)).to(tl.int32))
            b0 += BLOCK_K
    if r < 0:
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            tl.store(out_ptr + t.to(tl.int64) * stride_out + kk,
                     tl.full([BLOCK_K], -1, tl.int32), mask=kk < K)
    elif (prev != r) & (g < G_MAX):
        r64 = r.to(tl.int64)
        m_row = m_ptr + g.to(tl.int64) * stride_m
        v_row = v_ptr + g.to(tl.int64) * stride_scr
        mp_row = mp_ptr + g.to(tl.int64) * stride_scr
        nl_row = nl_ptr + g.to(tl.int64) * stride_scr
        bo_row = bo_ptr + g.to(tl.int64) * stride_scr
        bp_row = bp_ptr + g.to(tl.int64) * stride_scr
        pv_row = pv_ptr + g.to(tl.int64) * stride_scr
        flags_row = flags_ptr + r64 * stride_flags
        res_row = res_bt_ptr + r64 * stride_res
        host_row = host_bt_ptr + r64 * stride_host
        hot_row = hot_bt_ptr + r64 * stride_hot
        keys_row = keys_ptr + r64 * stride_keys
        lru_row = lru_ptr + r64 * stride_lru
        s_max = P * PAGE

        # ---- group length: tokens t .. t + n - 1
        n = 0
        done = 0
        while done == 0:
            offs = t + n + offs_k
            v = tl.load(req_ptr + offs, mask=offs < T, other=-2)
            first = tl.min(tl.where(v != r, offs_k, BLOCK_K))
            n += first
            done = (first < BLOCK_K).to(tl.int32)

        # usable hot slots, from the hot block table (one load: slots j < H of blocks >= 0)
        offs_hb = tl.arange(0, BLOCK_HB)
        hbm = (offs_hb * PAGE < H) & (offs_hb < HB)
        hblk = tl.load(hot_row + offs_hb, mask=hbm, other=-1)
        n_usable = tl.sum(tl.where(hbm & (hblk >= 0), tl.minimum(H - offs_hb * PAGE, PAGE), 0))
        if n_usable == 0:
            # no hot lookup can hit or load (a request not in host-read mode): resident rows,
            # else -1; keys, LRU, flags, the position map and the copy list stay as they are
            tt = t
            while tt < t + n:
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + offs_k
                    km = kk < K
                    pos = tl.load(topk_ptr + tt * stride_topk + kk, mask=km, other=-1)
                    page = pos // PAGE
                    valid = km & (pos >= 0) & (page < P)
                    res = tl.load(res_row + page, mask=valid, other=-1)
                    row = tl.where(valid & (res >= 0), res * PAGE + pos % PAGE, -1)
                    tl.store(out_ptr + tt * stride_out + kk, row, mask=km)
                tt += 1
            if PLAN:       # the group's prefetch plan row is written whole: all -1
                offs_p = tl.arange(0, BLOCK_P)
                prow = plan_ptr + g.to(tl.int64) * PLAN_W + offs_p
                none = tl.full([BLOCK_P], -1, tl.int64)
                tl.store(prow, none, mask=offs_p < PLAN_W)
                tl.store(prow + plan_half, none, mask=offs_p < PLAN_W)
            if COUNT_BAD:
                n_bad = 0
                for h0 in range(0, H, BLOCK_H):
                    i = h0 + offs_h
                    im = i < H
                    s = tl.load(lru_row + i, mask=im, other=0)
                    n_bad += tl.sum((im & ((s < 0) | (s >= H))).to(tl.int32))
                tl.atomic_add(cnt_ptr + 2, n_bad.to(tl.int64))
        else:
            # ---- epoch: this call's tag for row g of the map (a wrapped epoch clears the row)
            ep = tl.load(ep_ptr + g) + 1
            if (ep > EPOCH_MAX) | (ep < 1):      # wrapped (or a corrupt epoch)
                c0 = ep * 0
                while c0 < M_W:
                    offs = c0 + offs_k
                    tl.store(m_row + offs, tl.zeros([BLOCK_K], tl.int32), mask=offs < M_W)
                    c0 += BLOCK_K
                tl.debug_barrier()
                ep = ep * 0 + 1
            tl.store(ep_ptr + g, ep)

            # ---- A: map usable slots' keys (a slot's key is read whatever its block: the
            # loads run side by side, not one after the other)
            for h0 in range(0, H, BLOCK_W):
                j = h0 + tl.arange(0, BLOCK_W)
                jm = j < H
                blk = tl.load(hot_row + j // PAGE, mask=jm & ((j // PAGE) < HB), other=-1)
                key = tl.load(keys_row + j, mask=jm, other=-1)
                ok = jm & (blk >= 0) & (key >= 0) & (key < s_max)
                _map_put(m_row + key, j, ok, ep, SHIFT, BIAS)
            tl.debug_barrier()

            # ---- B: lookups in first-reference order
            n_hit = 0
            n_miss = 0
            tt = t
            while tt < t + n:
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + offs_k
                    km = kk < K
                    pos = tl.load(topk_ptr + tt * stride_topk + kk, mask=km, other=-1)
                    page = pos // PAGE
                    valid = km & (pos >= 0) & (page < P)
                    res = tl.load(res_row + page, mask=valid, other=-1)
                    resident = valid & (res >= 0)
                    row = tl.where(resident, res * PAGE + pos % PAGE, -1)
                    tl.store(out_ptr + tt * stride_out + kk, row, mask=km)
                    nonres = valid & (res < 0)
                    mval = _map_get(m_row + pos, valid, ep, SHIFT, BIAS)
                    hit_first = nonres & (mval >= 0) & (mval < H)
                    _map_put(m_row + pos, mval + H, hit_first, ep, SHIFT, BIAS)
                    n_hit += tl.sum(hit_first.to(tl.int32))
                    hb = tl.load(host_row + page, mask=valid, other=-1)
                    miss_first = nonres & (mval == -1) & (hb >= 0) & ((hb * 0 + n_usable) > 0)
                    mi = miss_first.to(tl.int32)
                    ordl = n_miss + tl.cumsum(mi, 0) - 1
                    # ordinals past H are never loaded (n_load <= H): stored as H
                    _map_put(m_row + pos, -2 - tl.minimum(ordl, H), miss_first, ep, SHIFT, BIAS)
                    tl.store(mp_row + ordl, pos, mask=miss_first & (ordl < H))
                    n_miss += tl.sum(mi)
                    tl.debug_barrier()
                tt += 1

            # ---- B2: the next-ranked band: hot rows of it (band-held, M = 2H + slot, ordinal in
            # bo[slot]) and band misses (M = 3H + ordinal, positions in bp[ordinal])
            n_bh = n_hit * 0
            n_bm = n_hit * 0
            if NB > 0:
                offs_b = tl.arange(0, BLOCK_B)
                tt = t
                while tt < t + n:
                    for b0 in range(0, NB, BLOCK_B):
                        bb = b0 + offs_b
                        bm = bb < NB
                        pos = tl.load(band_ptr + tt * stride_band + bb, mask=bm, other=-1)
                        page = pos // PAGE
                        valid = bm & (pos >= 0) & (page < P)
                        res = tl.load(res_row + page, mask=valid, other=-1)
                        nonres = valid & (res < 0)
                        mval = _map_get(m_row + pos, valid, ep, SHIFT, BIAS)
                        held = nonres & (mval >= 0) & (mval < H)
                        hi = held.to(tl.int32)
                        bord = n_bh + tl.cumsum(hi, 0) - 1
                        _map_put(m_row + pos, 2 * H + mval, held, ep, SHIFT, BIAS)
                        tl.store(bo_row + mval, bord, mask=held)
                        n_bh += tl.sum(hi)
                        hb = tl.load(host_row + page, mask=valid, other=-1)
                        bmiss = nonres & (mval == -1) & (hb >= 0) & ((hb * 0 + n_usable) > 0)
                        mi = bmiss.to(tl.int32)
                        mord = n_bm + tl.cumsum(mi, 0) - 1
                        # only "a band miss" is read back from the map: ordinals capped below 4H
                        _map_put(m_row + pos, 3 * H + tl.minimum(mord, H - 1), bmiss, ep, SHIFT,
                                 BIAS)
                        tl.store(bp_row + mord, pos, mask=bmiss & (mord < H))
                        n_bm += tl.sum(mi)
                        tl.debug_barrier()
                    tt += 1

            if (n_hit + n_miss + n_bh + n_bm) == 0:
                # no hot lookup hit or missed and no band row is hot or servable: keys, LRU
                # and flags stay as they are and phase B already wrote every output (resident
                # rows, -1 for the unservable); what A mapped expires with this call's epoch
                if PLAN:       # the group's prefetch plan row is written whole: all -1
                    offs_p = tl.arange(0, BLOCK_P)
                    prow = plan_ptr + g.to(tl.int64) * PLAN_W + offs_p
                    none = tl.full([BLOCK_P], -1, tl.int64)
                    tl.store(prow, none, mask=offs_p < PLAN_W)
                    tl.store(prow + plan_half, none, mask=offs_p < PLAN_W)
                if COUNT_BAD:
                    n_bad = 0
                    for h0 in range(0, H, BLOCK_H):
                        i = h0 + offs_h
                        im = i < H
                        s = tl.load(lru_row + i, mask=im, other=0)
                        n_bad += tl.sum((im & ((s < 0) | (s >= H))).to(tl.int32))
                    tl.atomic_add(cnt_ptr + 2, n_bad.to(tl.int64))
            else:
                n_load = tl.minimum(n_miss, n_usable - n_hit)
                # ---- C0 (score or prefetch): count candidates outside the band (n_nb) and prefetch
                # targets (unreferenced, outside the band, not loaded)
                n_nb = n_hit * 0
                n_low = n_hit * 0
                n_pfc = n_hit * 0
                if SCORE or (PF > 0):
                    # one packed reduction a block (16-bit fields); the next block's LRU
                    # entries load one pass ahead
                    cand_run = n_hit * 0
                    s_next = tl.load(lru_row + offs_h, mask=offs_h < H, other=0)
                    for h0 in range(0, H, BLOCK_H):
                        i = h0 + offs_h
                        im = i < H
                        s = s_next
                        nxt = i + BLOCK_H
                        s_next = tl.load(lru_row + nxt, mask=nxt < H, other=0)
                        s_ok = im & (s >= 0) & (s < H)
                        blk = tl.load(hot_row + s // PAGE, mask=s_ok & ((s // PAGE) < HB), other=-1)
                        usable = s_ok & (blk >= 0)
                        key = tl.where(usable, tl.load(keys_row + s, mask=s_ok, other=-1), -1)
                        mk = _map_get(m_row + key, usable & (key >= 0) & (key < s_max), ep,
                                      SHIFT, BIAS)
                        keyed = usable & (key >= 0)
                        referenced = keyed & (mk >= H) & (mk < 2 * H)
                        bandheld = keyed & (mk >= 2 * H) & (mk < 3 * H)
                        cand = usable & (~referenced)
                        nb = cand & (~bandheld)
                        if FLAGS:
                            st = tl.load(flags_row + s, mask=s_ok, other=0)
                            low = nb & ((st >> 1) < PROTECT)
                        else:
                            low = nb
                        if SCORE:       # n_pfc follows from n_nb below
                            pfc = nb & (~nb)
                        else:
                            cord = cand_run + tl.cumsum(cand.to(tl.int32), 0) - 1
                            pfc = nb & (cord >= n_load)
                        counts = (low.to(tl.int64) | (nb.to(tl.int64) << 16)
                                  | (cand.to(tl.int64) << 32) | (pfc.to(tl.int64) << 48))
                        total = tl.sum(counts, 0)
                        n_low += _field(total, 0)
                        n_nb += _field(total, 16)
                        cand_run += _field(total, 32)
                        n_pfc += _field(total, 48)
                    if SCORE:
                        n_pfc = tl.maximum(n_nb - n_load, 0)
                n_pf = n_hit * 0
                if PF > 0:
                    n_pf = tl.minimum(tl.minimum(n_bm, PF), n_pfc)

                # band rows that stay hot (score policy): touched, placed worst rank first
                n_bhk = n_hit * 0
                if SCORE:
                    n_bhk = n_bh - tl.maximum(tl.minimum(n_load - n_nb, n_bh), 0)
                # ---- C: one LRU walk: victims, prefetch targets and new order. The counts
                # known before the victims share one prefix sum (16-bit fields of an int64: a
                # block counts at most BLOCK_H <= 32768 of each); the next block's LRU entries
                # are loaded while this block works
                u_total = H - n_hit - n_load - n_pf - n_bhk
                cand_run = 0
                low_run = 0
                high_run = 0
                pf_run = 0
                unt_run = 0
                hit_run = 0
                n_bad = 0
                n_used = n_hit * 0
                n_found = n_hit * 0
                s_next = tl.load(lru_row + offs_h, mask=offs_h < H, other=0)
                for h0 in range(0, H, BLOCK_H):
                    i = h0 + offs_h
                    im = i < H
                    s = s_next
                    nxt = i + BLOCK_H
                    s_next = tl.load(lru_row + nxt, mask=nxt < H, other=0)
                    # an LRU entry outside [0, H) is corrupt: never read or written through, counted
                    s_ok = im & (s >= 0) & (s < H)
                    blk = tl.load(hot_row + s // PAGE, mask=s_ok & ((s // PAGE) < HB), other=-1)
                    usable = s_ok & (blk >= 0)
                    key = tl.where(usable, tl.load(keys_row + s, mask=s_ok, other=-1), -1)
                    mk = _map_get(m_row + key, usable & (key >= 0) & (key < s_max), ep, SHIFT,
                                  BIAS)
                    keyed = usable & (key >= 0)
                    referenced = keyed & (mk >= H) & (mk < 2 * H)
                    bandheld = keyed & (mk >= 2 * H) & (mk < 3 * H)
                    cand = usable & (~referenced)
                    nb = cand & (~bandheld)
                    if FLAGS:
                        st = tl.load(flags_row + s, mask=s_ok, other=0)
                    else:
                        st = s * 0
                    low = nb & ((st >> 1) < PROTECT)
                    high = nb & (~low)
                    later = (referenced.to(tl.int64) << 32) | ((im & (~s_ok)).to(tl.int64) << 48)
                    # score: outside the band first (rarely used, then used), then band rows,
                    # worst rank first
                    if SCORE:
                        counts = low.to(tl.int64) | (high.to(tl.int64) << 16) | later
                        c1 = tl.cumsum(counts, 0)
                        bo = tl.load(bo_row + s, mask=cand & bandheld, other=0, volatile=True)
                        low_ord = low_run + _field(c1, 0) - 1
                        high_ord = n_low + high_run + _field(c1, 16) - 1
                        cord = tl.where(bandheld, n_nb + n_bh - 1 - bo,
                                        tl.where(low, low_ord, high_ord))
                    else:
                        counts = cand.to(tl.int64) | later
                        c1 = tl.cumsum(counts, 0)
                        cord = cand_run + _field(c1, 0) - 1
                    hord = hit_run + _field(c1, 32) - 1
                    total = tl.sum(counts, 0)
                    loaded = cand & (cord < n_load)
                    pfc = nb & (~loaded)
                    if PF > 0:
                        pfi = pfc.to(tl.int32)
                        pord = pf_run + tl.cumsum(pfi, 0) - 1
                        pf = pfc & (pord < n_pf)
                        pf_run += tl.sum(pfi)
                    else:
                        pord = cord * 0
                        pf = cand & (~cand)
                    if SCORE:
                        bhk = cand & bandheld & (~loaded)
                    else:
                        bhk = cand & (~cand)
                    untouched = im & (~referenced) & (~loaded) & (~pf) & (~bhk)
                    ui = untouched.to(tl.int32)
                    uord = unt_run + tl.cumsum(ui, 0) - 1
                    if SCORE:
                        kpos = u_total + n_bhk - 1 - bo
                    else:
                        kpos = uord
                    base = u_total + n_bhk
                    newpos = tl.where(untouched, uord,
                                      tl.where(bhk, kpos,
                                               tl.where(pf, base + pord,
                                                        tl.where(loaded, base + n_pf + cord,
                                                                 base + n_pf + n_load + hord))))
                    newpos = tl.minimum(tl.maximum(newpos, 0), H - 1)
                    tl.store(nl_row + newpos, s, mask=im)
                    tl.store(v_row + cord, s, mask=loaded)
                    n_found += tl.sum(loaded.to(tl.int32))
                    if PF > 0:
                        tl.store(pv_row + pord, s, mask=pf)
                    if FLAGS:
                        n_used += tl.sum((referenced & ((st & 1) != 0)).to(tl.int32))
                        newst = tl.where(pf, 1, tl.where(loaded, 2,
                                                         tl.minimum((st >> 1) + 1, COUNT_CAP) * 2))
                        tl.store(flags_row + s, newst.to(st.dtype), mask=referenced | loaded | pf)
                    if SCORE:
                        low_run += _field(total, 0)
                        high_run += _field(total, 16)
                    else:
                        cand_run += _field(total, 0)
                    hit_run += _field(total, 32)
                    n_bad += _field(total, 48)
                    unt_run += tl.sum(ui)
                tl.debug_barrier()
                # corrupt LRU entries can hide candidates: a walk that listed fewer victims than
                # n_load loads nothing and keeps the old order (no victim from stale scratch)
                intact = n_found == n_load
                n_load = tl.where(intact, n_load, 0)

                # ---- D1: new keys of the loaded (and prefetched) slots; the (host row, arena row)
                # pairs to copy go to the group's copy list for the gather kernel: demand misses
                # first, then the prefetched band rows unless they go to the plan
                cr_row = cr_ptr + g.to(tl.int64) * stride_cr
                n_copy = n_load
                if COPY_PF:
                    n_copy = n_load + n_pf
                o0 = n_load * 0
                while o0 < tl.maximum(n_load, n_pf):
                    o = o0 + offs_h
                    om = o < n_load
                    s = tl.load(v_row + o, mask=om, other=0, volatile=True)
                    p = tl.load(mp_row + o, mask=om, other=-1, volatile=True)
                    ok = om & (s >= 0) & (s < H)
                    tl.store(keys_row + s, p, mask=ok)
                    ok = ok & (p >= 0)
                    hb = tl.load(host_row + p // PAGE, mask=ok, other=0)
                    ab = tl.load(hot_row + s // PAGE, mask=ok, other=0)
                    tl.store(cr_row + o, tl.where(ok, hb.to(tl.int64) * PAGE + p % PAGE, -1),
                             mask=om)
                    tl.store(cr_row + copy_half + o,
                             tl.where(ok, ab.to(tl.int64) * PAGE + s % PAGE, -1), mask=om)
                    if PF > 0:
                        pm = o < n_pf
                        s = tl.load(pv_row + o, mask=pm, other=0, volatile=True)
                        p = tl.load(bp_row + o, mask=pm, other=-1, volatile=True)
                        ok = pm & (s >= 0) & (s < H)
                        tl.store(keys_row + s, p, mask=ok)
                        if COPY_PF:
                            ok = ok & (p >= 0)
                            hb = tl.load(host_row + p // PAGE, mask=ok, other=0)
                            ab = tl.load(hot_row + s // PAGE, mask=ok, other=0)
                            e = n_load + o
                            em = pm & (e < H)
                            tl.store(cr_row + e,
                                     tl.where(ok, hb.to(tl.int64) * PAGE + p % PAGE, -1), mask=em)
                            tl.store(cr_row + copy_half + e,
                                     tl.where(ok, ab.to(tl.int64) * PAGE + s % PAGE, -1), mask=em)
                    o0 += BLOCK_H
                offs_sp = tl.arange(0, BLOCK_S)
                tl.store(cc_ptr + g.to(tl.int64) * stride_cc + offs_sp,
                         tl.zeros([BLOCK_S], tl.int32) + n_copy, mask=offs_sp < SPLIT)
                if PLAN:       # the group's plan row g is written whole: its targets, then -1
                    # (own names: Triton types a name once per scope; the loop above uses s/p/...)
                    offs_p = tl.arange(0, BLOCK_P)
                    pw = offs_p < PLAN_W
                    pf_ok = offs_p < n_pf
                    pf_slot = tl.load(pv_row + offs_p, mask=pf_ok, other=0, volatile=True)
                    pf_pos = tl.load(bp_row + offs_p, mask=pf_ok, other=0, volatile=True)
                    pf_ok = pf_ok & (pf_slot >= 0) & (pf_slot < H) & (pf_pos >= 0)
                    pf_host_blk = tl.load(host_row + pf_pos // PAGE, mask=pf_ok, other=0)
                    pf_hot_blk = tl.load(hot_row + pf_slot // PAGE, mask=pf_ok, other=0)
                    src_r = tl.where(pf_ok, pf_host_blk.to(tl.int64) * PAGE + pf_pos % PAGE, -1)
                    dst_r = tl.where(pf_ok, pf_hot_blk.to(tl.int64) * PAGE + pf_slot % PAGE, -1)
                    prow = plan_ptr + g.to(tl.int64) * PLAN_W + offs_p
                    tl.store(prow, src_r, mask=pw)
                    tl.store(prow + plan_half, dst_r, mask=pw)
                tl.debug_barrier()

                # ---- D3: outputs of hot lookups
                tt = t
                while tt < t + n:
                    for k0 in range(0, K, BLOCK_K):
                        kk = k0 + offs_k
                        km = kk < K
                        pos = tl.load(topk_ptr + tt * stride_topk + kk, mask=km, other=-1)
                        page = pos // PAGE
                        valid = km & (pos >= 0) & (page < P)
                        res = tl.load(res_row + page, mask=valid, other=-1)
                        nonres = valid & (res < 0)
                        mval = _map_get(m_row + pos, valid, ep, SHIFT, BIAS)
                        is_hit = nonres & (mval >= H) & (mval < 2 * H)
                        mord = -2 - mval
                        is_miss = nonres & (mval <= -2) & (mord < n_load)
                        slot_m = tl.load(v_row + mord, mask=is_miss, other=0, volatile=True)
                        slot = tl.where(is_hit, mval - H, slot_m)
                        served = is_hit | is_miss
                        ab = tl.load(hot_row + slot // PAGE, mask=served, other=-1)
                        row = tl.where(served, ab * PAGE + slot % PAGE, -1)
                        tl.store(out_ptr + tt * stride_out + kk, row, mask=nonres)
                    tt += 1
                tl.debug_barrier()

                # ---- E: commit the new LRU order (the map needs no reset: the next call's
                # epoch expires every entry of this one)
                if intact:
                    for h0 in range(0, H, BLOCK_W):
                        i = h0 + tl.arange(0, BLOCK_W)
                        im = i < H
                        s = tl.load(nl_row + i, mask=im, other=0, volatile=True)
                        tl.store(lru_row + i, s, mask=im)
                tl.atomic_add(cnt_ptr, n_hit.to(tl.int64))
                tl.atomic_add(cnt_ptr + 1, n_miss.to(tl.int64))
                if COUNT_BAD:
                    tl.atomic_add(cnt_ptr + 2, n_bad.to(tl.int64))
                if COUNT_PF:
                    tl.atomic_add(cnt_ptr + 3, n_pf.to(tl.int64))
                    tl.atomic_add(cnt_ptr + 4, n_used.to(tl.int64))


@triton.jit
def _resolve_gather_kernel(cr_ptr, cc_ptr, arena_ptr, host_ptr, stride_cr, copy_half, stride_cc,
                           arena_row_w, host_row_w, SPLIT: tl.constexpr, CHUNKS: tl.constexpr,
                           VEC: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program ``(g, s)``: reads and zeroes ``copy_count[g, s]`` (= the length ``n`` of group
    ``g``'s copy list, written by the resolver), then copies entries ``[s * c, min((s + 1) * c,
    n))``, ``c = ceil(n / SPLIT)``, host row -> arena row (``-1`` skip) in flat 16-byte chunks.
    Only this program touches its cell, so the counts are all 0 again after the launch."""
    g = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    cell = cc_ptr + g * stride_cc + sp
    n = tl.load(cell)
    tl.store(cell, n * 0)
    per = (n + SPLIT - 1) // SPLIT
    lo = sp * per
    total = tl.maximum(tl.minimum(lo + per, n) - lo, 0) * CHUNKS
    src_list = cr_ptr + g * stride_cr
    offs_c = tl.arange(0, BLOCK_C)
    offs_v = tl.arange(0, VEC)
    c0 = total * 0
    while c0 < total:
        c = c0 + offs_c
        cm = c < total
        e = lo + c // CHUNKS
        w = c % CHUNKS
        src_row = tl.load(src_list + e, mask=cm, other=-1)
        dst_row = tl.load(src_list + copy_half + e, mask=cm, other=-1)
        cm = cm & (src_row >= 0) & (dst_row >= 0)
        src = tl.multiple_of(src_row * host_row_w + w * VEC, VEC)
        dst = tl.multiple_of(dst_row * arena_row_w + w * VEC, VEC)
        val = tl.load(host_ptr + src[:, None] + offs_v[None, :], mask=cm[:, None])
        tl.store(arena_ptr + dst[:, None] + offs_v[None, :], val, mask=cm[:, None])
        c0 += BLOCK_C


@triton.jit
def _plan_copy_kernel(plan_ptr, arena_ptr, host_ptr, n_entries, plan_half, arena_row_w,
                      host_row_w, CHUNKS: tl.constexpr, VEC: tl.constexpr,
                      BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    """Copies host row ``plan[0, e]`` to arena row ``plan[1, e]`` for every entry ``>= 0`` of
    this program's ``BLOCK_E`` entries (flat 16-byte chunks), then resets them to ``-1``: every
    chunk of an entry is moved by this program, so after the CTA barrier no lane still needs
    the entry (the plan is consumed race-free)."""
    e0 = tl.program_id(0).to(tl.int64) * BLOCK_E
    offs_c = tl.arange(0, BLOCK_C)
    offs_v = tl.arange(0, VEC)
    for c0 in range(0, BLOCK_E * CHUNKS, BLOCK_C):
        c = c0 + offs_c
        e = e0 + c // CHUNKS
        w = c % CHUNKS
        cm = (c < BLOCK_E * CHUNKS) & (e < n_entries)
        src_row = tl.load(plan_ptr + e, mask=cm, other=-1)
        dst_row = tl.load(plan_ptr + plan_half + e, mask=cm, other=-1)
        cm = cm & (src_row >= 0) & (dst_row >= 0)
        src = tl.multiple_of(src_row * host_row_w + w * VEC, VEC)
        dst = tl.multiple_of(dst_row * arena_row_w + w * VEC, VEC)
        val = tl.load(host_ptr + src[:, None] + offs_v[None, :], mask=cm[:, None])
        tl.store(arena_ptr + dst[:, None] + offs_v[None, :], val, mask=cm[:, None])
    tl.debug_barrier()
    offs_e = e0 + tl.arange(0, BLOCK_E)
    em = offs_e < n_entries
    tl.store(plan_ptr + offs_e, tl.full([BLOCK_E], -1, tl.int64), mask=em)
    tl.store(plan_ptr + plan_half + offs_e, tl.full([BLOCK_E], -1, tl.int64), mask=em)


def _vec(arena_w, host_w, arena_rw, host_rw, words):
    return 4 if (words % 4 == 0 and arena_rw % 4 == 0 and host_rw % 4 == 0
                 and arena_w.data_ptr() % 16 == 0 and host_w.data_ptr() % 16 == 0) else 1


PLAN_COPY_ENTRIES = 16   # plan entries per program of the prefetch copy


def prefetch_copy_triton(plan, arena, host):
    """Executes and consumes a prefetch plan ``[2, G, PF]`` int64 (host rows, arena rows;
    ``-1`` skip): one launch, the plan is all ``-1`` afterwards."""
    if plan.numel() == 0:
        return
    if plan.dtype != torch.int64 or not plan.is_contiguous() or plan.shape[0] != 2:
        raise ValueError(f"prefetch_copy: plan must be contiguous int64 [2, G, PF], got "
                         f"{tuple(plan.shape)} {plan.dtype}")
    if arena.shape[-1] * arena.element_size() != host.shape[-1] * host.element_size():
        raise ValueError("prefetch_copy: arena and host rows must have the same byte size")
    if arena.is_cuda and not host.is_cuda and not host.is_pinned():
        raise ValueError("prefetch_copy: on CUDA the host tensor must be pinned (zero-copy)")
    arena_w, arena_rw = _words(arena)
    host_w, host_rw = _words(host)
    words = arena.shape[-1] * arena.element_size() // 4
    vec = _vec(arena_w, host_w, arena_rw, host_rw, words)
    chunks = words // vec
    n = plan[0].numel()
    block_e = PLAN_COPY_ENTRIES
    block_c = min(1024, max(128, next_pow2(block_e * chunks)))
    grid = (triton.cdiv(n, block_e),)
    _plan_copy_kernel[grid](plan, arena_w, host_w, n, n, arena_rw, host_rw,
                            CHUNKS=chunks, VEC=vec, BLOCK_C=block_c, BLOCK_E=block_e,
                            num_warps=4)


def _words(t: torch.Tensor):
    row_bytes = t.shape[-1] * t.element_size()
    if row_bytes % 4 != 0:
        raise ValueError("resolve_rows: row bytes must be a multiple of 4")
    w = t.view(torch.int32)
    return w, w.stride(0)


def resolve_rows_triton(topk, token_req, resident_block_table, host_block_table, hot_block_table,
                        hot_keys, hot_lru, arena, host, block_size, counters, workspace,
                        block_k=None, out=None, band=None, policy="lru", prefetch=0,
                        hot_flags=None, prefetch_plan=None, split=MISS_COPY_SPLIT, block_h=None,
                        num_warps=8):
    """``workspace``: a :class:`~hisparse.ops.resolve.ResolveWorkspace` large enough for this
    call (checked; never grown: a captured graph keeps the addresses it saw). Speed knobs for
    benchmarks (results do not depend on them): ``split``, gather programs per request group, a
    power of two in ``[1, MISS_COPY_SPLIT]``; ``block_h``, slots per pass of the resolver's
    walks over the hot buffer (a power of two in [32, 32768]; default ``min(1024, H)`` rounded
    up); ``block_k``, entries per pass of the walks over the selections (default ``min(2048,
    K)`` rounded up);
    ``num_warps`` of the resolver."""
    T, K = topk.shape
    R, P = resident_block_table.shape
    HB = hot_block_table.shape[1]
    H = hot_keys.shape[1]
    dev = arena.device
    if out is None:
        out = torch.empty((T, K), dtype=torch.int32, device=dev)
    if T == 0:
        return out
    if arena.shape[-1] * arena.element_size() != host.shape[-1] * host.element_size():
        raise ValueError("resolve_rows: arena and host rows must have the same byte size")
    if arena.is_cuda and not host.is_cuda and not host.is_pinned():
        raise ValueError("resolve_rows: on CUDA the host tensor must be pinned (zero-copy reads)")
    for name, x in (("topk", topk), ("hot_keys", hot_keys), ("hot_lru", hot_lru),
                    ("band", band), ("hot_flags", hot_flags)):
        if x is None:
            continue
        if x.stride(-1) != 1:
            raise ValueError(f"resolve_rows: {name} must have a contiguous last dimension")
    if host_block_table.shape[0] < R or host_block_table.shape[1] < P:
        raise ValueError(f"resolve_rows: host_block_table {tuple(host_block_table.shape)} must "
                         f"cover the resident block table's {R} requests x {P} pages")
    arena_w, arena_rw = _words(arena)
    host_w, host_rw = _words(host)
    words = arena.shape[-1] * arena.element_size() // 4
    vec = _vec(arena_w, host_w, arena_rw, host_rw, words)
    chunks = words // vec
    groups = min(T, R)
    workspace.check(groups, P * block_size, H, dev)
    if split not in [1 << i for i in range(MISS_COPY_SPLIT.bit_length())
                     if 1 << i <= MISS_COPY_SPLIT]:
        raise ValueError(f"resolve_rows: split must be a power of two in [1, "
                         f"{MISS_COPY_SPLIT}], got {split!r}")
    m, ep, scr = workspace.position_map, workspace.map_epoch, workspace.scratch
    cr, cc = workspace.copy_rows, workspace.copy_count
    g_max = m.shape[0]
    if block_k is None:
        block_k = min(2048, max(32, next_pow2(K)))
    if block_h is None:
        block_h = min(1024, max(32, next_pow2(H)))
    elif block_h < 32 or block_h > 32768 or block_h & (block_h - 1):
        # phase C counts a block in 16-bit fields
        raise ValueError(f"resolve_rows: block_h must be a power of two in [32, 32768], "
                         f"got {block_h}")
    nb = 0 if band is None else band.shape[1]
    if band is not None and band.shape[0] != T:
        raise ValueError(f"resolve_rows: band must be [T={T}, P], got {tuple(band.shape)}")
    plan_w = int(prefetch)
    prefetch = min(int(prefetch), H) if nb else 0
    check_prefetch_plan(prefetch_plan, plan_w, T, R)
    plan = prefetch_plan is not None and prefetch > 0
    _resolve_kernel[(T,)](
        topk, token_req, resident_block_table, host_block_table, hot_block_table,
        hot_keys, hot_lru, out, counters, m, ep, scr[0], scr[1], scr[2],
        scr[3], scr[4], scr[5], band if band is not None else topk,
        hot_flags if hot_flags is not None else hot_keys,
        prefetch_plan if prefetch_plan is not None else counters, cr, cc,
        T, P, HB, g_max, m.shape[1],
        topk.stride(0), resident_block_table.stride(0), host_block_table.stride(0),
        hot_block_table.stride(0), hot_keys.stride(0), hot_lru.stride(0), out.stride(0),
        m.stride(0), scr.stride(1),
        band.stride(0) if band is not None else 0,
        hot_flags.stride(0) if hot_flags is not None else 0,
        prefetch_plan[0].numel() if prefetch_plan is not None else 0, plan_w,
        cr.stride(1), cr.stride(0), cc.stride(0),
        K=K, H=H, PAGE=block_size, BLOCK_K=block_k, BLOCK_H=block_h,
        BLOCK_HB=max(2, next_pow2(triton.cdiv(H, block_size))),
        COUNT_BAD=counters.numel() >= 3, NB=nb,
        BLOCK_B=min(2048, max(32, next_pow2(max(nb, 1)))), SCORE=(policy == "score" and nb > 0),
        PF=prefetch, FLAGS=hot_flags is not None, COUNT_PF=counters.numel() >= 5,
        PROTECT=PROTECT_USES, COUNT_CAP=USE_COUNT_CAP, PLAN=plan,
        BLOCK_P=max(2, next_pow2(max(plan_w, 1))), SPLIT=split, BLOCK_S=max(2, split),
        COPY_PF=prefetch > 0 and not plan, SHIFT=position_map_shift(workspace.hot_buffer_size),
        BIAS=H + 2, EPOCH_MAX=position_map_max_epoch(workspace.hot_buffer_size),
        BLOCK_W=min(4096, max(32, next_pow2(H))), num_warps=num_warps,
    )
    _resolve_gather_kernel[(groups, split)](
        cr, cc, arena_w, host_w, cr.stride(1), cr.stride(0), cc.stride(0), arena_rw, host_rw,
        SPLIT=split, CHUNKS=chunks, VEC=vec, BLOCK_C=512, num_warps=4,
    )
    return out
