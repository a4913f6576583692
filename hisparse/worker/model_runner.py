"""Executes StepPlans: pre-forward copies, the forward over paged tiered caches, post-forward
mirrors on a copy stream, and acknowledgements. No policy: every decision is in the plan.

Extension seam (benchmarks, experiments): ``LLM(..., runner_cls=...)`` takes a
:class:`ModelRunner` subclass (or any callable with its constructor's signature, e.g. a
``functools.partial``). A subclass may override :meth:`ModelRunner.forward_eager` (what an
eager step computes) and set ``context_cls`` to a :class:`PagedContext` subclass overriding
:meth:`PagedContext.select_topk`. Nothing benchmark-specific lives here; see
``hisparse/bench/synthetic.py``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from hisparse import ops
from hisparse.kv.plan import StepPlan, flat_rows
from hisparse.models.context import NewQuery, NewRows, materialize
from hisparse.ops import switches
from hisparse.ops.indexer import IndexerQueries
from hisparse.worker.cache import KVCaches
from hisparse.worker.cuda_graph import max_bucket
from hisparse.worker.kv_format import kv_format
from hisparse.worker.step_state import StepState


class HotPrefetcher:
    """Runs the resolver's prefetch plans (:func:`hisparse.ops.prefetch_copy`) off the critical
    path (issue 15).

    On CUDA each :meth:`launch` forks a side stream from the current stream right after the
    resolver wrote the plan (the side stream waits on an event of the current stream), copies
    the planned host rows into the hot buffer there, and :meth:`join` makes the current stream
    wait for the side stream. Inside a CUDA-graph capture this is the fork/join pattern: the
    copies become a parallel branch of the graph, joined before the captured step ends. The
    targets are hot slots no token of the step reads (:mod:`hisparse.ops.resolve`), so nothing
    in the step waits for them; the plans are per layer (layer ``l``'s copy may still read its
    plan while layer ``l + 1`` resolves) and the next step's hot resets, resolver calls and plan
    writes come after the join. On CPU (no streams) the copy runs inline, same code path."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending = False

    def launch(self, plan: Tensor, arena: Tensor, host: Tensor) -> None:
        if self.stream is None:
            ops.prefetch_copy(plan, arena, host)
            return
        self.stream.wait_stream(torch.cuda.current_stream(arena.device))     # fork
        with torch.cuda.stream(self.stream):
            ops.prefetch_copy(plan, arena, host)
        self.pending = True

    def join(self) -> None:
        """The current stream waits for every prefetch launched so far (no host sync)."""
        if self.pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)   # join
            self.pending = False


@dataclass(frozen=True)
class StagedTokens:
    """The tokens of one forward that attend through the staging area (prefill chunks whose
    history has host-only pages, issue 14; eager forwards only), fixed at :meth:`PagedContext.
    begin` for every layer: ``index`` int64 ``[S]`` their flat token indices, ``slots`` int32
    ``[S]`` their request slots, ``rest`` int64 ``[T - S]`` the indices of the other tokens."""

    index: Tensor
    slots: Tensor
    rest: Tensor

    @classmethod
    def of(cls, index: Tensor, token_slot: Tensor) -> StagedTokens:
        keep = torch.ones(token_slot.shape[0], dtype=torch.bool, device=token_slot.device)
        keep[index] = False
        return cls(index, token_slot[index], keep.nonzero().squeeze(1))


def _write(new, dst: Tensor, rows: Tensor, write_tensor) -> None:
    """This forward's new MLA rows or indexer keys into ``dst`` (one layer) at flat rows ``rows``
    int64 ``[T]``: a :class:`~hisparse.models.context.NewRows` / ``NewKeys`` writes itself (fused
    norm + RoPE (+ FP8) + write, either format); a tensor goes through the format's
    ``write_tensor(new, dst, rows)``."""
    if isinstance(new, Tensor):
        write_tensor(new, dst, rows)
    else:
        new.write(dst, rows)


def _write_rows(new, query, dst: Tensor, rows: Tensor, write_tensor) -> Tensor:
    """:func:`_write` of the MLA rows, returning the query ``q_latent`` as a tensor: a
    :class:`~hisparse.models.context.NewQuery` with :class:`~hisparse.models.context.NewRows`
    is made in the rows' launch; otherwise materialized on its own."""
    if isinstance(new, NewRows) and isinstance(query, NewQuery):
        return new.write(dst, rows, query)
    _write(new, dst, rows, write_tensor)
    return materialize(query)


