"""CUDA-graph capture of pure decode steps (one token per request), by padded batch size.

Every buffer a graph touches is allocated before any capture and never reallocated: the
inputs are the runner's :class:`~hisparse.worker.step_state.StepState` buffers (sized for the
largest bucket), the kernels' workspaces are ``KVCaches.workspace``, the sink rows are part of
the arena; each graph's logits live in its own (static) capture pool.

A decode step of the eager model launches ~130 kernels per layer; on a slow host the launches,
not the GPU, set the step time. A captured step replays them in one call. Inputs live in static
buffers that each step overwrites; padding tokens carry slot ``-1`` (they write to the sink rows
and select nothing). Capture runs on padding only, so it changes no KV and no hot-buffer state.
One graph per (batch bucket, host-read or not); models with a host sync in their forward
(the MoE's expert dispatch) are not captured. With ``hot_policy="score+prefetch"`` each layer's
prefetch copy is forked onto the runner's prefetch side stream and joined before the step ends
(:class:`~hisparse.worker.model_runner.HotPrefetcher`); its plans live in the caches' workspace.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hisparse.kv.plan import StepPlan

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.model = runner.model
        self.ctx = runner.ctx
        cfg = runner.caches.cfg
        self.max_batch = next((b for b in BUCKETS if b >= cfg.max_num_seqs), BUCKETS[-1])
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
        batch = next(b for b in BUCKETS if b >= n)
        host_read = any(s.host_read for s in plan.seqs)
        # tables were staged by the runner (changed rows only); tokens padded to the bucket
        self.inputs.stage_tokens(plan.seqs, input_ids, pad_to=batch)
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
        logits = self.model.compute_logits(hidden)
        # join the prefetch side stream inside the capture (fork/join: the copies are a
        # parallel branch of the graph that every replay completes before it ends); after the
        # LM head, which reads no hot rows, so the last layers' copies overlap it
        self.ctx.finish()
        return logits

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
