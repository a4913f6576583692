"""Locality part of the decode benchmark: top-k sources and the hot-buffer models (fast, CPU)."""

import itertools

import numpy as np
import pytest

from hisparse.bench.locality import (
    LruHotBuffer,
    ReferenceHotBuffer,
    SyntheticTopk,
    TopkSource,
    TraceTopk,
    belady_misses,
    replay_hit_rate,
    replay_hit_rates,
)


def _check_selection(sel, context_len, k):
    assert sel.dtype == np.int64
    assert len(sel) == min(k, context_len)
    assert len(np.unique(sel)) == len(sel)
    assert sel.min() >= 0 and sel.max() < context_len


# ---------------------------------------------------------------- synthetic source

@pytest.mark.parametrize("overlap", [0.6, 0.8, 0.95])
def test_synthetic_overlap_unique_in_range(overlap):
    k, c0, steps = 256, 4096, 40
    src = SyntheticTopk(overlap, num_layers=2, seed=3)
    assert isinstance(src, TopkSource)
    prev = None
    for t in range(steps):
        sel = src.select(1, 0, t, c0 + t, k)
        _check_selection(sel, c0 + t, k)
        assert c0 + t - 1 in sel                                  # newest token always in
        if prev is not None:
            measured = len(np.intersect1d(prev, sel)) / k
            assert abs(measured - overlap) <= 1 / k
        prev = sel
    r = replay_hit_rate(src, 1, 1, steps, c0, k, hot_size=k, belady=False)
    assert abs(r["overlap"] - overlap) <= 1 / k
    # with H = k every miss evicts exactly the rows that left: LRU hit rate == overlap
    assert r["hit_rate"] == pytest.approx(r["overlap"])


def test_synthetic_recent_bias():
    k, c = 256, 16384
    src = SyntheticTopk(0.8, 1, seed=0, return_frac=0.0, recent_frac=0.5)
    sels = [src.select(0, 0, t, c + t, k) for t in range(30)]
    fresh = np.concatenate([np.setdiff1d(b, a) for a, b in zip(sels, sels[1:])])
    recent = np.mean(fresh >= c - 4 * k)                          # last 1/16 of the context
    assert 0.4 < recent < 0.8                                     # ~0.5 recent + 1/16 of uniform


def test_synthetic_churn_returns_recently_left_rows():
    k, c = 256, 16384
    src = SyntheticTopk(0.8, 1, seed=0, return_frac=0.5, recent_frac=0.0, return_window=8)
    sels = [src.select(0, 0, t, c + t, k) for t in range(40)]
    back = total = 0
    for t in range(9, 40):
        entered = np.setdiff1d(sels[t], sels[t - 1])
        left = np.concatenate([np.setdiff1d(sels[u - 1], sels[u]) for u in range(t - 8, t)])
        back += np.isin(entered, left).sum()
        total += len(entered)
    assert 0.35 < back / total < 0.6                              # ~0.5, minus the newest token


def test_synthetic_deterministic_any_order():
    k, c0 = 128, 2048
    a = SyntheticTopk(0.8, num_layers=4, seed=7)
    b = SyntheticTopk(0.8, num_layers=4, seed=7)
    seq = [a.select(2, 5, t, c0 + t, k) for t in range(12)]
    assert np.array_equal(b.select(2, 5, 9, c0 + 9, k), seq[9])      # random access
    assert np.array_equal(b.select(2, 5, 3, c0 + 3, k), seq[3])      # going back replays
    assert np.array_equal(b.select(2, 5, 4, c0 + 4, k), seq[4])
    assert not np.array_equal(SyntheticTopk(0.8, 4, seed=8).select(2, 5, 3, c0 + 3, k), seq[3])
    assert not np.array_equal(a.select(1, 5, 3, c0 + 3, k), seq[3])  # layers differ
    assert not np.array_equal(a.select(2, 4, 3, c0 + 3, k), seq[3])  # streams differ


def test_synthetic_short_context_selects_all():
    src = SyntheticTopk(0.9, 1, seed=0)
    k = 64
    for t in range(80):                                           # crosses context_len == k
        c = 40 + t
        sel = src.select(0, 0, t, c, k)
        _check_selection(sel, c, k)
        if c <= k:
            assert np.array_equal(np.sort(sel), np.arange(c))


# ---------------------------------------------------------------- hot-buffer models

