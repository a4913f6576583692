"""Lightning indexer + top-k over the paged indexer cache.

Semantics (the spec is :func:`indexer_topk_reference`)::

    score(t, s) = sum_h weights[t, h] * relu(q[t, h, :] . k[s, :])        (fp32)
    candidates(t) = { s : 0 <= s <= token_pos[t], page s // block_size mapped in block_table }
    selected(t)   = the min(topk, |candidates|) candidates of highest score

Row ``t`` of the output lists ``selected(t)`` as logical positions, ordered by score descending,
ties broken by the lower position, then ``-1`` padding (``ranked=False``: ascending positions).
When ``token_pos[t] + 1 <= topk`` every position ``0..token_pos[t]`` is returned (still in that
order). Padding tokens (``token_req == -1``) give a row of ``-1``.

Relation to transformers' ``DeepseekV32Indexer`` (models/deepseek_v32/modeling_deepseek_v32.py)::

    # softmax_scale = index_head_dim**-0.5
    scores = relu((q.float() @ k.float().T) * softmax_scale)
    index_scores = (weights_proj(x).float() * index_n_heads**-0.5) @ scores

Because ``relu(c * x) = c * relu(x)`` for ``c > 0``, the caller folds *all* scales into
``weights``::

    weights = weights_proj(x).float() * (index_n_heads ** -0.5) * (index_head_dim ** -0.5)

and passes ``q`` after the indexer's non-interleaved RoPE (the same for ``k_cache`` rows, which
hold ``k_norm(wk(x))`` with RoPE applied). The result equals transformers' up to fp32 rounding
(the scale is applied after the dot instead of before the ReLU).

**FP8 keys** (page-split e4m3 + power-of-two scales, :mod:`hisparse.ops.quant`) hold the
*rotated* keys, ``indexer_rotation(k)`` (:mod:`hisparse.ops.rotation`, as DeepSeek-V3.2's and
SGLang's indexers store them), so the queries scored against them are rotated too (``(H q) .
(H k) = q . k`` up to rounding, and the FP8 rounding is the references'), then quantized the
same way as the keys, per token, head and 128-value tile
(:func:`hisparse.ops.quant.quantize_index_queries_reference`): ``q`` above means their
dequantized values (:func:`fp8_key_queries_reference`). That is DeepSeek-V3.2's own indexer
(``rotate_activation``, ``act_quant`` of q with ue8m0 scales, then ``fp8_index``; DeepGEMM's
``fp8_mqa_logits``): FP8 queries against FP8 keys. With one tile per head (``D <= 128``) the
kernel runs the e4m3 x e4m3 dot with fp32 accumulation and folds both power-of-two scales out
of the ReLU (exact: ``relu(c * x) = c * relu(x)``, ``c > 0``); the reference computes the same
scores from the dequantized values in fp32, so the two differ only by accumulation (Hopper's
FP8 MMA sums less precisely than fp32: near-ties may swap). ``HISPARSE_FP8_INDEXER=0``
(:func:`fp8_query_enabled`) keeps the rotated queries in their dtype against the upcast keys
(2.3-2.7x slower on the H200); kernel and reference both follow the switch, which must not
change after CUDA graphs are captured. bf16 / fp32 keys: queries unrotated and unquantized,
always.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from . import glue, switches
from ._common import fp8_tile, want_triton
from .pending import PendingSum, summed
from .quant import (
    FP8KeyLayout,
    dequantize_index_keys_reference,
    dequantize_index_queries_reference,
    quantize_index_queries_reference,
)
from .rotation import indexer_rotation
from .topk import TopkLaunch, TopkScratch, column_order, column_order_reference, topk_select


@functools.cache
def _launch(short_rows: str) -> TopkLaunch:
    """The top-k launch ``HISPARSE_TOPK_SHORT`` asks for (one object a value)."""
    return TopkLaunch(short_rows=int(short_rows))


def fp8_query_enabled(head_dim: int) -> bool:
    """Whether FP8 keys are scored against FP8 queries: yes unless ``HISPARSE_FP8_INDEXER=0``,
    and only when a query tile (``min(head_dim, 128)`` values) is a power of two, as the
    kernel's tile is. Otherwise the queries stay unquantized."""
    tile = min(head_dim, 128)
    return switches.current().fp8_indexer and tile & (tile - 1) == 0


