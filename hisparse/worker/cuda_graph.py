"""CUDA-graph capture of pure decode steps (one token per request), by padded batch size.

A decode step of the eager model launches ~130 kernels per layer; on a slow host the launches,
not the GPU, set the step time. A captured step replays them in one call. Inputs live in static
buffers that each step overwrites; padding tokens carry slot ``-1`` (they write to the sink rows
and select nothing). Capture runs on padding only, so it changes no KV and no hot-buffer state.
One graph per (batch bucket, host-read or not); models with a host sync in their forward
(the MoE's expert dispatch) are not captured.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from hisparse.kv.plan import StepPlan

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.model = runner.model
        self.ctx = runner.ctx
        dev = runner.device
        cfg = runner.caches.cfg
        self.max_batch = next((b for b in BUCKETS if b >= cfg.max_num_seqs), BUCKETS[-1])
        self.ids = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((self.max_batch,), -1, dtype=torch.int32, device=dev)
        shape = (cfg.max_num_seqs, cfg.max_pages_per_request)
        self.tables = {name: torch.full(shape, -1, dtype=torch.int32, device=dev)
                       for name in ("resident", "host", "indexer")}
        self.tables["hot"] = torch.full((cfg.max_num_seqs, cfg.hot_blocks_per_request), -1,
                                        dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    def supports(self, plan: StepPlan) -> bool:
        return (self.model.cuda_graph_safe and 0 < len(plan.seqs) <= self.max_batch
                and all(s.num_tokens == 1 and s.sample and not s.prefill for s in plan.seqs))

    def run(self, plan: StepPlan, input_ids: list[int]) -> Tensor:
        """Replay the captured step for ``plan``; logits ``[n, vocab]`` fp32 in plan order."""
        n = len(plan.seqs)
        batch = next(b for b in BUCKETS if b >= n)
        host_read = any(s.host_read for s in plan.seqs)
        for name, table in (("resident", plan.resident_block_table),
                            ("host", plan.host_block_table),
                            ("indexer", plan.indexer_block_table),
                            ("hot", plan.hot_block_table)):
            self.tables[name].copy_(torch.from_numpy(table), non_blocking=True)
        slots = np.full(batch, -1, dtype=np.int32)
        slots[:n] = [s.slot for s in plan.seqs]
        positions = np.zeros(batch, dtype=np.int64)
        positions[:n] = [s.start_pos for s in plan.seqs]
        ids = np.zeros(batch, dtype=np.int64)
        ids[:n] = input_ids
        self.slots[:batch].copy_(torch.from_numpy(slots), non_blocking=True)
        self.positions[:batch].copy_(torch.from_numpy(positions), non_blocking=True)
        self.ids[:batch].copy_(torch.from_numpy(ids), non_blocking=True)
        key = (batch, host_read)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, host_read)
        graph, logits = self.graphs[key]
        graph.replay()
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
        return self.model.compute_logits(hidden)

    def _capture(self, batch: int, host_read: bool) -> tuple[torch.cuda.CUDAGraph, Tensor]:
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