def test_lru_equals_resolve_rows_reference_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(40):
        H = int(rng.integers(1, 40))
        k = int(rng.integers(1, H + 1))
        max_pos = int(rng.integers(k, 100))
        fast, ref = LruHotBuffer(H, max_pos=4), ReferenceHotBuffer(H, max_pos)
        for _ in range(10):
            # mostly re-selections of recent keys, some new positions
            n = int(rng.integers(0, k + 1))
            sel = rng.choice(max_pos, size=min(n, max_pos), replace=False)
            assert fast.access(sel) == ref.access(sel)
            assert np.array_equal(fast.keys, ref.keys)
            assert np.array_equal(fast.lru_order(), ref.lru_order())


def test_replay_engines_agree():
    src = SyntheticTopk(0.7, 2, seed=1)
    kw = dict(num_layers=2, num_streams=2, steps=8, context_len=60, k=16, hot_sizes=[16, 24])
    fast = replay_hit_rates(src, **kw, engine="numpy")
    ref = replay_hit_rates(src, **kw, engine="reference")
    assert fast == ref


def _brute_force_min_misses(sels, H):
    """Exhaustive minimum misses over all eviction choices (tiny cases only)."""
    best = [None]

    def go(t, cache, misses):
        if best[0] is not None and misses >= best[0]:
            return
        if t == len(sels):
            best[0] = misses
            return
        need = set(sels[t])
        miss = need - cache
        free = H - len(cache)
        evictable = sorted(cache - need)
        n_evict = max(0, len(miss) - free)
        for ev in itertools.combinations(evictable, n_evict):
            go(t + 1, (cache - set(ev)) | miss, misses + len(miss))

    go(0, frozenset(), 0)
    return best[0]


def test_belady_is_optimal_and_beats_lru():
    rng = np.random.default_rng(1)
    for _ in range(25):
        H = int(rng.integers(2, 5))
        k = int(rng.integers(1, H + 1))
        sels = [rng.choice(7, size=k, replace=False) for _ in range(7)]
        bel = int(belady_misses(sels, H).sum())
        assert bel == _brute_force_min_misses(sels, H)
        lru = LruHotBuffer(H, 8)
        assert bel <= sum(lru.access(s)[1] for s in sels)


# ---------------------------------------------------------------- trace source

@pytest.fixture
def tiny_trace(tmp_path):
    rng = np.random.default_rng(2)
    docs, layers, steps, kt, ctx0 = 2, 3, 6, 4, 40
    ctx = np.broadcast_to(ctx0 + np.arange(steps), (docs, steps)).astype(np.int32)
    pos = np.zeros((docs, layers, steps, kt), dtype=np.int32)
    for d, l, t in itertools.product(range(docs), range(layers), range(steps)):
        pos[d, l, t] = rng.choice(ctx[d, t], size=kt, replace=False)
    path = tmp_path / "trace.npz"
    np.savez(path, positions=pos, context_lens=ctx, k=np.int32(kt))
    return path, pos, ctx


def test_trace_maps_into_range(tiny_trace):
    path, pos, ctx = tiny_trace
    tr = TraceTopk(str(path))
    assert (tr.docs, tr.num_layers, tr.steps, tr.k) == pos.shape
    for k in (3, 4, 8, 10):
        c0 = tr.min_context(k) + 5
        for layer, stream, t in itertools.product(range(5), range(3), range(8)):
            sel = tr.select(layer, stream, t, c0 + t, k)
            _check_selection(sel, c0 + t, k)
    # k <= trace k: the trace's best positions, shifted so the newest token lines up
    sel = tr.select(1, 1, 2, 100 + 2, 3)
    assert np.array_equal(sel, pos[1, 1, 2, :3] + (100 - ctx[0, 0]))
    # identities are stable: a trace position kept from step t to t+1 stays selected
    k = 8
    c0 = tr.min_context(k)
    a, b = tr.select(0, 0, 1, c0 + 1, k), tr.select(0, 0, 2, c0 + 2, k)
    kept = sum(len(np.intersect1d(pos[d, 0, 1], pos[d, 0, 2])) for d in range(2))
    assert len(np.intersect1d(a, b)) == kept
    with pytest.raises(ValueError, match="context_len"):
        tr.select(0, 0, 0, tr.min_context(8) - 1, 8)


def test_trace_rejects_bad_files(tmp_path):
    p = tmp_path / "bad.npz"
    np.savez(p, positions=np.full((1, 1, 2, 2), 50, dtype=np.int32),
             context_lens=np.array([[10, 11]], dtype=np.int32))
    with pytest.raises(ValueError, match="out of"):
        TraceTopk(str(p))
