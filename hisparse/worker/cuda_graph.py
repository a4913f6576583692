"""CUDA-graph capture of decode steps, by padded batch size: plain decode (one token per
request, :class:`DecodeGraphs`) and MTP speculative steps (``k + 1`` tokens per request plus
the MTP drafts, :class:`SpecGraphs`).

Every buffer a graph touches is allocated before any capture and never reallocated: the
inputs are the runner's :class:`~hisparse.worker.step_state.StepState` buffers (sized for the
largest bucket), the kernels' workspaces are ``KVCaches.workspace``, the sink rows are part of
the arena; each decode graph's logits live in its own (static) capture pool, the speculative
graphs' inputs and outputs in :class:`SpecGraphs`' own static buffers.

A decode step of the eager model launches ~130 kernels per layer; on a slow host the launches,
not the GPU, set the step time. A captured step replays them in one call. Inputs live in static
buffers that each step overwrites; padding tokens carry slot ``-1`` (they write to the sink rows
and select nothing). Capture runs on padding only, so it changes no KV and no hot-buffer state.
One graph per (batch bucket, host-read or not); models with a host sync in their forward
(the MoE's expert dispatch) are not captured.

``capture=False`` runs the same bodies eagerly at every step, over the same static buffers and
the same padded bucket layout (the engine's ``enforce_eager`` on CUDA, and the tests' stand-in
for a capture on CPU). A captured step and an eager one then compute the same shapes, so their
results are bitwise equal: kernels whose rounding depends on the row count (cuBLAS picks its
GEMM by M) otherwise make a padded graph step and an unpadded eager step of the same batch
differ in the last bits, which flips near-tie indexer ranks and with them the ``score``
policy's hot-buffer state (issue 21). With ``hot_policy="score+prefetch"`` each layer's
prefetch copy is forked onto the runner's prefetch side stream and joined before the step ends
(:class:`~hisparse.worker.model_runner.HotPrefetcher`); its plans live in the caches' workspace.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from torch import Tensor

from hisparse.kv.plan import StepPlan, token_layout
from hisparse.worker.step_state import _Staging

# Steps of 8 to 64, then 16 to 128 (at most 1/4 padding up to 128 requests): a padding token
# still takes its share of the fused top-k's programs (rows x splits fill the GPU) and of the
# attention's and the MoE's launch. On the real rank 33 requests padded to 48 took 35.1 ms a
# step against 31.2 for 31 padded to 32 (docs/BENCHMARKS.md, "Tenth session"). Past 128 the
# old steps stay: each decode graph keeps its own memory pool (its logits and activations,
# outside the KV sizing), and the buckets' sum grows 18% over the former list, not 84%.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 192, 256, 384, 512)


def spec_graph_bytes(max_num_seqs: int, num_speculative_tokens: int, vocab: int,
                     hidden_size: int) -> int:
    """GPU bytes :class:`SpecGraphs` needs beyond the KV pools, for sizing them from free
    memory: its fp32 verify and draft logits and the hidden states (exact), plus an estimate
    of the graphs' activation pool (a forward of ``bucket x (k + 1)`` tokens: the LM head's
    logits once more and 64 hidden-sized bf16 buffers per token)."""
    B = max_bucket(max_num_seqs)
    T = B * (num_speculative_tokens + 1)
    static = (T + B) * vocab * 4 + (T + B) * hidden_size * 2
    activations = T * vocab * 4 + T * hidden_size * 2 * 64
    return static + activations


def max_bucket(max_num_seqs: int) -> int:
    """The largest batch bucket captured for ``max_num_seqs`` requests: the smallest bucket
    that holds them all, at most ``BUCKETS[-1]`` (larger batches run eagerly)."""
    return next((b for b in BUCKETS if b >= max_num_seqs), BUCKETS[-1])


def bucket_for(n: int) -> int:
    """The bucket a batch of ``n`` (``1 <= n <= BUCKETS[-1]``) requests replays: the smallest
    that holds it."""
    if not 1 <= n <= BUCKETS[-1]:
        raise ValueError(f"no batch bucket for {n} requests (1..{BUCKETS[-1]})")
    return next(b for b in BUCKETS if b >= n)


class DecodeGraphs:
    """Plain decode steps (one token per request) per ``(bucket, host_read)``: captured CUDA
    graphs, or with ``capture=False`` the same bodies run eagerly (module docstring)."""

    def __init__(self, runner, capture: bool = True) -> None:
        self.runner = runner
        self.capture = capture
        self.model = runner.model
        self.ctx = runner.ctx
        cfg = runner.caches.cfg
        self.max_batch = max_bucket(cfg.max_num_seqs)
        # the runner's persistent step state: the eager path and every graph share it
        inputs = runner.inputs
        self.inputs = inputs
        self.ids, self.positions, self.slots = inputs.ids, inputs.positions, inputs.slots
        self.tables = inputs.tables
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    def supports(self, plan: StepPlan) -> bool:
        return (self.model.cuda_graph_safe and 0 < len(plan.seqs) <= self.max_batch
                and all(s.num_tokens == 1 and s.sample and not s.prefill for s in plan.seqs))

    def run(self, plan: StepPlan, input_ids: list[int]) -> Tensor:
        """Replay the captured step for ``plan``; logits ``[n, vocab]`` fp32 in plan order."""
        n = len(plan.seqs)
        batch = bucket_for(n)
        host_read = any(s.host_read for s in plan.seqs)
        # tables were staged by the runner (changed rows only); tokens padded to the bucket
        self.inputs.stage_tokens(plan.seqs, input_ids, pad_to=batch)
        key = (batch, host_read)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, host_read)
        graph, logits = self.graphs[key]
        graph.replay()
        if logits is None:          # not captured: this run's own logits
            logits = graph.result
        return logits[:n]

    @torch.inference_mode()
    def capture_all(self, host_read_variants: tuple[bool, ...] = (False, True)) -> None:
        """Capture every batch bucket up front (keeps capture time out of measurements)."""
        for batch in BUCKETS:
            if batch > self.max_batch:
                break
            for host_read in host_read_variants:
                if (batch, host_read) not in self.graphs:
                    self.graphs[(batch, host_read)] = self._capture(batch, host_read)

    def _body(self, batch: int, host_read: bool) -> Tensor:
        self.ctx.begin(host_read, self.tables, self.slots[:batch], self.positions[:batch])
        hidden = self.model(self.ids[:batch], self.positions[:batch], self.ctx)
        logits = self.model.compute_logits(hidden)
        # join the prefetch side stream inside the capture (fork/join: the copies are a
        # parallel branch of the graph that every replay completes before it ends); after the
        # LM head, which reads no hot rows, so the last layers' copies overlap it
        self.ctx.finish()
        return logits

    def _capture(self, batch: int, host_read: bool
                 ) -> tuple[torch.cuda.CUDAGraph | _Rerun, Tensor | None]:
        if not self.capture:
            return _Rerun(lambda: self._body(batch, host_read)), None
        # Capture on padding only: the real inputs are copied in before each replay.
        saved = (self.slots.clone(), self.positions.clone(), self.ids.clone())
        self.slots.fill_(-1)
        self.positions.zero_()
        self.ids.zero_()
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            self._body(batch, host_read)  # compiles kernels, creates scratch buffers
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._body(batch, host_read)
        self.slots.copy_(saved[0])
        self.positions.copy_(saved[1])
        self.ids.copy_(saved[2])
        return graph, logits


class _Rerun:
    """A step body run eagerly in place of a captured graph (``capture=False``): a replay runs
    the body again; :attr:`result` holds what the last run returned. Graph bodies read and
    write only static buffers, so the data flow between staging, graphs and the code around
    them is the captured one's."""

    def __init__(self, body) -> None:
        self.body = body
        self.result = None

    def replay(self) -> None:
        self.result = self.body()


