"""Benchmark-only worker extensions, plugged in through the engine's one seam
``LLM(..., runner_cls=...)`` (see :mod:`hisparse.worker.model_runner`).

- :class:`SyntheticPrefillRunner`: prompt chunks get random KV rows and indexer keys instead of a
  forward (decode speed is what is measured; a 64k-token prefill per request would not fit the
  run); decode tokens run the real model; sampled prompt ends get random logits.
- ``topk_override``: ``(layer, token_slot, positions, computed_topk) -> topk`` or
  ``-> (topk, band)`` replaces the indexer's selection (e.g. a replayed trace of a real model's
  selections) and, for the hot policies that read one, its next-ranked band (``band [T, NB]``
  int32, best rank first, ``-1`` padding; ``None`` or a bare ``topk``: no band, since the
  indexer's band ranks rows of another selection). The indexer still runs (top-``k + band``)
  so its cost is counted. Must be CUDA-graph safe (fixed shapes, no host sync).
- :class:`TokenClock`: wall time of every sampled token per request, recorded by the runner (so
  the benchmark needs nothing from the engine but its public API), and per pure decode step the
  wall time between step launches and the GPU time of the step (CUDA events around it).

Usage::

    clock = TokenClock()
    llm = LLM(path, ..., runner_cls=synthetic_runner(clock=clock, topk_override=fn))
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

import torch
from torch import Tensor

from hisparse import ops
from hisparse.kv.plan import StepPlan, flat_rows
from hisparse.worker.model_runner import ModelRunner, PagedContext


class TokenClock:
    """``times[req_id]``: ``time.perf_counter()`` at each step that sampled a token for it.

    ``steps``: per step, its launch wall time, the number of requests in it, whether it was a
    pure decode step (no prompt tokens) and, on CUDA, events recorded before its first and after
    its last kernel.
    """

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)
        self.steps: list[tuple[float, int, bool, object, object]] = []

    def record(self, plan: StepPlan) -> None:
        now = time.perf_counter()
        for s in plan.seqs:
            if s.sample:
                self.times[s.req_id].append(now)

    def step(self, plan: StepPlan, launched_at: float, start, end) -> None:
        decode = not any(s.prefill for s in plan.seqs)
        self.steps.append((launched_at, len(plan.seqs), decode, start, end))

    def decode_step_stats(self, min_running: int = 1) -> dict[str, float]:
        """Steady-state decode: over steps with at least ``min_running`` requests whose
        neighbours are decode steps too (the overlapped loop waits for the previous step inside
        a step's launch interval), the mean wall ms from its launch to the next launch, the mean
        GPU ms (event to event) and the tokens per second (requests / wall). Synchronizes the
        device."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        steps = self.steps
        walls, gpus, tokens = [], [], 0
        for prev, (t0, n, decode, start, end), nxt in zip(steps, steps[1:], steps[2:]):
            if n < min_running or not (prev[2] and decode and nxt[2]):
                continue
            walls.append((nxt[0] - t0) * 1e3)
            tokens += n
            if start is not None:
                gpus.append(start.elapsed_time(end))
        mean = (lambda xs: sum(xs) / len(xs) if xs else float("nan"))
        return {"wall_ms_per_step": mean(walls), "gpu_ms_per_step": mean(gpus),
                "steady_tok_s": tokens / (sum(walls) / 1e3) if walls else float("nan"),
                "timed_steps": len(walls)}


class ReplayTopkContext(PagedContext):
    """A :class:`PagedContext` whose selections (and band) come from ``topk_override``.

    With an override, ``self.band`` is the override's band (its first ``caches.hot_band``
    columns) in a host-read forward of a hot policy that reads one (``caches.hot_band > 0``),
    else ``None``: never the indexer's band, which ranks the rows below the cut of a different
    selection."""

    topk_override = None

    def select_topk(self, layer_idx: int, index_q: Tensor, index_weights: Tensor,
                    keys: Tensor) -> Tensor:
        topk = super().select_topk(layer_idx, index_q, index_weights, keys)
        if self.topk_override is None:
            return topk
        out = self.topk_override(layer_idx, self.token_slot, self.positions, topk)
        topk, band = out if isinstance(out, tuple) else (out, None)
        nb = self.caches.hot_band
        self.band = None if band is None or nb == 0 or not self.host_read else band[:, :nb]
        return topk


class SyntheticPrefillRunner(ModelRunner):
    context_cls = ReplayTopkContext

    def __init__(self, *args, clock: TokenClock | None = None, topk_override=None, **kw) -> None:
        super().__init__(*args, **kw)
        self.clock = clock
        self.ctx.topk_override = topk_override

    def execute(self, plan: StepPlan, input_ids: list[int]):
        if self.clock is None:
            return super().execute(plan, input_ids)
        launched_at = time.perf_counter()
        start = end = None
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        out = super().execute(plan, input_ids)
        if end is not None:
            end.record()
        self.clock.record(plan)
        self.clock.step(plan, launched_at, start, end)
        return out

    def forward_eager(self, plan: StepPlan, input_ids: list[int],
                      tables: dict[str, Tensor]) -> Tensor:
        c, block_size = self.caches, self.caches.cfg.block_size
        decode, decode_ids, sample_kinds = [], [], []
        offset = 0
        for s in plan.seqs:
            if s.prefill:
                pos = torch.arange(s.start_pos, s.start_pos + s.num_tokens, device=self.device)
                kv_rows = flat_rows(tables["resident"], s.slot, pos, block_size)
                idx_rows = flat_rows(tables["indexer"], s.slot, pos, block_size)
                if c.geo.fp8:   # valid FP8 rows/keys of random values, a layer at a time
                    n, dt = len(pos), c.geo.dtype
                    for layer in range(c.arena.shape[0]):
                        ops.quantize_write_mla_rows(
                            torch.randn(n, c.geo.row_dim, device=self.device, dtype=dt),
                            c.arena[layer], kv_rows, c.geo.kv_lora_rank)
                    for i in range(c.indexer.shape[0]):
                        ops.quantize_write_index_keys(
                            torch.randn(n, c.geo.index_head_dim, device=self.device, dtype=dt),
                            c.indexer[i], idx_rows)
                else:
                    c.arena[:, kv_rows] = torch.randn(c.arena.shape[0], len(pos),
                                                      c.arena.shape[2], device=self.device,
                                                      dtype=c.arena.dtype)
                    c.indexer[:, idx_rows] = torch.randn(c.indexer.shape[0], len(pos),
                                                         c.indexer.shape[2], device=self.device,
                                                         dtype=c.indexer.dtype)
            else:
                decode.append(s)
                decode_ids += input_ids[offset:offset + s.num_tokens]
            if s.sample:
                sample_kinds.append(s.prefill)
            offset += s.num_tokens
        vocab = self.model.config.vocab_size
        logits = torch.randn(len(sample_kinds), vocab, device=self.device)
        if decode:
            real = self.forward_seqs(decode, decode_ids, tables)
            logits[torch.tensor([not k for k in sample_kinds], device=self.device)] = real
        return logits


def synthetic_runner(clock: TokenClock | None = None, topk_override=None):
    """The ``runner_cls`` to pass to :class:`~hisparse.engine.llm.LLM`."""
    return functools.partial(SyntheticPrefillRunner, clock=clock, topk_override=topk_override)
