"""Top-k locality for the decode benchmark: where the selections come from, and how well a hot
buffer of ``H`` slots serves them.

Random-weight models select unrealistic top-k sets, so the decode benchmark replays selections
from a :class:`TopkSource` in place of the DSA indexer output:

- :class:`TraceTopk`: top-k of the true attention of a real trained model (SmolLM2-135M) on real
  text, recorded by ``benchmarks/record_trace.py``;
- :class:`SyntheticTopk`: a random model with a set step-to-step overlap.

:func:`replay_hit_rate` runs a source through the resolver's hot-buffer semantics
(:func:`hisparse.ops.resolve_rows_reference` with nothing resident, one decode token per request
per step) and reports LRU hit rates per layer, misses per step, consecutive-step overlap, and the
offline optimum (Belady: evict the row whose next use is farthest away).

Conventions shared by every source: a *stream* is one request; decode step ``step`` of a stream
sees ``context_len`` tokens (positions ``0 .. context_len - 1``, the newest being the token being
decoded) and ``context_len`` grows by one per step. ``select`` returns ``min(k, context_len)``
unique int64 positions in ``[0, context_len)``; the order carries no meaning for the synthetic
source and is the score rank (best first) for the trace.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "TopkSource", "SyntheticTopk", "TraceTopk",
    "LruHotBuffer", "ReferenceHotBuffer", "belady_misses",
    "replay_hit_rate", "replay_hit_rates",
]

_NEVER = np.iinfo(np.int64).max


@runtime_checkable
class TopkSource(Protocol):
    """Per-(layer, stream, step) top-k selections standing in for the indexer output."""

    num_layers: int
    has_band: bool      # ``select_band`` gives the next-ranked positions (a trace's ranks k..)

    def select(self, layer: int, stream: int, step: int, context_len: int, k: int) -> np.ndarray:
        """``min(k, context_len)`` unique positions in ``[0, context_len)`` (int64),
        deterministic."""
        ...


# --------------------------------------------------------------------------------------------
# Synthetic source
# --------------------------------------------------------------------------------------------

class _Chain:
    __slots__ = ("c0", "k", "step", "sel", "rng", "left")


class SyntheticTopk:
    """Synthetic selections with a fixed step-to-step overlap.

    Model, per (layer, stream) chain, with ``n = min(k, context_len)``:

    - while ``context_len <= k`` every position is selected;
    - the first step with ``context_len > k`` draws a fresh selection (below);
    - every later step keeps ``round(overlap * n)`` positions of the previous step's selection,
      chosen uniformly at random (capped at ``n - 1``: the newest token always enters), and fills
      the rest with the newest token ``context_len - 1`` plus positions *not* in the previous
      selection, so the measured overlap ``|sel_t & sel_{t-1}| / n`` is exactly
      ``round(overlap * n) / n`` (higher only while fewer than ``n`` old positions are free,
      i.e. for ``context_len`` just above ``k``).
    - New positions (besides the newest token), each independently: with probability
      ``return_frac`` a row that left the selection within the last ``return_window`` steps
      (churn around the cut); with probability ``recent_frac`` a recent one, at distance
      ``1 + Exponential(recent_scale)`` (default scale ``k``) before the newest token; otherwise
      a uniform one over the whole context (an old row coming back after a long time). When too
      few recently-left rows are free, the shortfall is drawn like the rest.

    Calibration (rough, by hand): in the SmolLM2 trace (``benchmarks/record_trace.py``) ~63% of
    the rows entering a step's top-k had left it within the last 8 steps, ~33% lie within ``k``
    positions of the newest token, ~1.4% are the newest token. The defaults (0.5 / 0.25 / rest
    uniform) are in that range; they are free parameters, not fitted. With ``return_frac = 0``
    a bigger hot buffer barely helps (rows that leave rarely come back), so hit rates depend on
    this churn at least as much as on ``overlap``.

    Determinism: chain ``(layer, stream)`` is seeded by ``(seed, layer, stream, c0, k)`` with
    ``c0 = context_len - step``, and is advanced one step at a time; the state of the last step
    is cached, so sequential calls cost one step (~tens of us at k = 2048) and any other access
    order replays the chain from step 0 (same result, slower). Layers are statistically identical
    and independent; ``num_layers`` only satisfies the protocol.

    No next-ranked band (``has_band = False``): the model has no rank structure (which rows enter
    next is drawn at the next step, not ranked below the cut now), so the hot policies that read a
    band (``score``, ``score+prefetch``) have nothing to use with this source.
    """

    has_band = False

    def __init__(self, overlap: float, num_layers: int, seed: int = 0, return_frac: float = 0.5,
                 recent_frac: float = 0.25, return_window: int = 8,
                 recent_scale: float | None = None):
        if not 0.0 <= overlap <= 1.0:
            raise ValueError(f"SyntheticTopk: overlap must be in [0, 1], got {overlap}")
        if not (0.0 <= return_frac and 0.0 <= recent_frac and return_frac + recent_frac <= 1.0):
            raise ValueError(f"SyntheticTopk: need return_frac, recent_frac >= 0 with sum <= 1, "
                             f"got {return_frac}, {recent_frac}")
        if return_window < 1:
            raise ValueError(f"SyntheticTopk: return_window must be >= 1, got {return_window}")
        if num_layers < 1:
            raise ValueError(f"SyntheticTopk: num_layers must be >= 1, got {num_layers}")
        self.overlap = float(overlap)
        self.num_layers = int(num_layers)
        self.seed = int(seed)
        self.return_frac = float(return_frac)
        self.recent_frac = float(recent_frac)
        self.return_window = int(return_window)
        self.recent_scale = recent_scale
        self._chains: dict[tuple[int, int], _Chain] = {}
        self._owner: np.ndarray | None = None

    def select(self, layer: int, stream: int, step: int, context_len: int, k: int) -> np.ndarray:
        if step < 0 or context_len < 1 or k < 1:
            raise ValueError(f"SyntheticTopk.select: need step >= 0, context_len >= 1, k >= 1 "
                             f"(got step={step}, context_len={context_len}, k={k})")
        c0 = context_len - step
        key = (layer, stream)
        ch = self._chains.get(key)
        if ch is None or ch.c0 != c0 or ch.k != k or ch.step > step:
            ch = _Chain()
            ch.c0, ch.k, ch.step, ch.sel, ch.left = c0, k, -1, None, []
            ch.rng = np.random.default_rng(
                [self.seed & 0xFFFFFFFF, layer & 0xFFFFFFFF, stream & 0xFFFFFFFF,
                 c0 & 0xFFFFFFFF, k & 0xFFFFFFFF])
            self._chains[key] = ch
        while ch.step < step:
            ch.step += 1
            ch.sel = self._advance(ch, c0 + ch.step, k)
        return ch.sel.copy()

    def _advance(self, ch: _Chain, c: int, k: int) -> np.ndarray:
        rng, prev = ch.rng, ch.sel
        if c <= k:
            return np.arange(c, dtype=np.int64)
        n = k
        newest = c - 1
        mask = np.zeros(c, dtype=bool)
        mask[newest] = True
        if prev is None or len(prev) == 0:
            kept = np.empty(0, dtype=np.int64)
        else:
            n_keep = min(int(round(self.overlap * n)), n - 1, len(prev))
            # just above context_len == k there may be too few unselected old positions
            n_keep = min(len(prev), max(n_keep, n - 1 - (c - 1 - len(prev))))
            if n_keep >= len(prev):
                kept, left = prev, prev[:0]
            else:                                  # a uniform random n_keep-subset of prev
                order = np.argpartition(rng.random(len(prev)), n_keep)
                kept, left = prev[order[:n_keep]], prev[order[n_keep:]]
            mask[prev] = True                      # new positions avoid the whole previous set
            ch.left = (ch.left + [left])[-self.return_window:]
        m = n - 1 - len(kept)
        back = self._sample_returning(rng, ch.left, m, mask, c)
        fresh = self._sample_new(rng, c, m - len(back), mask, k)
        return np.concatenate([np.array([newest], dtype=np.int64), kept, back, fresh])

    def _sample_returning(self, rng: np.random.Generator, left: list[np.ndarray], m: int,
                          mask: np.ndarray, c: int) -> np.ndarray:
        """About ``return_frac * m`` rows that left recently and are free; marks them."""
        if m <= 0 or self.return_frac <= 0.0 or not left:
            return np.empty(0, dtype=np.int64)
        want = int(rng.binomial(m, self.return_frac))
        pool = np.concatenate(left)
        pool = pool[~mask[pool]]
        if want <= 0 or len(pool) == 0:
            return np.empty(0, dtype=np.int64)
        pool = pool[rng.integers(0, len(pool), want + want // 2 + 8)]   # with repeats
        back = self._first_unique(pool, c)[:want]
        mask[back] = True
        return back

    def _first_unique(self, values: np.ndarray, c: int) -> np.ndarray:
        """``values`` (in ``[0, c)``) de-duplicated in draw order, with no positional bias:
        one occurrence per value survives."""
        idx = np.arange(len(values))
        owner = self._scratch(c)
        owner[values] = idx
        return values[owner[values] == idx]

    def _scratch(self, c: int) -> np.ndarray:
        if self._owner is None or len(self._owner) < c:
            self._owner = np.zeros(max(2 * c, 1024), dtype=np.int64)   # headroom: c grows
        return self._owner

    def _sample_new(self, rng: np.random.Generator, c: int, m: int, mask: np.ndarray,
                    k: int) -> np.ndarray:
        """``m`` unique positions in ``[0, c - 1)`` with ``mask`` False; marks them in ``mask``."""
        out: list[np.ndarray] = []
        need = m
        scale = float(self.recent_scale) if self.recent_scale is not None else float(k)
        rest = 1.0 - self.return_frac                  # the returning share was drawn already
        p_recent = self.recent_frac / rest if rest > 0 else 1.0
        for _ in range(4):
            if need <= 0:
                break
            draw = need + need // 4 + 16
            recent = rng.random(draw) < p_recent
            dist = 1 + np.floor(rng.exponential(scale, draw)).astype(np.int64)
            uni = rng.integers(0, c - 1, draw)
            cand = np.where(recent & (dist <= c - 1), c - 1 - dist, uni)
            cand = cand[~mask[cand]]
            cand = self._first_unique(cand, c)[:need]
            mask[cand] = True
            out.append(cand)
            need -= len(cand)
        if need > 0:                               # nearly full context: uniform over the rest
            free = np.flatnonzero(~mask[:c - 1])
            cand = rng.choice(free, size=need, replace=False)
            mask[cand] = True
            out.append(cand.astype(np.int64))
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Recorded trace
# --------------------------------------------------------------------------------------------

class TraceTopk:
    """Replays a trace recorded by ``benchmarks/record_trace.py``.

    Trace file (npz): ``positions`` int32 ``[docs, layers, steps, k_t]`` (top-``k_t`` positions of
    the true attention, best first), ``context_lens`` int32 ``[docs, steps]`` (tokens seen at each
    step, the token itself included; ``context_lens[d, t] = context_lens[d, 0] + t``), plus
    metadata (see the recorder). The recorder uses ``k_t = doc_len / 32``: the same top-k
    fraction as the benchmark's 2048 / 65536.

    Mapping to a benchmark call ``select(layer, stream, step, context_len, k)`` (*tiling*):

    - ``S = ceil(k / k_t)`` tiles. Tile ``i`` replays sub-stream ``u = stream * S + i``: trace
      document ``u % docs`` at trace layer ``(layer + u // docs) % layers`` (so benchmark layer
      ``l`` mostly replays trace layer ``l % layers``, and streams beyond the recorded documents
      reuse them at a rotated layer) and trace step ``step % steps``.
    - Tile ``i`` sits at a fixed offset in the benchmark context: the last tile ends at the
      newest benchmark token (the trace's newest token maps to ``context_len - 1``) and the
      others lie below it, ``R = max(context_lens)`` positions apart, so tiles never overlap and
      each position keeps its identity from step to step. Each tile contributes its ``k_t``
      positions (the last one only its ``k - (S - 1) * k_t`` best if ``k`` is not a multiple).
    - Needs ``context_len - step >= context_lens[0, 0] + (S - 1) * R`` (about ``32 * k``: the
      trace's top-k fraction); a smaller context raises ``ValueError``
      (:meth:`min_context` gives the bound). At 65536 / 2048 with an 8192-token trace it fits.

    Caveat: the benchmark's selection is the union of ``S`` independent real selections at the
    trace's own context (e.g. 8k tokens), not one selection of a 64k-context model; hit rates
    equal the trace's (one LRU over the union is close to per-tile LRUs of ``H / S`` slots), but
    locality at 64k (and of a DSA indexer rather than of summed softmax attention) may differ.
    Steps beyond the trace wrap around (``step % steps``), which breaks continuity once.

    Next-ranked band (:meth:`select_band`, for the score policy and prefetch): a trace holding
    ``below_cut`` int32 ``[docs, layers, steps, kb]`` (the recorded ranks ``k_t .. k_t + kb - 1``,
    best first) has one (:attr:`has_band`). Tile ``i`` contributes its ranks after those it put
    in the selection: ``positions[..., n_i:]`` (a partial last tile) then ``below_cut``, shifted
    by the tile's offset. Tiles are interleaved by rank (sorted by the tile's own rank, then tile
    index), so a lower band index means a better rank and a prefix of the band takes the same
    number of rows from every tile. Entries outside their context (a recorder edge case) are
    dropped. The band and the selection of one call are disjoint.
    """

    def __init__(self, path: str):
        with np.load(path, allow_pickle=False) as z:
            self.positions = np.ascontiguousarray(z["positions"].astype(np.int64))
            self.context_lens = np.asarray(z["context_lens"], dtype=np.int64)
            below = z["below_cut"] if "below_cut" in z.files else None
            # "topk" and "scores" are the policy replay's copies (bench-policy): not loaded
            self.meta = {name: z[name] for name in z.files
                         if name not in ("positions", "context_lens", "below_cut", "topk",
                                         "scores")}
        if self.positions.ndim != 4:
            raise ValueError(f"TraceTopk: positions must be [docs, layers, steps, k], got shape "
                             f"{self.positions.shape}")
        self.docs, self.num_layers, self.steps, self.k = self.positions.shape
        if self.context_lens.shape != (self.docs, self.steps):
            raise ValueError(f"TraceTopk: context_lens must be [docs, steps] = "
                             f"{(self.docs, self.steps)}, got {self.context_lens.shape}")
        expect = self.context_lens[0, 0] + np.arange(self.steps)
        if not (self.context_lens == expect[None, :]).all():
            raise ValueError("TraceTopk: every document must start at the same context length "
                             "and grow by one token per step")
        if (self.positions.min() < 0
                or (self.positions >= self.context_lens[:, None, :, None]).any()):
            raise ValueError("TraceTopk: trace positions out of their context range")
        self.below_cut: np.ndarray | None = None
        if below is not None:
            if below.ndim != 4 or below.shape[:3] != self.positions.shape[:3]:
                raise ValueError(f"TraceTopk: below_cut must be [docs, layers, steps, kb] with "
                                 f"[docs, layers, steps] = {self.positions.shape[:3]}, got shape "
                                 f"{below.shape}")
            below = below.astype(np.int64)
            inside = (below >= 0) & (below < self.context_lens[:, None, :, None])
            self.below_cut = np.ascontiguousarray(np.where(inside, below, -1))
        self.ctx0 = int(self.context_lens[0, 0])
        self.span = int(self.context_lens.max())          # R: tile pitch

    @property
    def has_band(self) -> bool:
        """Whether the trace holds the next-ranked band (``below_cut``)."""
        return self.below_cut is not None

    def tiles(self, k: int) -> int:
        return max(1, math.ceil(k / self.k))

    def min_context(self, k: int) -> int:
        """Smallest ``context_len`` at step 0 that :meth:`select` accepts for this ``k``."""
        return self.ctx0 + (self.tiles(k) - 1) * self.span

    def _tiles(self, layer: int, stream: int, step: int, context_len: int,
               k: int) -> list[tuple[int, int, int, int]]:
        """Per tile: (trace doc, trace layer, positions it puts in the selection, offset)."""
        S = self.tiles(k)
        c0 = context_len - step
        base = c0 - self.ctx0                               # offset of the last tile
        if base - (S - 1) * self.span < 0:
            raise ValueError(
                f"TraceTopk: k={k} needs {S} tiles of {self.span} positions (trace k={self.k}); "
                f"context_len at step 0 must be >= {self.min_context(k)}, got {c0}")
        out = []
        left = k
        for i in range(S):
            u = stream * S + i
            n = min(self.k, left)
            left -= n
            out.append((u % self.docs, (layer + u // self.docs) % self.num_layers, n,
                        base - (S - 1 - i) * self.span))
        return out

    def select(self, layer: int, stream: int, step: int, context_len: int, k: int) -> np.ndarray:
        t = step % self.steps
        return np.concatenate([self.positions[d, tl, t, :n] + off
                               for d, tl, n, off in self._tiles(layer, stream, step,
                                                                context_len, k)])

    def select_band(self, layer: int, stream: int, step: int, context_len: int, k: int,
                    width: int) -> np.ndarray:
        """The next-ranked band of :meth:`select` with the same arguments: ``width`` int64
        positions, best rank first, ``-1`` padding where the trace has fewer (see the class
        doc). Raises ``ValueError`` if the trace has no ``below_cut``."""
        if self.below_cut is None:
            raise ValueError("TraceTopk: this trace has no below_cut (the ranks below the "
                             "top-k cut): no next-ranked band; re-record it with "
                             "benchmarks/record_trace.py")
        t = step % self.steps
        ranks, tiles, pos = [], [], []
        for i, (d, tl, n, off) in enumerate(self._tiles(layer, stream, step, context_len, k)):
            cand = np.concatenate([self.positions[d, tl, t, n:], self.below_cut[d, tl, t]])
            keep = cand >= 0
            ranks.append((n + np.arange(len(cand)))[keep])
            tiles.append(np.full(int(keep.sum()), i))
            pos.append(cand[keep] + off)
        ranks, tiles, pos = (np.concatenate(x) for x in (ranks, tiles, pos))
        band = pos[np.lexsort((tiles, ranks))][:width]
        return np.concatenate([band, np.full(width - len(band), -1, dtype=np.int64)])


# --------------------------------------------------------------------------------------------
# Hot-buffer models
# --------------------------------------------------------------------------------------------

class LruHotBuffer:
    """Vectorized numpy model of one (layer, request) hot buffer under ``resolve_rows`` semantics.

    Scope: nothing resident, every position host-backed, all ``hot_size`` slots usable, one token
    per call; initial keys ``-1`` and LRU order ``0 .. H-1`` (oldest first). Per call: hits = the
    selected positions held by a slot; misses (in selection order) take the least-recently-used
    slots not hit; new LRU order = [untouched slots, old order] + [loaded, miss order] + [hit,
    old order]. Same keys, same LRU order and same counts as :func:`resolve_rows_reference`
    (tested); the order is kept as a per-slot stamp (LRU order = ascending stamp).
    """

    def __init__(self, hot_size: int, max_pos: int = 1024):
        self.hot_size = H = int(hot_size)
        self.keys = np.full(H, -1, dtype=np.int64)
        self.stamp = np.arange(H, dtype=np.int64) - H
        self.clock = 0
        self.slot_of = np.full(max(1, max_pos), -1, dtype=np.int64)

    def lru_order(self) -> np.ndarray:
        return np.argsort(self.stamp, kind="stable")

    def access(self, positions: np.ndarray) -> tuple[int, int]:
        """Looks up unique ``positions``; returns ``(hits, misses)`` and updates the state."""
        pos = np.asarray(positions, dtype=np.int64)
        if len(pos) == 0:
            return 0, 0
        top = int(pos.max())
        if top >= len(self.slot_of):
            grown = np.full(max(top + 1, 2 * len(self.slot_of)), -1, dtype=np.int64)
            grown[:len(self.slot_of)] = self.slot_of
            self.slot_of = grown
        slots = self.slot_of[pos]
        hit = slots >= 0
        hit_slots = slots[hit]
        miss_pos = pos[~hit]
        h, m = len(hit_slots), len(miss_pos)
        if m:
            if m > self.hot_size - h:
                raise ValueError(f"LruHotBuffer: {m} misses but only {self.hot_size - h} "
                                 f"unreferenced slots (hot buffer smaller than the selection)")
            st = self.stamp.copy()
            st[hit_slots] = _NEVER
            if m < self.hot_size:
                cand = np.argpartition(st, m - 1)[:m]
            else:
                cand = np.arange(self.hot_size)
            cand = cand[np.argsort(st[cand], kind="stable")]      # oldest first
            old = self.keys[cand]
            self.slot_of[old[old >= 0]] = -1
            self.keys[cand] = miss_pos
            self.slot_of[miss_pos] = cand
            self.stamp[cand] = self.clock + np.arange(m)
        if h:
            hs = hit_slots[np.argsort(self.stamp[hit_slots], kind="stable")]
            self.stamp[hs] = self.clock + m + np.arange(h)
        self.clock += m + h
        return h, m


class ReferenceHotBuffer:
    """The same buffer driven through :func:`hisparse.ops.resolve_rows_reference` itself (one
    request, nothing resident, every page on host). Slow (Python loops): for cross-checks."""

    def __init__(self, hot_size: int, max_pos: int, block_size: int = 16):
        import torch

        self.torch = torch
        self.bs = bs = block_size
        self.hot_size = H = int(hot_size)
        P = -(-max_pos // bs)
        HB = -(-H // bs)
        self.res = torch.full((1, P), -1, dtype=torch.int32)
        self.host_bt = torch.arange(P, dtype=torch.int32).view(1, P)
        self.hot_bt = torch.arange(HB, dtype=torch.int32).view(1, HB)
        self.hot_keys = torch.full((1, H), -1, dtype=torch.int32)
        self.hot_lru = torch.arange(H, dtype=torch.int32).view(1, H)
        self.arena = torch.zeros(HB * bs, 1)
        self.host = torch.arange(P * bs, dtype=torch.float32).view(-1, 1)
        self.counters = torch.zeros(2, dtype=torch.int64)
        self.max_pos = P * bs

    @property
    def keys(self) -> np.ndarray:
        return self.hot_keys[0].numpy().astype(np.int64)

    def lru_order(self) -> np.ndarray:
        return self.hot_lru[0].numpy().astype(np.int64)

    def access(self, positions: np.ndarray) -> tuple[int, int]:
        from hisparse.ops import resolve_rows_reference

        torch = self.torch
        pos = np.asarray(positions, dtype=np.int64)
        if len(pos) and pos.max() >= self.max_pos:
            raise ValueError("ReferenceHotBuffer: position beyond max_pos")
        before = self.counters.clone()
        rows = resolve_rows_reference(
            torch.from_numpy(pos.astype(np.int32)).view(1, -1), torch.zeros(1, dtype=torch.int32),
            self.res, self.host_bt, self.hot_bt, self.hot_keys, self.hot_lru, self.arena,
            self.host, self.bs, self.counters)
        # every lookup must resolve to a hot row holding its position's host row
        got = self.arena[rows[0].long(), 0]
        if not torch.equal(got, torch.from_numpy(pos.astype(np.float32))):
            raise AssertionError("ReferenceHotBuffer: resolved rows do not hold their positions")
        d = self.counters - before
        return int(d[0]), int(d[1])


def belady_misses(selections: Sequence[np.ndarray], hot_size: int) -> np.ndarray:
    """Misses per step of the offline optimum: every step's selection must be resident, and a
    miss evicts the resident row (not selected this step) whose next use is farthest away (rows
    never used again first). Optimal for demand paging of set requests; cold start included."""
    T = len(selections)
    out = np.zeros(T, dtype=np.int64)
    if T == 0:
        return out
    sels = [np.asarray(s, dtype=np.int64) for s in selections]
    top = max((int(s.max()) for s in sels if len(s)), default=0) + 1
    seen = np.full(top, _NEVER - 1, dtype=np.int64)         # "never again": below empty slots
    nexts: list[np.ndarray] = [None] * T                     # next step each selected row is used
    for t in range(T - 1, -1, -1):
        nexts[t] = seen[sels[t]]
        seen[sels[t]] = t

    H = int(hot_size)
    keys = np.full(H, -1, dtype=np.int64)
    slot_next = np.full(H, _NEVER, dtype=np.int64)               # empty slots are taken first
    slot_of = np.full(top, -1, dtype=np.int64)
    for t in range(T):
        sel, nx = sels[t], nexts[t]
        slots = slot_of[sel]
        hit = slots >= 0
        slot_next[slots[hit]] = nx[hit]
        miss = ~hit
        m = int(miss.sum())
        out[t] = m
        if not m:
            continue
        if m > H - int(hit.sum()):
            raise ValueError("belady_misses: hot buffer smaller than a step's selection")
        score = slot_next.copy()
        score[slots[hit]] = -1                                   # selected now: keep
        victims = np.argpartition(-score, m - 1)[:m] if m < H else np.arange(H)
        old = keys[victims]
        slot_of[old[old >= 0]] = -1
        keys[victims] = sel[miss]
        slot_of[sel[miss]] = victims
        slot_next[victims] = nx[miss]
    return out


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------

def _overlaps(sels: Sequence[np.ndarray]) -> np.ndarray:
    """``|sel_t & sel_{t-1}| / |sel_t|`` for t >= 1."""
    if len(sels) < 2:
        return np.zeros(0)
    top = max(int(s.max()) for s in sels if len(s)) + 1
    mark = np.full(top, -1, dtype=np.int64)
    out = np.empty(len(sels) - 1)
    mark[sels[0]] = 0
    for t in range(1, len(sels)):
        out[t - 1] = np.count_nonzero(mark[sels[t]] == t - 1) / max(1, len(sels[t]))
        mark[sels[t]] = t
    return out


def replay_hit_rates(source: TopkSource, num_layers: int, num_streams: int, steps: int,
                     context_len: int, k: int, hot_sizes: Iterable[int], policy: str = "lru",
                     belady: bool = True, warmup: int = 1, engine: str = "numpy") -> list[dict]:
    """:func:`replay_hit_rate` for several hot-buffer sizes over the same selections."""
    if policy != "lru":
        raise ValueError(f"replay_hit_rate: policy must be 'lru' (the resolver's), got {policy!r}")
    if engine not in ("numpy", "reference"):
        raise ValueError(f"replay_hit_rate: engine must be 'numpy' or 'reference', got {engine!r}")
    hot_sizes = [int(h) for h in hot_sizes]
    warmup = min(max(0, int(warmup)), max(0, steps - 1))
    L, R, T = num_layers, num_streams, steps
    lookups = np.zeros((L, T), dtype=np.int64)
    lru_miss = np.zeros((len(hot_sizes), L, T), dtype=np.int64)
    bel_miss = np.zeros((len(hot_sizes), L, T), dtype=np.int64)
    ov_sum = np.zeros(L)
    ov_cnt = np.zeros(L)
    max_pos = context_len + steps
    for layer in range(L):
        for stream in range(R):
            sels = [np.asarray(source.select(layer, stream, t, context_len + t, k), dtype=np.int64)
                    for t in range(T)]
            lens = np.array([len(s) for s in sels])
            lookups[layer] += lens
            ov = _overlaps(sels)
            ov_sum[layer] += ov.sum()
            ov_cnt[layer] += len(ov)
            for j, H in enumerate(hot_sizes):
                buf = (LruHotBuffer(H, max_pos) if engine == "numpy"
                       else ReferenceHotBuffer(H, max_pos))
                for t, s in enumerate(sels):
                    lru_miss[j, layer, t] += buf.access(s)[1]
                if belady:
                    bel_miss[j, layer] += belady_misses(sels, H)
    w = slice(warmup, T)
    look_l = lookups[:, w].sum(1)
    results = []
    for j, H in enumerate(hot_sizes):
        miss_l = lru_miss[j][:, w].sum(1)
        r = {
            "policy": policy, "hot_size": H, "k": k, "context_len": context_len, "steps": T,
            "num_layers": L, "num_streams": R, "warmup_steps": warmup,
            "hit_rate": float(1 - miss_l.sum() / max(1, look_l.sum())),
            "hit_rate_per_layer": [float(1 - a / max(1, b)) for a, b in zip(miss_l, look_l)],
            "misses_per_step": lru_miss[j].sum(0).tolist(),
            "misses_per_step_per_buffer": float(lru_miss[j][:, w].sum()
                                                / max(1, (T - warmup) * L * R)),
            "overlap": float(ov_sum.sum() / max(1, ov_cnt.sum())),
            "overlap_per_layer": [float(a / max(1, b)) for a, b in zip(ov_sum, ov_cnt)],
        }
        if belady:
            bm = bel_miss[j][:, w].sum(1)
            r["belady_hit_rate"] = float(1 - bm.sum() / max(1, look_l.sum()))
            r["belady_hit_rate_per_layer"] = [float(1 - a / max(1, b)) for a, b in zip(bm, look_l)]
            r["belady_misses_per_step"] = bel_miss[j].sum(0).tolist()
        results.append(r)
    return results


def replay_hit_rate(source: TopkSource, num_layers: int, num_streams: int, steps: int,
                    context_len: int, k: int, hot_size: int, policy: str = "lru",
                    belady: bool = True, warmup: int = 1, engine: str = "numpy") -> dict:
    """Replays ``steps`` decode steps of ``num_streams`` requests x ``num_layers`` layers through
    one hot buffer of ``hot_size`` slots per (layer, request), nothing resident.

    Step ``t`` of every stream has ``context_len + t`` tokens and selects
    ``source.select(layer, stream, t, context_len + t, k)``. ``engine="numpy"`` uses
    :class:`LruHotBuffer`; ``"reference"`` calls :func:`hisparse.ops.resolve_rows_reference`
    (identical counts, much slower). Rates exclude the first ``warmup`` steps (step 0 is a cold
    start: everything misses); ``misses_per_step`` (summed over layers and streams) covers all.

    Returns a dict: ``hit_rate``, ``hit_rate_per_layer``, ``misses_per_step``,
    ``misses_per_step_per_buffer`` (mean misses of one (layer, request) per step after warm-up),
    ``overlap`` / ``overlap_per_layer`` (mean ``|sel_t & sel_{t-1}| / |sel_t|``), and with
    ``belady`` the same hit rates and misses for the offline optimum (``belady_*``).
    """
    return replay_hit_rates(source, num_layers, num_streams, steps, context_len, k, [hot_size],
                            policy=policy, belady=belady, warmup=warmup, engine=engine)[0]
