"""Exact per-row top-k over orderable int32 score keys (the indexer's selection step).

Contract (the spec is :func:`topk_select_reference`): ``keys [T, W]`` int32 holds, per row, the
order-preserving transform of fp32 scores (:func:`orderable_keys`) in columns ``0..lengths[t]-1``;
``INT32_MIN`` marks an invalid column (never selected). Row ``t`` of the ``[T, k]`` int32 result
lists the ``min(k, valid)`` valid columns of highest key, ordered by key descending, ties broken
by the lower column, then ``-1`` padding (``ranked=False``: the same columns in ascending column
order, then ``-1``; no ranking phases run). Columns ``>= lengths[t]`` are never read (they may
hold anything), so the work of a row is proportional to its own length, not to ``W``.

:func:`orderable_keys` maps fp32 to int32 so that signed int32 order is the reference's
``torch.sort(descending=True, stable=True)`` order: ``-0.0`` equals ``+0.0``, every NaN ranks
above ``+inf`` (all NaN equal: ties by column), ``-inf`` below every finite score. ``INT32_MIN``
is the key of no fp32 value (it would be a negative NaN, and NaN is canonicalized).

``HISPARSE_TOPK`` (:mod:`hisparse.ops.switches`) picks the Triton path's launches
(:mod:`hisparse.ops._topk_triton`), all exact and equal: ``fused`` (default) one kernel per call,
the row's programs meeting between phases; ``phased`` the same phases one launch each;
``legacy`` the former path (four histogram launches, a collect, then one program per row
sorting the whole selection: ~30 us whatever the batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import switches
from ._common import RADIX_BINS, RADIX_LEVELS, TOPK_HIST_WIDTH, want_triton

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
SPLIT_SLOTS = 1024          # split histograms beyond one per row (see TopkScratch)
SORT_COLS = 4096            # the split sort's scratch per row: k up to this (else legacy)
CUDA_BLOCK = 1024           # TopkLaunch.block's default on CUDA (the interpreter: 256, its cost
                            # is per block)


@dataclass(frozen=True)
class TopkLaunch:
    """Launch parameters of the Triton top-k (speed hints: every value is exact).
    ``splits``: programs per row (``None``: about ``per_sm`` programs per SM over all rows; a
    fused launch splits rows only within ``per_sm`` programs per SM, so that all of them are
    resident); ``block``: columns per histogram / collect step (a power of two, at most
    16384); ``warps``: per program; ``sort_chunk``: selection slots per chunk of the split
    sort (a power of two); ``per_sm``: ``None`` picks 2-4 by the rows and the table width's blocks
    (``_topk_triton._per_sm``); a fused launch takes at most what the compiled kernel fits on
    an SM; ``stages``: key blocks a histogram or collect loop keeps in flight; ``sparse``: past
    the first digit, a key block with at most this many columns in the threshold bucket adds
    them into the histograms one by one (atomics) instead of histogramming the block (0:
    never; 64: 0.76-0.96x the time of 0 at 8-64 rows x 32k and 8-24 x 128k on the H100 with
    Triton 3.6, whose histograms are warp ballots; Triton 3.8+ lowers them to shared-memory
    atomics, not measured); ``short_rows``: column order only (``ranked=False``, up to
    ``LIVE_MAX_ROWS`` rows), rows of at most this many columns (0: none; else a power of two
    in 16..8192) each taken by one program holding the row in registers, before the launch
    of the longer rows (H100, 163,840-column table: 4096 takes 0.80x the time at 96 rows of
    2k, 1.04-1.06x where no row is short; no step gain in the rank at 2k x 96; 8192 slower
    everywhere: docs/BENCHMARKS.md, thirtieth session)."""

    splits: int | None = None
    block: int | None = None    # None: CUDA_BLOCK on CUDA, 256 interpreted
    warps: int = 4
    sort_chunk: int = 256
    per_sm: int | None = None
    stages: int = 2
    sparse: int = 64
    short_rows: int = 0


def orderable_keys(score: torch.Tensor) -> torch.Tensor:
    """fp32 scores -> int32 keys whose signed order is the score order (module docstring)."""
    s = score.float()
    s = torch.where(s == 0, torch.zeros_like(s), s)                 # -0.0 -> +0.0
    bits = s.view(torch.int32)
    key = torch.where(bits < 0, bits ^ INT32_MAX, bits)
    return torch.where(torch.isnan(s), torch.full_like(key, INT32_MAX), key)


def column_order(selection: torch.Tensor, out: torch.Tensor | None = None,
                 bits: torch.Tensor | None = None, width: int = 0) -> torch.Tensor:
    """``[T, k]`` int32 selections (distinct columns, ``-1`` none, after the selected) in
    ascending column order, ``-1`` last: the ``ranked=False`` order of a ranked selection.

    ``out``: the ``[T, k]`` int32 result (unit column stride; may be ``selection`` itself: each
    row is read whole before it is written); default a new tensor. On CUDA one Triton launch,
    one program a row, instead of torch's five (:func:`column_order_reference`): a sort of the
    row, or with ``bits`` (``[>= T, >= 2 * ceil(width / 32)]`` int32 scratch, overwritten;
    every column ``< width``) a count over a bitmap of the row's columns (no sort)."""
    if selection.dim() != 2 or selection.dtype != torch.int32:
        raise ValueError(f"column_order: selection must be [T, k] int32, got "
                         f"{tuple(selection.shape)} {selection.dtype}")
    if out is not None and (out.shape != selection.shape or out.dtype != torch.int32
                            or (out.numel() and out.stride(1) != 1)):
        raise ValueError(f"column_order: out must be {tuple(selection.shape)} int32 with unit "
                         f"column stride, got {tuple(out.shape)} {out.dtype}")
    if want_triton(selection):
        from ._topk_triton import column_order_triton
        if selection.shape[1] and selection.stride(1) != 1:
            selection = selection.contiguous()
        if out is None:
            out = torch.empty(selection.shape, dtype=torch.int32, device=selection.device)
        return column_order_triton(selection, out, bits, width)
    ordered = column_order_reference(selection)
    return ordered if out is None else out.copy_(ordered)