@dataclass(frozen=True, eq=False)
class IndexerQueries:
    """The current tokens' indexer queries and head weights before their RoPE and weight
    scale, so that scoring against FP8 keys computes them inside its query kernel (RoPE,
    rotation, e4m3 quantization and the weights in one launch: :func:`indexer_topk`).

    ``q [T, Hi, Di]`` (``wq_b``'s output, unit last stride), ``cos`` / ``sin`` ``[T, rope_dim //
    2]``, ``interleaved`` (the RoPE convention), ``w [T, Hi]`` (``weights_proj``'s output) and
    ``weight_scale`` (a float). ``w`` may be a :class:`~hisparse.ops.pending.PendingSum`
    (``weights_proj``'s fp32 split-K partials, :func:`hisparse.ops.fp32_linear`): the query
    kernel sums them, the same additions as their own reduction. The queries and weights are
    :meth:`materialize`'s: exactly the ops the model ran before (``glue.rope_heads``,
    ``w.float() * weight_scale``)."""

    q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    rope_dim: int
    interleaved: bool
    w: torch.Tensor | PendingSum
    weight_scale: float

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def rope(self) -> tuple:
        """``(cos, sin, rope_dim, interleaved)`` (the kernels' ``rope`` argument)."""
        return self.cos, self.sin, self.rope_dim, self.interleaved

    def __getitem__(self, rows: slice) -> IndexerQueries:
        """Tokens ``rows`` (a slice; pending weights stay pending when it takes every row)."""
        if (isinstance(self.w, PendingSum) and isinstance(rows, slice)
                and range(*rows.indices(self.w.rows)) == range(self.w.rows)):
            return self
        return IndexerQueries(self.q[rows], self.cos[rows], self.sin[rows], self.rope_dim,
                              self.interleaved, summed(self.w)[rows], self.weight_scale)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [T, Hi, Di] roped in q's dtype, weights [T, Hi] fp32, every scale folded)``."""
        return (glue.rope_heads(self.q, self.cos, self.sin, self.rope_dim, self.interleaved),
                summed(self.w).float() * self.weight_scale)


def _folds(q: IndexerQueries, k_cache: torch.Tensor) -> bool:
    """Whether scoring ``k_cache`` takes ``q``'s RoPE and weight scale into its query kernel:
    FP8 keys, FP8 queries (:func:`fp8_query_enabled`) of one scale tile."""
    d = q.shape[-1]
    return k_cache.dtype == torch.uint8 and fp8_query_enabled(d) and fp8_tile(d) == d


