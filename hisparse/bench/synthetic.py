"""Benchmark-only worker extensions, plugged in through the engine's one seam
``LLM(..., runner_cls=...)`` (see :mod:`hisparse.worker.model_runner`).

- :class:`SyntheticPrefillRunner`: prompt chunks get random KV rows and indexer keys instead of a
  forward (decode speed is what is measured; a 64k-token prefill per request would not fit the
  run); decode tokens run the real model; sampled prompt ends get random logits.
- ``topk_override``: ``(layer, token_slot, positions, computed_topk) -> topk`` replaces the
  indexer's selection (e.g. a replayed trace of a real model's selections); the indexer still
  runs so its cost is counted. Must be CUDA-graph safe (fixed shapes, no host sync).
- :class:`TokenClock`: wall time of every sampled token per request, recorded by the runner (so
  the benchmark needs nothing from the engine but its public API).

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
    """``times[req_id]``: ``time.perf_counter()`` at each step that sampled a token for it."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)

    def record(self, plan: StepPlan) -> None:
        now = time.perf_counter()
        for s in plan.seqs:
            if s.sample:
                self.times[s.req_id].append(now)


class ReplayTopkContext(PagedContext):
    """A :class:`PagedContext` whose selections come from ``topk_override``."""

    topk_override = None

    def select_topk(self, layer_idx: int, index_q: Tensor, index_weights: Tensor,
                    keys: Tensor) -> Tensor:
        topk = super().select_topk(layer_idx, index_q, index_weights, keys)
        if self.topk_override is None:
            return topk
        return self.topk_override(layer_idx, self.token_slot, self.positions, topk)


class SyntheticPrefillRunner(ModelRunner):
    context_cls = ReplayTopkContext

    def __init__(self, *args, clock: TokenClock | None = None, topk_override=None, **kw) -> None:
        super().__init__(*args, **kw)
        self.clock = clock
        self.ctx.topk_override = topk_override

    def execute(self, plan: StepPlan, input_ids: list[int]):
        out = super().execute(plan, input_ids)
        if self.clock is not None:
            self.clock.record(plan)
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
