"""Continuous batching with chunked prefill over the tiered KV coordinator. No GPU work.

Each step: apply the worker's acknowledgements, continue running requests (decode tokens and
prefill chunks, oldest first), admit waiting requests FCFS while the token budget lasts, and emit
the StepPlan. When a running request cannot get a GPU page even after reclaim, the newest
running request is preempted (its KV is freed; its durable pages stay in the prefix cache).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from hisparse.config import KVCacheConfig
from hisparse.engine.request import Request, RequestStatus
from hisparse.kv.coordinator import KVCoordinator
from hisparse.kv.plan import StepPlan


class Scheduler:
    def __init__(self, cfg: KVCacheConfig) -> None:
        self.cfg = cfg
        self.kv = KVCoordinator(cfg)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_id = 0
        self.num_preempted = 0
        self.peak_running = 0

    def add(self, req: Request) -> None:
        if req.max_len > self.cfg.max_model_len:
            raise ValueError(f"request {req.req_id!r}: max_len {req.max_len} exceeds "
                             f"max_model_len {self.cfg.max_model_len}")
        self.waiting.append(req)

    def abort(self, req_id: str) -> Request | None:
        for req in self.waiting:
            if req.req_id == req_id:
                self.waiting.remove(req)
                req.status = RequestStatus.ABORTED
                return req
        for req in self.running:
            if req.req_id == req_id:
                self._leave(req, RequestStatus.ABORTED, "abort")
                return req
        return None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, acked_copy_ids: Iterable[int] = ()) -> StepPlan | None:
        """Plan the next step; None when nothing could be scheduled."""
        self.kv.apply_acks(acked_copy_ids)
        budget = self.cfg.max_num_batched_tokens
        scheduled = 0
        may_preempt = True
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or budget == 0:
                continue
            n = min(req.num_uncomputed, budget)
            if n == 0:
                continue
            while not self.kv.schedule(req.req_id, n):
                if not may_preempt:
                    break
                victim = self.running[-1]
                free_before = self.kv.num_free_gpu_blocks
                self._preempt(victim)
                # A victim with mirrors in flight frees its pages only once they are acked:
                # preempting more in this step would only throw away more work.
                if self.kv.num_free_gpu_blocks == free_before:
                    may_preempt = False
                if victim is req:
                    break
            else:
                req.num_computed += n
                budget -= n
                scheduled += 1
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv.admit(req.req_id, req.token_ids, req.max_len)
            if hit is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed = hit
            self.running.append(req)
            n = min(req.num_uncomputed, budget)
            if not self.kv.schedule(req.req_id, n):
                break
            req.num_computed += n
            budget -= n
            scheduled += 1
        self.peak_running = max(self.peak_running, len(self.running))
        if scheduled == 0:
            return None
        self.step_id += 1
        return self.kv.build_plan(self.step_id)

    def update(self, plan: StepPlan, sampled: dict[str, int],
               eos_token_ids: frozenset[int] = frozenset()) -> list[Request]:
        """Append each sampled token; return the requests that finished with it."""
        by_id = {r.req_id: r for r in self.running}
        finished = []
        for seq in plan.seqs:
            token = sampled.get(seq.req_id) if seq.sample else None
            req = by_id.get(seq.req_id)
            if token is None or req is None:
                continue
            req.token_ids.append(token)
            reason = None
            if token in req.stop_token_ids or (token in eos_token_ids and not (
                    req.sampling is not None and req.sampling.ignore_eos)):
                reason = "stop"
            elif req.num_output_tokens >= req.max_tokens or len(req.token_ids) >= req.max_len:
                reason = "length"
            if reason is not None:
                self._leave(req, RequestStatus.FINISHED, reason)
                finished.append(req)
        return finished

    def _leave(self, req: Request, status: RequestStatus, reason: str) -> None:
        self.kv.finish(req.req_id)
        self.running.remove(req)
        req.status = status
        req.finish_reason = reason

    def preempt(self, req_id: str) -> bool:
        """Preempt a running request (its KV is freed; it resumes from the prefix cache)."""
        for req in self.running:
            if req.req_id == req_id:
                self._preempt(req)
                return True
        return False

    def _preempt(self, req: Request) -> None:
        self.kv.preempt(req.req_id)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.num_preempted += 1