class PagedContext:
    """:class:`~hisparse.models.context.SparseAttentionContext` over the paged tiered caches.

    Per layer (:meth:`attend`): write the new rows and keys, select (:meth:`select_topk`), map
    the selections to flat arena rows (:meth:`_rows`), attend. The variants compose: the cache
    format (:mod:`hisparse.worker.kv_format`) is chosen here, once; per forward, :meth:`begin`
    fixes the row source (resident rows, or, host-read, the resolver's, whose band prefetches
    run on :class:`HotPrefetcher`) and the :class:`StagedTokens`.

    Forward state (``T`` tokens): ``token_slot [T]`` int32 (``-1`` padding), ``positions [T]``
    int64, ``kv_rows`` / ``idx_rows [T]`` int64 where the new rows / keys go (the sinks for
    padding), ``topk [T, index_topk]`` int32 the last indexer layer's positions and ``band
    [T, n]`` int32 its next-ranked ones (or ``None``), all ``-1`` for none; ``tables``: int32
    block tables ``resident`` / ``host`` / ``indexer`` ``[R, P]`` and ``hot`` ``[R, H //
    block_size]``, ``-1`` none.
    """

    def __init__(self, caches: KVCaches, index_topk: int, kv_lora_rank: int) -> None:
        self.caches = caches
        self.index_topk = index_topk
        self.kv_lora_rank = kv_lora_rank
        self.block_size = caches.cfg.block_size
        self.kv_format = kv_format(caches.geo, kv_lora_rank, caches.device)
        self.prefetcher = HotPrefetcher(caches.device)
        # indexer tokens scored per program (ops.indexer_topk's ``group``): a speed hint for
        # runs of consecutive tokens of one request (speculative verify steps), never a result
        self.index_group = 1

    def begin(self, host_read: bool, tables: dict[str, Tensor], token_slot: Tensor,
              positions: Tensor, staged: Tensor | None = None) -> None:
        """Set up one forward. ``token_slot`` ``-1`` marks a padding token: it writes to the
        sink rows and selects nothing. ``host_read``: some request may miss GPU (resolver).
        ``staged``: int64 indices of the tokens whose history has host-only pages (prefill
        chunks, eager steps only): they attend through the staging area."""
        self.finish()       # a previous forward's prefetches land before this one resolves
        c, block_size = self.caches, self.block_size
        self.staged = (StagedTokens.of(staged, token_slot)
                       if staged is not None and staged.numel() else None)
        self.tables = tables
        self.token_slot = token_slot
        self.positions = positions
        self.positions_i32 = positions.int()    # once per forward, not per indexer layer
        real = token_slot >= 0
        slot_l = token_slot.clamp(min=0).long()
        self.kv_rows = torch.where(real, flat_rows(tables["resident"], slot_l, positions,
                                                   block_size),
                                   c.sink_row)
        self.idx_rows = torch.where(real, flat_rows(tables["indexer"], slot_l, positions,
                                                    block_size),
                                    c.indexer_sink_row)
        self.host_read = host_read
        self.topk: Tensor | None = None
        self.band: Tensor | None = None
        # FlashMLA FP8 decode: one scheduler metadata per forward, shared by every layer
        # (None unless FlashMLA runs)
        self.sched_meta = self.kv_format.sched_meta()

    def write_to_sinks(self) -> None:
        """After :meth:`begin`: this forward's tokens are never stored (chained draft tokens),
        their MLA rows and indexer keys go to the sink rows."""
        c = self.caches
        self.kv_rows = torch.full_like(self.kv_rows, c.sink_row)
        self.idx_rows = torch.full_like(self.idx_rows, c.indexer_sink_row)

    def attend(self, layer_idx: int, q_latent: Tensor | NewQuery, kv_new: Tensor | NewRows,
               index_q: Tensor | None, index_weights: Tensor | None,
               index_k_new: Tensor | None, sm_scale: float) -> Tensor:
        c, fmt = self.caches, self.kv_format
        arena = c.arena_layer(layer_idx)
        q_latent = _write_rows(kv_new, q_latent, arena, self.kv_rows, fmt.write_rows)
        if index_q is not None:
            keys = c.indexer_layer(layer_idx)
            _write(index_k_new, keys, self.idx_rows, fmt.write_keys)
            self.topk = self.select_topk(layer_idx, index_q, index_weights, keys)
        if self.topk is None:
            raise RuntimeError("layer 0 must own an indexer")
        rows = self._rows(layer_idx)
        if self.staged is not None:
            return self._attend_staged(layer_idx, q_latent, rows, sm_scale)
        return fmt.attention(q_latent, arena, rows, sm_scale,
                             self.sched_meta).to(q_latent.dtype)

    def _attend_staged(self, layer: int, q_latent: Tensor, rows: Tensor,
                       sm_scale: float) -> Tensor:
        """Eager step with staged tokens: the others attend over the arena as usual; the staged
        ones over the staging area, in token groups whose selected-row union fits it
        (:mod:`hisparse.ops.stage`). Per-token attention is independent, so this is exact.
        No shared scheduler metadata: the calls differ in shape."""
        c, st, fmt = self.caches, self.staged, self.kv_format
        arena = c.arena_layer(layer)
        out = q_latent.new_empty(q_latent.shape[0], q_latent.shape[1], self.kv_lora_rank)
        if st.rest.numel():
            out[st.rest] = fmt.attention(q_latent[st.rest], arena, rows[st.rest],
                                         sm_scale).to(out.dtype)
        topk = self.topk[st.index]
        resident, host = self.tables["resident"], self.tables["host"]
        for a, b in ops.stage_groups(topk, st.slots, resident.shape[1], self.block_size,
                                     c.staging.shape[0]):
            srows = ops.stage_rows(topk[a:b], st.slots[a:b], resident, host, arena,
                                   c.host_layer(layer), c.staging, self.block_size,
                                   counter=c.staged_counter)
            out[st.index[a:b]] = fmt.attention(q_latent[st.index[a:b]], c.staging, srows,
                                               sm_scale).to(out.dtype)
        return out.to(q_latent.dtype)

    def finish(self) -> None:
        """End of a forward: join the prefetch side stream (on CPU a no-op). Captured steps
        call it inside the capture; :class:`ModelRunner` also calls it after every step."""
        self.prefetcher.join()

    def select_topk(self, layer_idx: int, index_q: Tensor | IndexerQueries,
                    index_weights: Tensor | None, keys: Tensor) -> Tensor:
        """Top-k positions ``[T, index_topk]`` int32 of an indexer layer (``-1`` none, last),
        ascending (``HISPARSE_TOPK_ORDER=ranked``: by score; a band is ranked either way).
        Override point: must stay CUDA-graph safe, fixed shapes, no host sync. Sets
        :attr:`band` (the next-ranked rows in a host-read forward of a policy with a band, else
        ``None``).
        ``index_q`` may be an :class:`~hisparse.ops.indexer.IndexerQueries` (``index_weights``
        None): :func:`hisparse.ops.indexer_topk` takes it as it is."""
        k, policy_band = self.index_topk, self.caches.hot_band
        w = None if index_weights is None else index_weights.float()
        # the order of the k follows the switch in every forward (the attention sums in it: a
        # forward with host reads and one without must agree); the band is selected only where
        # the resolver reads it (the first k ranks are the same either way), and reads ranks:
        # a forward that selects one ranks, then counts its k into position order if they go
        # ascending
        ascending = switches.current().topk_order == "positions"
        band = policy_band if self.host_read else 0
        ranked = band > 0 or not ascending
        sel = ops.indexer_topk(index_q, w, keys, self.tables["indexer"],
                               self.token_slot, self.positions_i32, self.block_size, k + band,
                               workspace=self.caches.workspace.indexer,
                               group=self.index_group, ranked=ranked,
                               ascending_first=k if ranked and ascending else 0)
        # one pass: ranks k.. (sorted by score) are the hot policy's next-ranked band
        self.band = sel[:, k:] if band else None
        return sel[:, :k]

    def _rows(self, layer: int) -> Tensor:
        """Flat arena rows ``[T, index_topk]`` int32 of :attr:`topk` (``-1`` none): resident
        rows, else (host-read forwards) the resolver's resident or hot-buffer rows."""
        if not self.host_read:  # every page of every request in the batch is resident
            return ops.resident_rows(self.topk, self.tables["resident"], self.token_slot,
                                     self.block_size)
        return self._resolve(layer)

    def _resolve(self, layer: int) -> Tensor:
        """The resolver over the hot buffers (misses copied in from the host pool); with a band
        and prefetch on, its plan's copies of band rows for the next step are launched off the
        critical path."""
        c, topk, band, tables = self.caches, self.topk, self.band, self.tables
        arena, host = c.resolve_view(c.arena_layer(layer)), c.resolve_view(c.host_layer(layer))
        prefetch = c.hot_prefetch if band is not None else 0
        plan = None
        if prefetch:    # at most min(T, R) request groups in one call
            plan = c.workspace.prefetch_plan(layer, min(topk.shape[0], tables["resident"].shape[0]))
        rows = ops.resolve_rows(topk, self.token_slot, tables["resident"], tables["host"],
                                tables["hot"], c.hot_keys[layer], c.hot_lru[layer], arena, host,
                                self.block_size, c.counters, workspace=c.workspace.resolve,
                                band=band, policy=c.hot_policy, prefetch=prefetch,
                                hot_flags=c.hot_flags[layer], prefetch_plan=plan)
        if plan is not None:
            self.prefetcher.launch(plan, arena, host)
        return rows