class IndexerWorkspace:
    """The Triton path's device buffers, owned by the caller and allocated once (a CUDA graph
    keeps the addresses it captured; DESIGN section 7): the score keys ``keys [rows,
    max_positions]`` int32, each row's length ``lengths [rows]`` int32 and the top-k's
    :class:`~hisparse.ops.topk.TopkScratch`.

    A call scores ``rows`` tokens at a time (more tokens: several passes); it needs
    ``P * block_size <= max_positions`` (checked; the buffers are never grown).
    """

    def __init__(self, rows: int, max_positions: int, device: torch.device | str) -> None:
        self.rows = max(1, int(rows))
        self.max_positions = max(1, int(max_positions))
        dev = torch.device(device)
        self.keys = torch.empty((self.rows, self.max_positions), dtype=torch.int32, device=dev)
        self.lengths = torch.zeros(self.rows, dtype=torch.int32, device=dev)
        self.topk = TopkScratch(self.rows, dev)

    @staticmethod
    def default_rows(max_tokens: int, max_positions: int, budget_bytes: int = 1 << 28) -> int:
        """Rows for ``max_tokens`` per call within ``budget_bytes`` (256 MiB by default)."""
        row_bytes = 4 * max(1, int(max_positions)) + 4 + TopkScratch.row_bytes()
        return max(1, min(int(max_tokens), budget_bytes // row_bytes))

    def data_ptrs(self) -> tuple[int, ...]:
        return (self.keys.data_ptr(), self.lengths.data_ptr()) + self.topk.data_ptrs()


def _groups(token_req: list[int]):
    """Maximal runs of consecutive tokens with the same request slot (padding skipped)."""
    t, T = 0, len(token_req)
    while t < T:
        r = token_req[t]
        if r < 0:
            t += 1
            continue
        t1 = t + 1
        while t1 < T and token_req[t1] == r:
            t1 += 1
        yield r, t, t1
        t = t1


def _fp8_layout(k_cache: torch.Tensor, d: int, block_size: int):
    layout = FP8KeyLayout.of(k_cache, d)
    if layout.block_size != block_size or k_cache.dim() != 2:
        raise ValueError(f"indexer_topk: FP8 keys must be one layer's pages [blocks, "
                         f"{block_size} * {layout.key_bytes}], got {tuple(k_cache.shape)}")
    return layout


def fp8_key_queries_reference(q: torch.Tensor) -> torch.Tensor:
    """The queries ``q [T, Hi, D]`` that scoring against FP8 keys uses (the keys hold
    ``indexer_rotation(k)``): ``indexer_rotation(q)`` in ``q.dtype``, then (unless
    ``HISPARSE_FP8_INDEXER=0``) its e4m3 quantization, dequantized (exact in bf16; fp32)."""
    if fp8_query_enabled(q.shape[-1]):
        return dequantize_index_queries_reference(*quantize_index_queries_reference(q))
    return indexer_rotation(q)


def indexer_topk_reference(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                           block_table: torch.Tensor, token_req: torch.Tensor,
                           token_pos: torch.Tensor, block_size: int, topk: int,
                           ranked: bool = True) -> torch.Tensor:
    """Plain PyTorch spec of :func:`indexer_topk` (any device)."""
    if isinstance(q, IndexerQueries):
        q, weights = q.materialize()
    T = q.shape[0]
    dev = q.device
    out = torch.full((T, topk), -1, dtype=torch.int32, device=dev)
    P = block_table.shape[1]
    max_pos = P * block_size
    req_l = token_req.tolist()
    pos_l = token_pos.tolist()
    if k_cache.dtype == torch.uint8:
        layout = _fp8_layout(k_cache, q.shape[-1], block_size)
        q = fp8_key_queries_reference(q)
    for r, t0, t1 in _groups(req_l):
        ps = pos_l[t0:t1]
        S = min(max(ps) + 1, max_pos)
        if S <= 0:
            continue
        positions = torch.arange(S, device=dev)
        blk = block_table[r, positions // block_size].long()
        mapped = blk >= 0
        rows = blk.clamp(min=0) * block_size + positions % block_size
        if k_cache.dtype == torch.uint8:                            # FP8 key pages
            k = dequantize_index_keys_reference(layout.gather(k_cache, rows), q.shape[-1])
        else:
            k = k_cache[rows].float()                               # [S, D]
        hi = q.shape[1]
        step = max(1, (1 << 24) // max(1, hi * S))                  # bound the [g, Hi, S] temp
        for a in range(t0, t1, step):
            b = min(t1, a + step)
            qg = q[a:b].float()                                     # [g, Hi, D]
            s = torch.relu(torch.einsum("ghd,sd->ghs", qg, k))
            score = torch.einsum("gh,ghs->gs", weights[a:b].float(), s)
            pg = torch.tensor(pos_l[a:b], device=dev)
            valid = mapped[None, :] & (positions[None, :] <= pg[:, None])
            score = torch.where(valid, score, torch.full_like(score, float("-inf")))
            order = torch.sort(score, dim=1, descending=True, stable=True).indices
            # candidates first (a stable sort keeps the score order): a -inf score still
            # ranks above an unmapped position
            first = torch.sort((~valid).gather(1, order).to(torch.int8), dim=1,
                               stable=True).indices
            order = order.gather(1, first)
            n_valid = valid.sum(dim=1)
            kk = min(topk, S)
            sel = order[:, :kk]
            keep = torch.arange(kk, device=dev)[None, :] < n_valid[:, None]
            out[a:b, :kk] = torch.where(keep, sel, torch.full_like(sel, -1)).to(torch.int32)
    return out if ranked else column_order_reference(out)


def _indexer_topk_triton(q, weights, k_cache, block_table, token_req, token_pos, block_size, topk,
                         out=None, workspace: IndexerWorkspace | None = None, group: int = 1,
                         ranked: bool = True, ascending_first: int = 0):
    from ._indexer_triton import indexer_keys

    T = q.shape[0]
    W = block_table.shape[1] * block_size
    if out is None:
        out = torch.empty((T, topk), dtype=torch.int32, device=q.device)
    if T == 0:
        return out
    first = min(ascending_first, topk) if ranked else 0
    # the bitmap (ceil(W / 32) words) and its prefix counts fit in a key row of the workspace
    fits = workspace is not None and 2 * -(-W // 32) <= workspace.max_positions
    lazy = isinstance(q, IndexerQueries)
    if lazy and not _folds(q, k_cache):
        q, weights = q.materialize()
        lazy = False
    # the scoring kernel zeroes the top-k's histograms (no fill launch) unless the glue runs
    # unfused (HISPARSE_FUSED_GLUE=0: the launch-count baseline)
    zero_hist = switches.current().fused_glue
    if workspace is not None:
        if W > workspace.max_positions or workspace.keys.device != q.device:
            raise ValueError(f"indexer_topk: workspace ({workspace.max_positions} positions, "
                             f"{workspace.keys.device}) is too small for {W} positions on "
                             f"{q.device}; size it for the largest call up front")
        tc = workspace.rows
        scratch = workspace.topk
    else:  # bound the [Tc, W] int32 key buffer to ~512 MiB
        tc = max(1, min(T, (1 << 27) // max(1, W)))
        scratch = TopkScratch(min(T, tc), q.device)
    if lazy and T > tc and isinstance(q.w, PendingSum):   # summed once, not once per pass
        q = dataclasses.replace(q, w=summed(q.w))
    for a in range(0, T, tc):
        b = min(T, a + tc)
        if workspace is None:
            keys_buf = lens = None
        else:
            keys_buf, lens = workspace.keys[:b - a, :W], workspace.lengths[:b - a]
        hist = scratch.hist[:b - a] if zero_hist else None
        if lazy:
            qc = q[a:b]
            qa, wa, fold = qc.q, qc.w, dict(rope=qc.rope, weight_scale=qc.weight_scale)
        else:
            qa, wa, fold = q[a:b], weights[a:b], {}
        keys, lens = indexer_keys(qa, wa, k_cache, block_table, token_req[a:b],
                                  token_pos[a:b], block_size, out=keys_buf, lengths=lens,
                                  group=group, fp8_query=fp8_query_enabled(q.shape[-1]),
                                  hist=hist, **fold)
        topk_select(keys, lens, topk, out=out[a:b], scratch=scratch, hist_zeroed=zero_hist,
                    ranked=ranked, launch=_launch(switches.current().topk_short))
        if first:   # the pass's keys are spent: their buffer holds the count's bitmap
            bits = workspace.keys[:b - a] if workspace is not None and fits else None
            column_order(out[a:b, :first], out[a:b, :first], bits, W)
    return out


def indexer_topk(q: torch.Tensor | IndexerQueries, weights: torch.Tensor | None,
                 k_cache: torch.Tensor,
                 block_table: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor,
                 block_size: int, topk: int, out: torch.Tensor | None = None,
                 workspace: IndexerWorkspace | None = None, group: int = 1,
                 ranked: bool = True, ascending_first: int = 0) -> torch.Tensor:
    """Top-k logical positions per query token: ``[T, topk]`` int32, ``-1`` padding.

    Args:
        q: ``[T, Hi, D]`` bf16/fp32 indexer queries, RoPE applied; or an
            :class:`IndexerQueries` (queries and weights before their RoPE and scale: with FP8
            keys and FP8 queries of one tile the query kernel applies them, bit for bit its
            :meth:`~IndexerQueries.materialize`, which every other path runs first).
        weights: ``[T, Hi]`` fp32 per-head weights with all scales folded in (module
            docstring); ignored (None) when ``q`` is an :class:`IndexerQueries`.
        k_cache: ``[num_idx_blocks * block_size, D]`` one layer's indexer keys (flat rows), or
            FP8 keys as pages ``[num_idx_blocks, block_size * index_key_bytes(D)]`` uint8
            (:class:`hisparse.ops.quant.FP8KeyLayout`: per page the e4m3 values, then the fp32
            scales, of the rotated keys; scored as their dequantized values against the rotated
            queries, FP8-quantized unless ``HISPARSE_FP8_INDEXER=0``: module docstring).
        block_table: ``[R, P]`` int32 indexer block of each logical page, ``-1`` none.
        token_req: ``[T]`` int32 row of ``block_table`` of each token, ``-1`` padding.
        token_pos: ``[T]`` int32 position of each token; it sees positions ``0..pos``.
        out: optional preallocated ``[T, topk]`` int32 result.
        workspace: the Triton path's buffers (:class:`IndexerWorkspace`); required for
            CUDA-graph capture across batch sizes; without one each call allocates its own.
        group: Triton path, tokens scored per program (a power of two; a speed hint, any value
            is exact): runs of that many consecutive tokens of one request (MTP verify groups)
            then read each key once for all of them.
        ranked: True (default): the module docstring's order, score descending; False: the
            same positions ascending (no ranking pass: for a consumer of the set, not the
            ranks), ``-1`` after them.
        ascending_first: with ``ranked``, the first ``ascending_first`` columns of each row
            (its top ``ascending_first`` positions) ascending, ``-1`` after them, the rest
            still by rank (a hot policy's next-ranked band after a top k the attention reads
            in position order); on the Triton path counted over a bitmap in the workspace's
            key buffer, which the selection no longer needs (every column is below the
            table's width ``P * block_size``).

    Triton path (CUDA tensors or HISPARSE_FORCE_TRITON=1): a Triton kernel scores each token's
    positions ``0..pos`` in fp32 (tensor-core dot with fp32 accumulation for bf16 inputs, IEEE
    fp32 for fp32 inputs; FP8 keys: one e4m3 x e4m3 dot per key tile for all heads, the query
    scales folded into the weights, times the key's scale) into order-preserving int32 keys
    (:func:`hisparse.ops.topk.orderable_keys`), then :func:`hisparse.ops.topk.topk_select` (an
    exact radix select) ranks them: "score descending, ties by lower position" with no host sync,
    and nothing past a token's position is touched (the width ``P * block_size`` only bounds the
    buffers). The scoring kernel also zeroes the top-k's histogram scratch (one fill launch
    less; not with ``HISPARSE_FUSED_GLUE=0``).
    """
    if ascending_first < 0:
        raise ValueError(f"indexer_topk: ascending_first must be >= 0, got {ascending_first}")
    if want_triton(q.q if isinstance(q, IndexerQueries) else q, k_cache):
        return _indexer_topk_triton(q, weights, k_cache, block_table, token_req, token_pos,
                                    block_size, topk, out=out, workspace=workspace, group=group,
                                    ranked=ranked, ascending_first=ascending_first)
    res = indexer_topk_reference(q, weights, k_cache, block_table, token_req, token_pos,
                                 block_size, topk, ranked)
    if ascending_first:
        res[:, :ascending_first] = column_order_reference(res[:, :ascending_first])
    if out is not None:
        out.copy_(res)
        return out
    return res