def column_order_reference(selection: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch spec of :func:`column_order`."""
    big = torch.full_like(selection, INT32_MAX)
    cols = torch.where(selection < 0, big, selection).sort(dim=1).values
    return torch.where(cols == INT32_MAX, torch.full_like(cols, -1), cols)


def topk_select_reference(keys: torch.Tensor, lengths: torch.Tensor, k: int,
                          ranked: bool = True) -> torch.Tensor:
    """Plain PyTorch spec of :func:`topk_select`: one int64 ``(key << 32) | (2^32 - 1 - col)``
    per column (``INT64_MIN`` past the row's length or for an invalid key), sorted ``torch.topk``
    over the whole width (``ranked=False``: then :func:`column_order_reference`)."""
    T, W = keys.shape
    out = torch.full((T, k), -1, dtype=torch.int32, device=keys.device)
    if T == 0 or W == 0:
        return out
    col = torch.arange(W, device=keys.device)
    valid = (col[None, :] < lengths.long()[:, None]) & (keys != INT32_MIN)
    packed = (keys.long() << 32) | (0xFFFFFFFF - col)[None, :]
    packed = torch.where(valid, packed, torch.full_like(packed, -(2**63)))
    kk = min(k, W)
    vals, idx = torch.topk(packed, kk, dim=1, largest=True, sorted=True)
    out[:, :kk] = torch.where(vals == -(2**63), torch.full_like(idx, -1), idx).to(torch.int32)
    return out if ranked else column_order_reference(out)


class TopkScratch:
    """Device scratch of the Triton top-k for up to ``rows`` rows a call, allocated once (a CUDA
    graph keeps the addresses it captured): per row the four global digit histograms, a slot
    counter and the threshold state of each level (``hist [rows, 4 * 256 + 64]``, zeroed by
    each call) and the histograms of each (row, split) program (``split_hist [rows +
    SPLIT_SLOTS, 4, 256]``, written before they are read by each call: ``rows x splits`` of
    them, so a call over few long rows can split each row in up to ``MAX_SPLITS``), the split
    sort's chunks (``sorted [rows, SORT_COLS]`` int64 packed keys) and the column order's
    per-(row, split) counts (``counts [rows + SPLIT_SLOTS]``), both written before they are
    read by each call; ``stalls [1]`` counts a fused launch's row barriers that gave up
    waiting (a bug if ever nonzero: that call's result is not to be trusted);
    ``long_lengths [rows]`` the lengths the launch after the short rows' sees
    (``TopkLaunch.short_rows``), written before read."""

    def __init__(self, rows: int, device: torch.device | str) -> None:
        self.rows = max(1, int(rows))
        dev = torch.device(device)
        self.hist = torch.zeros((self.rows, TOPK_HIST_WIDTH), dtype=torch.int32, device=dev)
        self.split_hist = torch.zeros((self.rows + SPLIT_SLOTS, RADIX_LEVELS, RADIX_BINS),
                                      dtype=torch.int32, device=dev)
        self.sorted = torch.empty((self.rows, SORT_COLS), dtype=torch.int64, device=dev)
        self.counts = torch.zeros(self.rows + SPLIT_SLOTS, dtype=torch.int32, device=dev)
        self.stalls = torch.zeros(1, dtype=torch.int32, device=dev)
        self.long_lengths = torch.zeros(self.rows, dtype=torch.int32, device=dev)

    @staticmethod
    def row_bytes() -> int:
        """Bytes a row of the scratch takes (``hist``, ``sorted``, one ``split_hist`` slot, one
        of ``counts`` and of ``long_lengths``)."""
        return 4 * TOPK_HIST_WIDTH + 4 * RADIX_LEVELS * RADIX_BINS + 8 * SORT_COLS + 4 + 4

    def data_ptrs(self) -> tuple[int, ...]:
        return (self.hist.data_ptr(), self.split_hist.data_ptr(), self.sorted.data_ptr(),
                self.counts.data_ptr(), self.stalls.data_ptr(), self.long_lengths.data_ptr())


def topk_select(keys: torch.Tensor, lengths: torch.Tensor, k: int,
                out: torch.Tensor | None = None, scratch: TopkScratch | None = None,
                splits: int | None = None, launch: TopkLaunch | None = None,
                hist_zeroed: bool = False, ranked: bool = True) -> torch.Tensor:
    """Top-k columns per row: ``[T, k]`` int32, ``-1`` padding (module docstring).

    Args:
        keys: ``[T, W]`` int32 orderable keys, unit column stride; only columns ``<
            lengths[t]`` are read.
        lengths: ``[T]`` int32 valid prefix of each row (clamped to ``W``; ``<= 0``: empty row).
        k: result width (any ``k >= 1``, e.g. 2048 plus a hot policy's band).
        out: optional ``[T, k]`` int32 result with unit column stride (written in full).
        scratch: the Triton path's :class:`TopkScratch` (``rows >= T``); required for CUDA-graph
            capture; without one each call allocates its own.
        splits: programs per row (``1..MAX_SPLITS``, ``T * splits <= rows + SPLIT_SLOTS`` of
            the scratch; default: enough to fill the GPU); replaces ``launch.splits``. The
            launch's ``T * splits`` programs serve the non-empty rows (up to ``T =
            LIVE_MAX_ROWS``): by default the empty ones' programs (a graph bucket's padding)
            go to them, up to the per-row cap a full launch has; a given ``splits`` stays
            the most a row gets.
        launch: the Triton path's :class:`TopkLaunch` (speed hints; default ``TopkLaunch()``).
            ``k > SORT_COLS`` runs the ``legacy`` ranking.
        hist_zeroed: Triton path with ``scratch``: ``scratch.hist[:T]`` was zeroed by an
            earlier launch on this stream (the indexer's scoring kernel,
            ``indexer_keys(hist=...)``), so the call skips its fill launch. False (default):
            the call zeroes it.
        ranked: True (default): by key descending, ties by the lower column; False: the same
            columns in ascending column order (no sort: for a consumer that reads the set,
            not the ranks, e.g. the attention in a forward that selects no band).

    Triton path (CUDA tensors or HISPARSE_FORCE_TRITON=1): an exact radix select over the four
    8-bit digits of each key (each level one pass over each row's real length, skipped once the
    threshold is resolved), a compaction of the selected (key, column) pairs into the sort
    scratch (``legacy``: of the columns into ``out``) and their sort: chunks sorted by several
    programs per row, then each entry written at its rank (the entries above it in every
    chunk); one launch (``HISPARSE_TOPK``), no host sync, fixed launch shapes. Column order
    with ``launch.short_rows``: a launch before it takes the rows of at most that many
    columns, one program a row (:attr:`TopkLaunch.short_rows`).
    """
    T = keys.shape[0]
    if k < 1:
        raise ValueError(f"topk_select: k must be >= 1, got {k}")
    if keys.dim() != 2 or keys.dtype != torch.int32 or lengths.shape != (T,):
        raise ValueError(f"topk_select: keys must be [T, W] int32 and lengths [T], got "
                         f"{tuple(keys.shape)} {keys.dtype} and {tuple(lengths.shape)}")
    if out is None:
        out = torch.empty((T, k), dtype=torch.int32, device=keys.device)
    elif out.shape != (T, k) or out.dtype != torch.int32 or (T and out.stride(1) != 1):
        raise ValueError(f"topk_select: out must be [{T}, {k}] int32 with unit column stride, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if T == 0:
        return out
    if want_triton(keys):
        from ._topk_triton import topk_select_triton
        if scratch is None:
            scratch = TopkScratch(T, keys.device)
        elif scratch.rows < T or scratch.hist.device != keys.device:
            raise ValueError(f"topk_select: scratch ({scratch.rows} rows, "
                             f"{scratch.hist.device}) is too small for {T} rows on "
                             f"{keys.device}; size it for the largest call up front")
        cfg = launch or TopkLaunch()
        if splits is not None:
            cfg = dataclasses.replace(cfg, splits=splits)
        if cfg.block is None:
            cfg = dataclasses.replace(cfg, block=CUDA_BLOCK if keys.is_cuda else 256)
        return topk_select_triton(keys, lengths, k, out, scratch,
                                  switches.current().topk, cfg, hist_zeroed, ranked)
    out.copy_(topk_select_reference(keys, lengths, k, ranked))
    return out
