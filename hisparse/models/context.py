"""The contract between the model and whoever owns the KV cache, and its readable reference.

The model computes everything that depends only on the current tokens (projections, RoPE, the
absorbed query, the new cache rows, the indexer query/key/weights). Everything that touches the
history -- writing rows to the cache, indexer scoring, top-k, sparse attention -- goes through one
call per layer, :meth:`SparseAttentionContext.attend`. The worker implements it over paged GPU
caches with the tiered KV store; :class:`DenseReferenceContext` implements it with plain
per-sequence tensors and is the spec the worker is tested against.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from hisparse.ops import glue
from hisparse.ops.indexer import IndexerQueries


@dataclass(frozen=True)
class NewRows:
    """The current tokens' MLA cache rows before their norm and RoPE, so that a context writes
    them into its cache in one fused kernel (:func:`hisparse.ops.glue.write_mla_rows`): row
    ``t`` is ``[rms_norm(kv[t, :R]) | rope_interleaved(kv[t, R:])]``
    (:func:`hisparse.ops.glue.mla_rows_reference`).

    ``kv [T, R + rope]`` (``kv_a_proj_with_mqa``'s output), ``norm_weight [R]`` and ``eps``
    (``kv_a_layernorm``), ``cos`` / ``sin`` ``[T, rope // 2]``."""

    kv: Tensor
    norm_weight: Tensor
    eps: float
    cos: Tensor
    sin: Tensor
    kv_lora_rank: int

    @property
    def shape(self) -> torch.Size:
        return self.kv.shape

    def materialize(self) -> Tensor:
        """The rows ``[T, R + rope]`` in the model dtype."""
        return glue.mla_rows_reference(self.kv, self.norm_weight, self.eps, self.cos, self.sin,
                                       self.kv_lora_rank)

    def write(self, dst: Tensor, rows: Tensor, query: NewQuery | None = None) -> Tensor | None:
        """``dst[rows[t]] = row t`` (float rows, or FP8 byte rows: quantized). With the same
        tokens' ``query``, also returns it materialized, made in the rows' launch (one kernel
        for both); else None."""
        if query is not None and (query.cos is not self.cos or query.sin is not self.sin):
            raise ValueError("NewRows.write: the query's cos / sin must be the rows' (one "
                             "launch ropes both with the rows' tables)")
        q = () if query is None else (query.q_abs, query.q_pe)
        return glue.write_mla_rows(self.kv, self.norm_weight, self.eps, self.cos, self.sin, dst,
                                   rows, self.kv_lora_rank, *q)


@dataclass(frozen=True, eq=False)
class NewQuery:
    """The current tokens' absorbed MLA query before its RoPE and concat, so that a context
    makes it in the launch that writes the rows (:meth:`NewRows.write` with ``query``): head
    ``h`` of token ``t`` is ``[q_abs[t, h] | rope_interleaved(q_pe[t, h])]``
    (:func:`hisparse.ops.glue.mla_q_latent_reference`), ``[T, H, R + rope]`` in ``q_pe``'s
    dtype; any other consumer calls :meth:`materialize` (its own kernel, as before the fold).

    ``q_abs [T, H, R]`` (``q_nope @ w_uk``), ``q_pe [T, H, rope]`` (any strides), ``cos`` /
    ``sin`` ``[T, rope // 2]``."""

    q_abs: Tensor
    q_pe: Tensor
    cos: Tensor
    sin: Tensor

    @property
    def shape(self) -> torch.Size:
        T, H, R = self.q_abs.shape
        return torch.Size((T, H, R + self.q_pe.shape[2]))

    @property
    def dtype(self) -> torch.dtype:
        return self.q_pe.dtype

    def materialize(self) -> Tensor:
        """The query ``[T, H, R + rope]`` (:func:`hisparse.ops.glue.mla_q_latent`)."""
        return glue.mla_q_latent(self.q_abs, self.q_pe, self.cos, self.sin)


@dataclass(frozen=True)
class NewKeys:
    """The current tokens' indexer keys before their LayerNorm and RoPE (written fused by
    :func:`hisparse.ops.glue.write_index_keys`): key ``t`` is
    :func:`hisparse.ops.glue.index_keys_reference` of ``k[t]`` (``wk``'s output ``[T, Di]``)."""

    k: Tensor
    ln_weight: Tensor
    ln_bias: Tensor
    eps: float
    cos: Tensor
    sin: Tensor
    rope_dim: int
    interleaved: bool

    @property
    def shape(self) -> torch.Size:
        return self.k.shape

    def materialize(self) -> Tensor:
        """The keys ``[T, Di]`` in the model dtype."""
        return glue.index_keys_reference(self.k, self.ln_weight, self.ln_bias, self.eps,
                                         self.cos, self.sin, self.rope_dim, self.interleaved)

    def write(self, dst: Tensor, rows: Tensor) -> None:
        """Key of flat row ``rows[t]`` = key ``t`` (float keys, or FP8 page-split: quantized)."""
        glue.write_index_keys(self.k, self.ln_weight, self.ln_bias, self.eps, self.cos,
                              self.sin, self.rope_dim, self.interleaved, dst, rows)


def materialize(x: Tensor | NewRows | NewKeys | NewQuery | None) -> Tensor | None:
    """``x`` as a tensor (``q_latent`` / ``kv_new`` / ``index_k_new`` of
    :meth:`SparseAttentionContext.attend` may come either way)."""
    return x if x is None or isinstance(x, Tensor) else x.materialize()


def materialize_queries(index_q: Tensor | IndexerQueries | None, index_weights: Tensor | None
                        ) -> tuple[Tensor | None, Tensor | None]:
    """``(index_q, index_weights)`` as tensors: an :class:`~hisparse.ops.indexer.IndexerQueries`
    (which carries the weights; ``index_weights`` is None then) runs its RoPE and weight
    scale (:meth:`~hisparse.ops.indexer.IndexerQueries.materialize`)."""
    if isinstance(index_q, IndexerQueries):
        return index_q.materialize()
    return index_q, index_weights


@runtime_checkable
class SparseAttentionContext(Protocol):
    """What :class:`~hisparse.models.dsa.DSAForCausalLM` needs from the KV side, per forward.

    A forward processes a *flat batch*: the ``T`` tokens of several sequences concatenated (each
    sequence's tokens contiguous and in position order, no padding). The context knows which
    sequence each token belongs to and each token's position; it is set up by its owner before
    the forward (the model reads none of its attributes). Implementations usually expose:

    - ``num_tokens`` (int): ``T``;
    - a token -> sequence map (e.g. ``seq_ids`` / cumulative query lengths) and the positions;
    - the per-layer caches: MLA rows ``[*, kv_lora_rank + qk_rope_head_dim]`` and indexer keys
      ``[*, index_head_dim]`` for every live token of every sequence.

    Shapes below: ``H`` = num_heads, ``D`` = kv_lora_rank + qk_rope_head_dim (576 in production),
    ``R`` = kv_lora_rank (512), ``Hi`` = index_n_heads, ``Di`` = index_head_dim.
    """

    def attend(
        self,
        layer_idx: int,
        q_latent: Tensor | NewQuery,
        kv_new: Tensor | NewRows,
        index_q: Tensor | None,
        index_weights: Tensor | None,
        index_k_new: Tensor | None,
        sm_scale: float,
    ) -> Tensor:
        """Write this layer's new rows, select top-k, and run sparse MLA attention (MQA, absorbed).

        Args:
            layer_idx: layer number, ``0 <= layer_idx < num_layers``; called in increasing order,
                exactly once per layer per forward.
            q_latent: ``[T, H, D]`` model dtype: ``[q_nope @ W_UK | roped q_pe]``, or a
                :class:`NewQuery` that computes it (``.materialize()``; with a
                :class:`NewRows` ``kv_new``, ``kv_new.write(dst, rows, q_latent)`` makes it in
                the rows' launch and returns it).
            kv_new: ``[T, D]`` model dtype: the cache rows of the current tokens,
                ``[kv_a_layernorm(c_kv) | roped k_pe]``, or a :class:`NewRows` that computes
                them (``.write(dst, rows)`` fused into the cache write, ``.materialize()``).
            index_q: ``[T, Hi, Di]`` model dtype, RoPE applied; ``None`` on a GLM "shared" layer.
                Or (fused glue) an :class:`~hisparse.ops.indexer.IndexerQueries`: the queries
                and the weights before their RoPE and weight scale (:func:`materialize_queries`;
                the FP8 indexer applies them in its query kernel).
            index_weights: ``[T, Hi]`` float32, every scale folded in; ``None`` on a shared layer
                and when ``index_q`` is an :class:`~hisparse.ops.indexer.IndexerQueries`.
            index_k_new: ``[T, Di]`` model dtype, the indexer keys of the current tokens (LayerNorm
                and RoPE applied), or a :class:`NewKeys` that computes them; ``None`` on a
                shared layer (it has no indexer cache).
            sm_scale: softmax scale of the attention logits (YaRN mscale correction included).

        Contract:
            1. rows (and indexer keys) of the current tokens are written to the caches first, so a
               token sees itself and the earlier tokens of its own chunk;
            2. token ``t`` of a sequence, at position ``p``, scores every position ``s <= p`` of
               its sequence: ``score(t, s) = sum_h index_weights[t, h] *
               relu(index_q[t, h] . index_k[s])`` in float32, and selects the ``index_topk``
               best (all of ``0..p`` when ``p + 1 <= index_topk``). On a shared layer the
               selection of the closest previous full layer, for the same token, is reused;
            3. ``logit(t, h, s) = (q_latent[t, h] . row[s]) * sm_scale`` over the selected ``s``,
               softmax in float32, output = the weighted sum of ``row[s][:R]``.

        Returns:
            ``[T, H, R]`` in ``q_latent.dtype``.
        """
        ...


class DenseReferenceContext:
    """Pure-torch reference of :class:`SparseAttentionContext` (the readable spec).

    Keeps, per layer and per sequence, contiguous tensors of every row and indexer key; does exact
    top-k over float32 scores with ``torch.topk`` and dense masked attention. Supports several
    sequences per forward and incremental decoding (prefill, then one token at a time)::

        ctx = DenseReferenceContext.from_config(cfg)
        pos = ctx.begin(["a", "b"], [40, 25])          # two prefills in one flat batch
        hidden = model(ids, pos, ctx)
        pos = ctx.begin(["a", "b"], [1, 1])            # one decode step of each
        ...
        ctx.free("a")

    ``selections[layer][seq_id]`` holds, after each forward, the boolean ``[n, L]`` selection of
    the sequence's tokens in that layer (for inspection in tests).
    """

    def __init__(self, num_layers: int, index_topk: int, kv_lora_rank: int,
                 layer_has_indexer: Sequence[bool] | None = None, record_selections: bool = True):
        if index_topk <= 0:
            raise ValueError(f"index_topk must be positive, got {index_topk}")
        self.num_layers = num_layers
        self.index_topk = index_topk
        self.kv_lora_rank = kv_lora_rank
        self.layer_has_indexer = (list(layer_has_indexer) if layer_has_indexer is not None
                                  else [True] * num_layers)
        if len(self.layer_has_indexer) != num_layers:
            raise ValueError(f"layer_has_indexer must have {num_layers} entries, "
                             f"got {len(self.layer_has_indexer)}")
        if num_layers and not self.layer_has_indexer[0]:
            raise ValueError("layer 0 must have an indexer (a shared layer reuses a previous one)")
        self.record_selections = record_selections
        self.rows: list[dict[Hashable, Tensor]] = [dict() for _ in range(num_layers)]
        self.index_keys: list[dict[Hashable, Tensor]] = [dict() for _ in range(num_layers)]
        self.lengths: dict[Hashable, int] = {}
        self.selections: list[dict[Hashable, Tensor]] = [dict() for _ in range(num_layers)]
        # step state
        self.seq_ids: list[Hashable] = []
        self.query_lens: list[int] = []
        self.num_tokens = 0
        self._next_layer = 0
        self._last_sel: dict[Hashable, Tensor] = {}

    @classmethod
    def from_config(cls, cfg, **kw) -> DenseReferenceContext:
        return cls(cfg.num_layers, cfg.index_topk, cfg.kv_lora_rank,
                   [cfg.layer_has_indexer(i) for i in range(cfg.num_layers)], **kw)

    # ------------------------------------------------------------------ bookkeeping
    def begin(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int],
              device: torch.device | str | None = None) -> Tensor:
        """Declare the next forward's flat batch; returns the positions ``[T]`` int64.

        A sequence not seen before starts at position 0; a known one continues where it stopped.
        """
        if len(seq_ids) != len(num_tokens):
            raise ValueError(f"seq_ids and num_tokens must have the same length, "
                             f"got {len(seq_ids)} and {len(num_tokens)}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be distinct within one forward, got {list(seq_ids)}")
        if self._next_layer not in (0, self.num_layers):
            raise RuntimeError("begin() called in the middle of a forward "
                               f"(at layer {self._next_layer})")
        pos = []
        for s, n in zip(seq_ids, num_tokens):
            if n <= 0:
                raise ValueError(f"num_tokens must be positive, got {n} for sequence {s!r}")
            start = self.lengths.get(s, 0)
            pos.append(torch.arange(start, start + n, dtype=torch.int64))
            self.lengths[s] = start + n
        self.seq_ids = list(seq_ids)
        self.query_lens = [int(n) for n in num_tokens]
        self.num_tokens = sum(self.query_lens)
        self._next_layer = 0
        self._last_sel = {}
        for sel in self.selections:
            sel.clear()
        return (torch.cat(pos).to(device) if pos
                else torch.zeros(0, dtype=torch.int64, device=device))

    def free(self, seq_id: Hashable) -> None:
        self.lengths.pop(seq_id, None)
        for per_layer in (*self.rows, *self.index_keys, *self.selections):
            per_layer.pop(seq_id, None)

    # ------------------------------------------------------------------ the contract
    def attend(self, layer_idx: int, q_latent: Tensor, kv_new: Tensor, index_q: Tensor | None,
               index_weights: Tensor | None, index_k_new: Tensor | None, sm_scale: float) -> Tensor:
        if layer_idx != self._next_layer:
            raise RuntimeError(f"attend() expected layer {self._next_layer}, got {layer_idx}")
        T = self.num_tokens
        if q_latent.shape[0] != T or kv_new.shape[0] != T:
            raise ValueError(f"expected {T} tokens (from begin()), "
                             f"got q_latent {tuple(q_latent.shape)} "
                             f"and kv_new {tuple(kv_new.shape)}")
        full = self.layer_has_indexer[layer_idx]
        if full != (index_q is not None):
            raise ValueError(f"layer {layer_idx}: index_q must be {'given' if full else 'None'} "
                             f"(layer_has_indexer={full})")
        self._next_layer = layer_idx + 1
        q_latent, kv_new = materialize(q_latent), materialize(kv_new)
        index_k_new = materialize(index_k_new)
        index_q, index_weights = materialize_queries(index_q, index_weights)
        R = self.kv_lora_rank
        out = q_latent.new_empty(T, q_latent.shape[1], R)
        start = 0
        for s, n in zip(self.seq_ids, self.query_lens):
            sl = slice(start, start + n)
            start += n
            rows = self._append(self.rows[layer_idx], s, kv_new[sl])
            L = rows.shape[0]
            if L != self.lengths[s]:
                raise RuntimeError(f"sequence {s!r}: layer {layer_idx} holds {L} rows, expected "
                                   f"{self.lengths[s]}")
            pos = torch.arange(L - n, L, device=rows.device)
            causal = torch.arange(L, device=rows.device)[None, :] <= pos[:, None]    # [n, L]
            if full:
                keys = self._append(self.index_keys[layer_idx], s, index_k_new[sl])
                sel = self._select(index_q[sl], index_weights[sl], keys, causal)
                self._last_sel[s] = sel
            else:
                sel = self._last_sel[s]
            if self.record_selections:
                self.selections[layer_idx][s] = sel
            logits = torch.einsum("nhd,ld->nhl", q_latent[sl].float(), rows.float()) * sm_scale
            logits = logits.masked_fill(~sel[:, None, :], float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            out[sl] = torch.einsum("nhl,lr->nhr", probs, rows[:, :R].float()).to(out.dtype)
        return out

    def _select(self, q: Tensor, w: Tensor, keys: Tensor, causal: Tensor) -> Tensor:
        """Boolean ``[n, L]``: the top-``index_topk`` causal positions by indexer score."""
        dots = torch.einsum("nhd,ld->nhl", q.float(), keys.float()).relu()
        scores = (w.float()[:, :, None] * dots).sum(dim=1)                          # [n, L]
        scores = scores.masked_fill(~causal, float("-inf"))
        k = min(self.index_topk, scores.shape[1])
        idx = scores.topk(k, dim=-1).indices
        sel = torch.zeros_like(causal).scatter_(1, idx, True)
        return sel & causal

    @staticmethod
    def _append(store: dict, seq_id: Hashable, new: Tensor) -> Tensor:
        old = store.get(seq_id)
        cur = new.clone() if old is None else torch.cat([old, new], dim=0)
        store[seq_id] = cur
        return cur