class SpecGraphs:
    """MTP speculative steps (``k = num_speculative_tokens``) captured per batch bucket ``B``
    and host-read variant: up to three graphs per ``(B, host_read)``, replayed in this order
    in every step they serve (a plan whose sequences all decode: ``1..k + 1`` tokens each,
    sampled, no prefill, at most :attr:`max_batch` of them):

    - ``"verify"``: the main model over ``B * (k + 1)`` token slots (the plan's tokens, a
      request's tokens consecutive so they resolve through its hot buffer as one group, then
      padding) and the LM head -> :attr:`logits`, :attr:`hidden` and :attr:`topk` (the last
      indexer layer's selections) of every token;
    - ``"draft"``: the MTP layer over the same tokens (:attr:`next_ids`: each token's next
      token, known once the step is verified), which writes the MTP layer's KV rows, and the
      first drafts' logits at :attr:`draft_rows` (one row per request) -> :attr:`draft_logits`;
      :attr:`draft_hidden` keeps those rows' MTP hidden states;
    - ``"chain"`` (``k >= 2``): one chained draft pass, one token per request
      (:attr:`draft_tokens` at :attr:`draft_pos` of slot :attr:`draft_slots`, RoPE at
      :attr:`rope_pos`, its KV rows to the sinks), replayed ``k - 1`` times; it reads and
      rewrites :attr:`draft_hidden` and writes :attr:`draft_logits`.

    Drafts are sampled eagerly between replays (seeded requests draw from host-seeded
    generators). Everything a graph reads or writes is allocated here (or in the runner's
    step state and the caches) for the largest bucket before any capture, and never
    reallocated (DESIGN section 7). A capture runs on padding only (slot ``-1``: no KV, no
    hot-buffer state changes) and may happen lazily in the middle of a step: the step's
    staged inputs are saved and restored around it. The graphs share one memory pool; no
    graph's output lives in it (outputs go to the static buffers), so any replay order is
    safe. ``capture=False`` (``enforce_eager`` on CUDA; tests without CUDA) replaces each
    captured graph by a re-run of its body (:class:`_Rerun`), after the same warm-up run on
    padding a capture makes.
    """

    def __init__(self, runner, num_speculative_tokens: int, capture: bool = True) -> None:
        k = int(num_speculative_tokens)
        if k < 1:
            raise ValueError(f"SpecGraphs needs num_speculative_tokens >= 1, got {k}")
        self.runner = runner
        self.model = runner.model
        self.ctx = runner.ctx
        self.k, self.k1 = k, k + 1
        self.capture = capture
        cfg = runner.caches.cfg
        self.max_batch = B = max_bucket(cfg.max_num_seqs)
        T = B * self.k1
        if runner.inputs.max_tokens < T:
            raise ValueError(f"SpecGraphs: the step state holds {runner.inputs.max_tokens} "
                             f"tokens, the largest bucket needs {B} x {self.k1} = {T}")
        dev, dtype = runner.device, self.model.dtype
        hidden_size = self.model.config.hidden_size
        vocab = self.model.config.vocab_size
        self.logits = torch.zeros(T, vocab, dtype=torch.float32, device=dev)
        self.hidden = torch.zeros(T, hidden_size, dtype=dtype, device=dev)
        self.topk = torch.full((T, self.ctx.index_topk), -1, dtype=torch.int32, device=dev)
        self.next_ids = torch.zeros(T, dtype=torch.long, device=dev)
        self.draft_rows = torch.zeros(B, dtype=torch.long, device=dev)
        self.draft_slots = torch.full((B,), -1, dtype=torch.int32, device=dev)
        self.draft_pos = torch.zeros(B, dtype=torch.long, device=dev)
        self.rope_pos = torch.zeros(B, dtype=torch.long, device=dev)
        self.draft_tokens = torch.zeros(B, dtype=torch.long, device=dev)
        self.draft_hidden = torch.zeros(B, hidden_size, dtype=dtype, device=dev)
        self.draft_logits = torch.zeros(B, vocab, dtype=torch.float32, device=dev)
        self._staging = _Staging(dev, T + 3 * B)
        inputs = runner.inputs
        # (buffer, padding value): what a capture saves, pads and restores
        self._capture_inputs = ((inputs.ids, 0), (inputs.positions, 0), (inputs.slots, -1),
                                (self.next_ids, 0), (self.draft_rows, 0),
                                (self.draft_slots, -1), (self.draft_pos, 0),
                                (self.rope_pos, 0), (self.draft_tokens, 0),
                                (self.draft_hidden, None))
        self.kinds = ("verify", "draft") + (("chain",) if k >= 2 else ())
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[tuple[str, int, bool], torch.cuda.CUDAGraph | _Rerun] = {}
        self.replays: Counter[str] = Counter()     # per kind (tests, stats)

    def data_ptrs(self) -> tuple[int, ...]:
        """Addresses of every static buffer (tests check they never change)."""
        return tuple(t.data_ptr() for t in (
            self.logits, self.hidden, self.topk, self.next_ids, self.draft_rows,
            self.draft_slots, self.draft_pos, self.rope_pos, self.draft_tokens,
            self.draft_hidden, self.draft_logits, *self.runner.inputs.tables.values(),
            self.runner.inputs.ids, self.runner.inputs.positions, self.runner.inputs.slots))

    def supports(self, plan: StepPlan) -> bool:
        return (self.model.cuda_graph_safe and 0 < len(plan.seqs) <= self.max_batch
                and all(s.sample and not s.prefill and not s.staged
                        and 1 <= s.num_tokens <= self.k1 for s in plan.seqs))

    # ------------------------------------------------------------------ one step
    def verify(self, plan: StepPlan, input_ids: list[int]) -> tuple[int, int, bool]:
        """Stage the plan's tokens (padded to the bucket) and replay its verify graph (the
        runner staged the plan's tables and ran its restores). Returns ``(num_tokens,
        bucket, host_read)``; the outputs are in :attr:`logits`, :attr:`hidden`,
        :attr:`topk` (first ``num_tokens`` rows)."""
        batch = bucket_for(len(plan.seqs))
        host_read = any(s.host_read for s in plan.seqs)
        T, _ = self.runner.inputs.stage_tokens(plan.seqs, input_ids, pad_to=batch * self.k1)
        self._replay("verify", batch, host_read)
        return T, batch, host_read

    def draft(self, plan: StepPlan, next_ids: list[int], draft_rows: list[int],
              num_drafts: int, sample_draft, batch: int, host_read: bool) -> None:
        """The MTP stage after :meth:`verify` (same plan, bucket and variant; the step state
        still holds its tokens): ``next_ids`` per token, ``draft_rows`` (flat token of each
        sampling sequence's last accepted position), then ``num_drafts`` drafts, sampled by
        ``sample_draft(logits [S, vocab], j) -> int64 [S]`` (semantics of
        :meth:`~hisparse.worker.model_runner.ModelRunner.spec_draft`)."""
        T, S = len(next_ids), len(draft_rows)
        n = batch * self.k1
        if num_drafts > self.k or T > n or S > batch:
            raise ValueError(f"SpecGraphs.draft: {T} tokens, {S} drafting rows, {num_drafts} "
                             f"drafts do not fit bucket {batch} with k = {self.k}")
        positions, slots, _ = token_layout(plan.seqs)
        rows = np.asarray(draft_rows, dtype=np.int64)
        buf = self._staging.begin(n + 3 * batch)
        buf[:T] = next_ids
        buf[T:n] = 0
        d = buf[n:].reshape(3, batch)      # rows, slots, positions; padding rows: slot -1
        d[0, :S], d[0, S:] = rows, 0
        d[1, :S], d[1, S:] = slots[rows], -1
        d[2, :S], d[2, S:] = positions[rows], 0
        dev = self._staging.upload(n + 3 * batch)
        self.next_ids[:n].copy_(dev[:n])
        dev = dev[n:].view(3, batch)
        self.draft_rows[:batch].copy_(dev[0])
        self.draft_slots[:batch].copy_(dev[1])
        self.draft_pos[:batch].copy_(dev[2])
        self._replay("draft", batch, host_read)
        if num_drafts == 0 or S == 0:
            return
        tok = sample_draft(self.draft_logits[:S], 0)
        for j in range(1, num_drafts):
            self.draft_tokens[:S].copy_(tok)
            torch.add(self.draft_pos[:batch], j, out=self.rope_pos[:batch])
            self._replay("chain", batch, host_read)
            tok = sample_draft(self.draft_logits[:S], j)

    @torch.inference_mode()
    def capture_all(self, host_read_variants: tuple[bool, ...] = (False, True)) -> None:
        """Capture every bucket up front, ascending, each (bucket, variant)'s graphs in the
        order a step replays them."""
        for batch in BUCKETS:
            if batch > self.max_batch:
                break
            for host_read in host_read_variants:
                for kind in self.kinds:
                    if (kind, batch, host_read) not in self.graphs:
                        self.graphs[(kind, batch, host_read)] = self._capture(kind, batch,
                                                                              host_read)

    # ------------------------------------------------------------------ graph bodies
    def _replay(self, kind: str, batch: int, host_read: bool) -> None:
        key = (kind, batch, host_read)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(kind, batch, host_read)
        graph.replay()
        self.replays[kind] += 1

    def _verify_body(self, batch: int, host_read: bool) -> None:
        n, inputs = batch * self.k1, self.runner.inputs
        pos = inputs.positions[:n]
        self.ctx.begin(host_read, inputs.tables, inputs.slots[:n], pos)
        hidden = self.model(inputs.ids[:n], pos, self.ctx)
        self.hidden[:n].copy_(hidden)
        self.topk[:n].copy_(self.ctx.topk)
        self.logits[:n].copy_(self.model.compute_logits(hidden))
        self.ctx.finish()       # after the LM head: the prefetch copies overlap it

    def _draft_body(self, batch: int, host_read: bool) -> None:
        n, inputs = batch * self.k1, self.runner.inputs
        pos = inputs.positions[:n]
        self.ctx.begin(host_read, inputs.tables, inputs.slots[:n], pos)
        h = self.model.mtp_forward(self.next_ids[:n], self.hidden[:n], pos, self.ctx)
        h = h.index_select(0, self.draft_rows[:batch])
        self.draft_hidden[:batch].copy_(h)
        self.draft_logits[:batch].copy_(self.model.mtp_logits(h))
        self.ctx.finish()

    def _chain_body(self, batch: int, host_read: bool) -> None:
        ctx = self.ctx
        pos = self.draft_pos[:batch]
        ctx.begin(host_read, self.runner.inputs.tables, self.draft_slots[:batch], pos)
        ctx.write_to_sinks()    # a draft-only token is never stored
        h = self.model.mtp_forward(self.draft_tokens[:batch], self.draft_hidden[:batch], pos,
                                   ctx, rope_positions=self.rope_pos[:batch])
        self.draft_logits[:batch].copy_(self.model.mtp_logits(h))
        self.draft_hidden[:batch].copy_(h)
        ctx.finish()

    def _capture(self, kind: str, batch: int, host_read: bool):
        body = {"verify": self._verify_body, "draft": self._draft_body,
                "chain": self._chain_body}[kind]
        saved = [t.clone() for t, _ in self._capture_inputs]
        for t, pad in self._capture_inputs:
            if pad is not None:
                t.fill_(pad)
        try:
            if not self.capture:
                body(batch, host_read)          # the warm-up run a capture makes
                return _Rerun(lambda: body(batch, host_read))
            dev = self.runner.device
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                body(batch, host_read)          # compiles kernels, creates scratch buffers
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                body(batch, host_read)
            return graph
        finally:
            for (t, _), s in zip(self._capture_inputs, saved):
                t.copy_(s)