def selection_union_sizes(topk: Tensor, groups: list[tuple[int, int]]) -> list[int]:
    """Per token group ``[a, b)`` of ``topk [T, K]`` (positions, ``-1`` none): how many
    distinct positions its tokens select together (a verify group's hot-buffer demand). One
    host sync for all groups."""
    if not groups:
        return []
    width = max(b - a for a, b in groups)
    idx = torch.tensor([[a + j if a + j < b else -1 for j in range(width)] for a, b in groups],
                       dtype=torch.long, device=topk.device)
    sel = topk[idx.clamp(min=0)].masked_fill((idx < 0)[:, :, None], -1).flatten(1)
    s = sel.sort(dim=1).values
    new = s >= 0
    new[:, 1:] &= s[:, 1:] != s[:, :-1]
    return new.sum(dim=1).tolist()


class ModelRunner:
    """Owns the model and the caches; ``execute(plan, input_ids)`` runs one step."""

    context_cls = PagedContext

    def __init__(self, model, caches: KVCaches, index_topk: int, kv_lora_rank: int,
                 enforce_eager: bool = False, num_speculative_tokens: int = 0,
                 bucketed: bool | None = None) -> None:
        self.model = model
        if hasattr(model, "finalize_weights_"):
            # the weights are final here (loaded, sharded, cast): the linears that share an
            # input become one GEMM each and the bf16-valued router gates and weights_proj
            # bf16 (narrow_fp32_weights_), before any graph is captured (engine start-up does
            # it before sizing the KV cache; this covers runners built directly)
            model.finalize_weights_()
            if not all(st.aliased() for st in model.stacks()):
                raise RuntimeError("ModelRunner: a stacked projection's parameters were "
                                   "replaced after stacking: its GEMM would read stale weights")
        self.caches = caches
        self.device = caches.device
        self.ctx = self.context_cls(caches, index_topk, kv_lora_rank)
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.in_flight: deque[tuple[int, torch.cuda.Event]] = deque()
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.row_bytes = caches.geo.row_bytes
        # False on tensor-parallel ranks > 0: the host pool is shared and rank 0 writes it.
        self.mirror_writer = True
        self.key_bytes = caches.geo.key_bytes
        cfg = caches.cfg
        k = self.num_speculative_tokens = int(num_speculative_tokens)
        # a speculative graph's bucket holds k + 1 tokens per request: the indexer scores them
        # together (each key read once for the group; the largest power of two dividing k + 1,
        # at most 4)
        self.ctx.index_group = min(4, (k + 1) & -(k + 1))
        max_tokens = max(cfg.max_num_batched_tokens, cfg.max_num_seqs,
                         max_bucket(cfg.max_num_seqs) * (k + 1))
        # persistent device step state shared by the eager path and the captured graphs
        self.inputs = StepState(cfg, self.device, max_tokens)
        self._spec: tuple | None = None     # the speculative step between its two halves
        # Captured steps: plain decode, or (speculative decoding, where every step is a
        # speculative one) the verify + MTP draft graphs.
        # ``bucketed`` (default: on CUDA, for graph-safe models): steps the graphs serve run
        # through them, captured or (``enforce_eager``) not, so a step computes the same padded
        # shapes, and so the same bits, whether it was captured or not (issue 21).
        self.graphs = None
        self.spec_graphs = None
        if bucketed is None:
            bucketed = cuda
        if bucketed and model.cuda_graph_safe:
            from hisparse.worker.cuda_graph import DecodeGraphs, SpecGraphs
            capture = cuda and not enforce_eager
            if k:
                self.spec_graphs = SpecGraphs(self, k, capture=capture)
            else:
                self.graphs = DecodeGraphs(self, capture=capture)

    def _copy(self, src: Tensor, dst: Tensor, rows: tuple[Tensor, Tensor]) -> None:
        src_rows, dst_rows = rows
        if src_rows.numel() and src.shape[0]:
            ops.copy_rows(src, dst, src_rows, dst_rows)

    def _own(self, rows: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Copies of row lists (on the current stream) that the copy stream may read after the
        next step's upload overwrote the staging buffer."""
        owned = tuple(r.clone() for r in rows)
        for r in owned:
            r.record_stream(self.copy_stream)
        return owned

    @torch.inference_mode()
    def execute(self, plan: StepPlan, input_ids: list[int]) -> tuple[Tensor, list[int]]:
        """Run ``plan``; return logits ``[n, vocab]`` fp32 of its sampling sequences (in plan
        order) and the copy ids acknowledged since the last call."""
        # No wait on in-flight mirrors here: a GPU block is handed out again only after the
        # mirror that reads it was acknowledged (clean pages; finished requests drain first),
        # and acknowledgements come from completed events.
        inputs = self.inputs
        self._before_forward(plan)
        if self.graphs is not None and self.graphs.supports(plan):
            logits = self.graphs.run(plan, input_ids)
        else:
            logits = self.forward_eager(plan, input_ids, inputs.tables)
        self.ctx.finish()       # prefetch copies joined before anything after the step
        self._mirror(plan)
        return logits, self._poll_acks()

    def copy_only(self, plan: StepPlan) -> list[int]:
        """A plan without sequences: its copies only (the restores of landed remote prompts);
        returns the copy ids acknowledged since the last call."""
        self._before_forward(plan)
        self._mirror(plan)
        return self._poll_acks()

    def _before_forward(self, plan: StepPlan) -> None:
        """Stage the plan (changed table rows, resets, row lists: one pinned upload), reset the
        hot buffers it names and run its restores (host -> GPU rows and indexer keys)."""
        c, inputs = self.caches, self.inputs
        self.ctx.finish()       # (no-op normally: every step joins its prefetches)
        inputs.stage_plan(plan)
        if len(plan.hot_resets):
            c.reset_hot(inputs.hot_resets)
        self._copy(c.host, c.arena, inputs.copies["restores"])
        c.copy_keys(c.host_indexer, c.indexer, *inputs.copies["indexer_restores"])
        self.h2d_bytes += len(plan.restores) * self.row_bytes * c.geo.num_layers
        self.h2d_bytes += len(plan.indexer_restores) * self.key_bytes * c.indexer.shape[0]

    def forward_eager(self, plan: StepPlan, input_ids: list[int],
                      tables: dict[str, Tensor]) -> Tensor:
        """An eager (not captured) step: logits ``[n_sample, vocab]`` fp32 of the plan's
        sampling sequences, in plan order. Override point for benchmarks."""
        return self.forward_seqs(plan.seqs, input_ids, tables)

    def forward_seqs(self, seqs, input_ids: list[int], tables: dict[str, Tensor]) -> Tensor:
        """Model forward over ``seqs`` (tokens ``input_ids``); logits of the sampling ones."""
        inputs = self.inputs
        T, S = inputs.stage_tokens(seqs, input_ids)
        pos_t = inputs.positions[:T]
        self.ctx.begin(any(s.host_read for s in seqs), tables, inputs.slots[:T], pos_t,
                       self._staged_tokens(seqs))
        hidden = self.model(inputs.ids[:T], pos_t, self.ctx)
        if not S:
            self.ctx.finish()
            return hidden.new_zeros(0, 0).float()
        logits = self.model.compute_logits(hidden[inputs.sample_idx[:S]])
        self.ctx.finish()   # after the LM head (no hot rows read): the copies overlap it
        return logits

    def _staged_tokens(self, seqs) -> Tensor | None:
        """Flat indices of the tokens of staged sequences (prefill chunks whose history has
        host-only pages: they attend through the staging area, issue 14), or None."""
        if not any(s.staged for s in seqs):
            return None
        ranges, off = [], 0
        for s in seqs:
            if s.staged:
                ranges.append(torch.arange(off, off + s.num_tokens, device=self.device))
            off += s.num_tokens
        return torch.cat(ranges)

    # ------------------------------------------------------------------ speculative (MTP)
    @torch.inference_mode()
    def spec_forward(self, plan: StepPlan, input_ids: list[int],
                     num_logits: list[int]) -> tuple[Tensor, list[int]]:
        """The verify forward of a speculative step (no mirrors yet: call :meth:`spec_draft`
        next, which mirrors). ``num_logits[i]``: how many trailing tokens of the i-th sampling
        sequence need logits (its drafts + 1). Returns those logits ``[sum(num_logits),
        vocab]`` fp32 (plan order, position order; with CUDA graphs possibly a view of a static
        buffer, valid until the next forward) and, per verify group (a sampling sequence with
        drafts), the size of the union of its tokens' selections in the last indexer layer
        of the main model. Replays :class:`~hisparse.worker.cuda_graph.SpecGraphs` when they
        serve the plan, else runs eagerly."""
        inputs = self.inputs
        self._before_forward(plan)
        host_read = any(s.host_read for s in plan.seqs)
        graphs = self.spec_graphs
        batch = staged = None
        if graphs is not None and graphs.supports(plan):
            T, batch, host_read = graphs.verify(plan, input_ids)
            hidden, all_logits, topk = graphs.hidden[:T], graphs.logits[:T], graphs.topk[:T]
        else:
            T, _ = inputs.stage_tokens(plan.seqs, input_ids)
            pos_t = inputs.positions[:T]
            staged = self._staged_tokens(plan.seqs)
            self.ctx.begin(host_read, inputs.tables, inputs.slots[:T], pos_t, staged)
            hidden = self.model(inputs.ids[:T], pos_t, self.ctx)
            self.ctx.finish()
            all_logits, topk = None, self.ctx.topk
        rows, groups, end, i = [], [], 0, 0
        for seq in plan.seqs:
            end += seq.num_tokens
            if seq.sample:
                n = num_logits[i]
                i += 1
                rows.extend(range(end - n, end))
                if n > 1:
                    groups.append((end - n, end))
        unions = selection_union_sizes(topk, groups) if topk is not None else []
        self._spec = (plan, T, hidden, host_read, staged, batch)
        if all_logits is not None and len(rows) == T:     # every token verifies (the rule)
            return all_logits, unions
        idx = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        if all_logits is not None:
            return all_logits[idx], unions
        return self.model.compute_logits(hidden[idx]), unions

    @torch.inference_mode()
    def spec_draft(self, next_ids: list[int], draft_rows: list[int], num_drafts: int,
                   sample_draft) -> list[int]:
        """The MTP stage of the step :meth:`spec_forward` ran, then its mirrors.

        MTP layer 0 runs over the step's tokens (same positions and slots): token ``t`` at
        position ``q`` combines the main model's hidden at ``q`` with ``next_ids[t]``, the token
        at ``q + 1`` (accepted or sampled; anything for rejected positions, whose rows are
        rolled back). This writes the MTP layer's KV rows (cache layer ``num_layers``) of every
        computed position. The first draft of sampling sequence ``i`` comes from the MTP output
        at flat token ``draft_rows[i]`` (its last accepted position); drafts ``2..num_drafts``
        chain the MTP layer on its own output and draft, one token per request: such a token
        attends to the MTP history up to the last accepted position and its KV row goes to the
        sink (draft-only tokens are never stored). ``sample_draft(logits [S, vocab], j)`` ->
        int64 ``[S]`` draft tokens (``logits`` may be a static buffer the next draft pass
        overwrites: keep what it computes, not ``logits``). Returns the copy ids acknowledged
        since the last call. Replays the draft graphs when the verify forward was replayed."""
        plan, T, hidden, host_read, staged, batch = self._spec
        self._spec = None
        if batch is not None:
            self.spec_graphs.draft(plan, next_ids, draft_rows, num_drafts, sample_draft,
                                   batch, host_read)
        else:
            self._spec_draft_eager(next_ids, draft_rows, num_drafts, sample_draft, T, hidden,
                                   host_read, staged)
        self.ctx.finish()
        self._mirror(plan)
        return self._poll_acks()

    def _spec_draft_eager(self, next_ids: list[int], draft_rows: list[int], num_drafts: int,
                          sample_draft, T: int, hidden: Tensor, host_read: bool,
                          staged: Tensor | None) -> None:
        inputs, model = self.inputs, self.model
        dev = hidden.device
        slots, pos_t = inputs.slots[:T], inputs.positions[:T]
        ids = torch.tensor(next_ids, dtype=torch.long, device=dev)
        self.ctx.begin(host_read, inputs.tables, slots, pos_t, staged)
        h = model.mtp_forward(ids, hidden, pos_t, self.ctx)
        if not draft_rows or num_drafts == 0:
            return
        rows = torch.tensor(draft_rows, dtype=torch.long, device=dev)
        h, d_slots, d_pos = h[rows], slots[rows], pos_t[rows]
        # Drafts of a staged sequence (its last prefill chunk sampled) read its spilled
        # history through the staging area too.
        d_staged = None
        if staged is not None:
            d_staged = torch.isin(rows, staged).nonzero().squeeze(1)
        tok = sample_draft(model.mtp_logits(h), 0)
        for j in range(1, num_drafts):
            self.ctx.begin(host_read, inputs.tables, d_slots, d_pos, d_staged)
            self.ctx.write_to_sinks()
            h = model.mtp_forward(tok, h, d_pos, self.ctx, rope_positions=d_pos + j)
            tok = sample_draft(model.mtp_logits(h), j)

    def commit_sampled(self, tokens: Tensor) -> None:
        """The tokens sampled from the last :meth:`execute`'s logits (device, plan order): the
        inputs of the next step's decode tokens whose ids the host does not know yet."""
        self.inputs.commit_sampled(tokens)

    def _mirror(self, plan: StepPlan) -> None:
        if not (len(plan.mirrors) or len(plan.indexer_mirrors)) or not self.mirror_writer:
            return
        c = self.caches
        n = len(plan.mirrors)
        self.d2h_bytes += n * (self.row_bytes * c.geo.num_layers
                               + self.key_bytes * c.indexer.shape[0])
        copies = self.inputs.copies
        if self.copy_stream is None:
            self._copy(c.arena, c.host, copies["mirrors"])
            c.copy_keys(c.indexer, c.host_indexer, *copies["indexer_mirrors"])
            self.in_flight.append((plan.mirrors.copy_id, None))
            return
        rows, idx_rows = self._own(copies["mirrors"]), self._own(copies["indexer_mirrors"])
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            self._copy(c.arena, c.host, rows)
            c.copy_keys(c.indexer, c.host_indexer, *idx_rows)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self.in_flight.append((plan.mirrors.copy_id, event))

    def _poll_acks(self) -> list[int]:
        """Copy ids whose mirrors completed (non-blocking on CUDA)."""
        done = []
        while self.in_flight and (self.in_flight[0][1] is None or self.in_flight[0][1].query()):
            done.append(self.in_flight.popleft()[0])
        return done

    def drain(self) -> list[int]:
        """Wait for every in-flight mirror; return their copy ids."""
        done = []
        while self.in_flight:
            copy_id, event = self.in_flight.popleft()
            if event is not None:
                event.synchronize()
            done.append(copy_id)
        return done

    @property
    def staged_rows(self) -> int:
        """Host-only rows prefill chunks read through the staging area, summed over layers."""
        return int(self.caches.staged_counter.item())

    def hot_counters(self) -> tuple[int, int]:
        hits, misses = self.caches.counters[:2].tolist()
        return int(hits), int(misses)

    def topk_stalls(self) -> int:
        """Row barriers of the one-launch top-k that gave up waiting (``TopkScratch.stalls``;
        never expected: a give-up means that layer's selection may not be exact)."""
        return int(self.caches.workspace.indexer.topk.stalls.item())
