"""Continuous batching with chunked prefill over the tiered KV coordinator. No GPU work.

Each step: apply the worker's acknowledgements, continue running requests (decode tokens and
prefill chunks, oldest first), admit waiting requests FCFS while the token budget lasts, and emit
the StepPlan. When a running request cannot get a GPU page even after reclaim, the newest
running request is preempted (its KV is freed; its durable pages stay in the prefix cache).

Progress (``num_computed``) is owned by the KV core; the scheduler reads it through each
request's KV handle (``Request.kv``).

Overlapped steps: the engine may plan step n+1 before step n's sampled tokens are back. A token
that a planned step samples is *pending* (``RequestKV.num_pending_tokens``) until
:meth:`Scheduler.update` appends it; the next step may already compute it (its id comes from the
device). A request whose pending tokens will end it by length is not scheduled again, and results
for a request that finished, was aborted or was preempted after the plan are dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hisparse.config import KVCacheConfig
from hisparse.engine.request import Request, RequestStatus
from hisparse.kv.coordinator import KVCoordinator
from hisparse.kv.plan import StepPlan
from hisparse.kv.state import RequestKV
from hisparse.kv.transfer_plan import LoadJob


@dataclass
class StepUpdate:
    """What one step's sampled tokens did: requests that got a token (still running or not),
    those that finished with it (``finish_reason`` set), and those whose sampling failed
    (finished with ``finish_reason="error"``)."""

    progressed: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, cfg: KVCacheConfig) -> None:
        self.cfg = cfg
        self.kv = KVCoordinator(cfg)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # admission order (the newest is preempted)
        self._running_by_id: dict[str, Request] = {}
        self.step_id = 0
        # Per planned step: the requests of its sampling sequences (plan order) and their KV
        # handles at plan time (parallel lists).
        self._samplers: dict[int, tuple[list[Request], list[RequestKV]]] = {}
        self.num_preempted = 0
        self.peak_running = 0
        # Disaggregation (decode side): requests whose prompt KV is being pulled, by id, and
        # the loads admitted since the last take_loads().
        self.loading: dict[str, Request] = {}
        self._new_loads: list[LoadJob] = []

    def add(self, req: Request) -> None:
        if req.max_len > self.cfg.max_model_len:
            raise ValueError(f"request {req.req_id!r}: max_len {req.max_len} exceeds "
                             f"max_model_len {self.cfg.max_model_len}")
        self.waiting.append(req)

    def abort(self, req_id: str) -> Request | None:
        """Drop a waiting or running request (status ABORTED); None if it is unknown. A request
        whose KV is being pulled is ABORTED now and leaves when the worker reports its load
        ended (:meth:`load_finished`; blocks a READ in flight may still write stay
        quarantined)."""
        req = self._running_by_id.get(req_id)
        if req is not None:
            self._leave(req, RequestStatus.ABORTED, "abort")
            return req
        req = self.loading.get(req_id)
        if req is not None:
            req.status = RequestStatus.ABORTED
            req.finish_reason = "abort"
            return req
        for req in self.waiting:
            if req.req_id == req_id:
                self.waiting.remove(req)
                req.status = RequestStatus.ABORTED
                return req
        return None

    def finish(self, req_id: str, reason: str = "stop") -> Request | None:
        """Finish a running request now (status FINISHED); None if it is not running."""
        req = self._running_by_id.get(req_id)
        if req is not None:
            self._leave(req, RequestStatus.FINISHED, reason)
        return req

    def preempt(self, req_id: str) -> bool:
        """Preempt a running request: its KV is freed and it goes back to the head of the
        waiting queue (it resumes from the prefix cache). False if it is not running."""
        req = self._running_by_id.pop(req_id, None)
        if req is None:
            return False
        drop_drafts(req)
        self.kv.free(req_id)
        req.kv = None
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preempted += 1
        return True

    def fail_first_waiting(self) -> Request | None:
        """Finish the head of the waiting queue with ``finish_reason="error"`` (it can never
        be admitted as things are); None if nothing waits."""
        if not self.waiting:
            return None
        req = self.waiting.popleft()
        req.status, req.finish_reason = RequestStatus.FINISHED, "error"
        return req

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ------------------------------------------------------------------ disaggregation
    def take_loads(self) -> list[LoadJob]:
        """The remote-KV loads admitted since the last call (the worker starts them)."""
        loads, self._new_loads = self._new_loads, []
        return loads

    def load_finished(self, req_id: str, ok: bool, recompute: bool,
                      eos_token_ids: frozenset[int] = frozenset()) -> Request | None:
        """A load ended. ``ok``: the request runs from its first token (or finishes at once
        if that token ends it). Failed: its blocks are freed and it is recomputed from its
        prompt (``recompute``) or finished with ``finish_reason="error"``. Returns the request
        when it finished here (error, or done with its first token), else None."""
        req = self.loading.pop(req_id)
        if req.status is RequestStatus.ABORTED:
            self.kv.free(req_id)
            req.kv = None
            return None
        req.remote_prefill = None
        if not ok:      # the remote's first token goes too: its prompt runs here, or nothing
            self.kv.free(req_id)
            req.kv = None
            del req.token_ids[len(req.prompt_token_ids):]
            if recompute:
                req.status = RequestStatus.WAITING
                self.waiting.appendleft(req)
                return None
            req.status, req.finish_reason = RequestStatus.FINISHED, "error"
            return req
        token = req.token_ids[-1]
        stop = token in req.stop_token_ids or (token in eos_token_ids and not (
            req.sampling is not None and req.sampling.ignore_eos))
        if stop or req.num_output_tokens >= req.max_tokens or len(req.token_ids) >= req.max_len:
            self.kv.free(req_id)
            req.kv = None
            req.status = RequestStatus.FINISHED
            req.finish_reason = "stop" if stop else "length"
            return req
        self.kv.finish_remote(req_id)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._running_by_id[req_id] = req
        return None

    def schedule(self, acked_copy_ids: Iterable[int] = ()) -> StepPlan | None:
        """Plan the next step; None when nothing could be scheduled."""
        kv = self.kv
        kv.apply_acks(acked_copy_ids)
        budget = self.cfg.max_num_batched_tokens
        scheduled = 0
        may_preempt = True
        running = RequestStatus.RUNNING
        for req in list(self.running):  # a copy: preemption removes from the list
            if budget == 0:
                break
            handle = req.kv
            if req.status is not running or handle is None:
                continue
            known = handle.num_tokens
            if handle.num_draft_tokens and known - handle.num_computed > budget:
                drop_drafts(req)    # a verify step is never split: decode one token instead
                known = handle.num_tokens
            n = min(known - handle.num_computed, budget)
            # Its pending tokens alone will finish it (max_len or max_tokens): nothing to plan.
            if n == 0 or (handle.num_pending_tokens and (
                    known >= req.max_len
                    or known - len(req.prompt_token_ids) >= req.max_tokens)):
                continue
            while not kv.allocate_slots(handle, n):
                if not may_preempt:
                    break
                victim = self.running[-1]
                if victim is req and handle.pending:
                    # Its own mirrors are in flight: once acknowledged, its clean pages can be
                    # released (staged prefill), so wait a step rather than throw work away.
                    break
                free_before = kv.num_free_gpu_blocks
                self.preempt(victim.req_id)
                # A victim with mirrors in flight frees its pages only once they are acked:
                # preempting more in this step would only throw away more work.
                if kv.num_free_gpu_blocks == free_before:
                    may_preempt = False
                if victim is req:
                    break
            else:
                budget -= n
                scheduled += 1
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if req.remote_prefill is not None:
                job = kv.admit_remote(req.req_id, req.token_ids, req.max_len,
                                      req.remote_prefill)
                if job is None:
                    break
                self.waiting.popleft()
                req.status = RequestStatus.WAITING_FOR_REMOTE_KV
                req.kv = kv.get(req.req_id)
                self.loading[req.req_id] = req
                self._new_loads.append(job)
                continue
            handle = kv.admit(req.req_id, req.token_ids, req.max_len,
                              need_host=req.hold_for_remote_decode)
            if handle is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.kv = handle
            self.running.append(req)
            self._running_by_id[req.req_id] = req
            n = min(len(req.token_ids) - handle.num_computed, budget)
            if not kv.allocate_slots(handle, n):
                break
            budget -= n
            scheduled += 1
        self.peak_running = max(self.peak_running, len(self.running))
        if scheduled == 0 and not kv.has_landed:
            return None     # (else a copy-only plan: landed rows must be restored, durable)
        self.step_id += 1
        plan = kv.build_plan(self.step_id)
        by_id = self._running_by_id
        samplers = [by_id[s.req_id] for s in plan.seqs if s.sample]
        self._samplers[plan.step_id] = (samplers, [r.kv for r in samplers])
        return plan

    def running_requests(self, plan: StepPlan) -> list[Request]:
        """The requests of ``plan``'s sequences, in plan order (call before any of them
        leaves)."""
        by_id = self._running_by_id
        return [by_id[s.req_id] for s in plan.seqs]

    def sampling_requests(self, plan: StepPlan) -> list[Request]:
        """The requests of ``plan``'s sampling sequences, in plan order (the scheduler's own
        list until :meth:`update`: read it, do not mutate it)."""
        return self._samplers[plan.step_id][0]

    def update(self, plan: StepPlan, tokens: Sequence[int],
               eos_token_ids: frozenset[int] = frozenset()) -> StepUpdate:
        """Apply ``plan``'s results: ``tokens[i]`` was sampled for its i-th sampling sequence
        (``-1``: sampling failed for that row). Each token is appended and its request finished
        on a stop id or its length; entries of requests that left (or were preempted) since the
        plan are dropped."""
        out = StepUpdate()
        running = RequestStatus.RUNNING
        reqs, handles = self._samplers.pop(plan.step_id)
        for req, handle, token in zip(reqs, handles, tokens, strict=True):
            handle.num_pending_tokens -= 1
            if req.kv is not handle or req.status is not running:
                continue
            if token < 0:
                self._leave(req, RequestStatus.FINISHED, "error")
                out.failed.append(req)
                continue
            req.token_ids.append(token)
            out.progressed.append(req)
            reason = None
            if token in req.stop_token_ids or (token in eos_token_ids and not (
                    req.sampling is not None and req.sampling.ignore_eos)):
                reason = "stop"
            elif (len(req.token_ids) - len(req.prompt_token_ids) >= req.max_tokens
                  or len(req.token_ids) >= req.max_len):
                reason = "length"
            if reason is not None:
                self._leave(req, RequestStatus.FINISHED, reason)
                out.finished.append(req)
        return out

    def update_spec(self, plan: StepPlan, outs: Sequence[Sequence[int]],
                    drafts: Sequence[Sequence[int]], draft_probs: Sequence,
                    num_speculative_tokens: int,
                    eos_token_ids: frozenset[int] = frozenset()) -> StepUpdate:
        """Apply a speculative step (synchronous loop: nothing pending but this step):
        ``outs[i]`` are the tokens the i-th sampling sequence produced (accepted drafts, then
        the corrected or bonus token; ``[-1]``: sampling failed), ``drafts[i]`` /
        ``draft_probs[i]`` the drafts for its next step. Tokens are appended up to a stop id or
        the length limit; the KV of rejected drafts is rolled back (``num_computed`` = tokens
        - 1); the next drafts are capped so the next step stays within max_tokens / max_len."""
        out = StepUpdate()
        running = RequestStatus.RUNNING
        reqs, handles = self._samplers.pop(plan.step_id)
        for req, handle, toks, dr, dp in zip(reqs, handles, outs, drafts, draft_probs,
                                             strict=True):
            handle.num_pending_tokens -= 1
            handle.num_draft_tokens = 0
            req.spec_draft, req.spec_draft_probs = [], None
            if req.kv is not handle or req.status is not running:
                continue
            if not toks or toks[0] < 0:
                self._leave(req, RequestStatus.FINISHED, "error")
                out.failed.append(req)
                continue
            reason = None
            for token in toks:
                req.token_ids.append(token)
                if token in req.stop_token_ids or (token in eos_token_ids and not (
                        req.sampling is not None and req.sampling.ignore_eos)):
                    reason = "stop"
                elif (req.num_output_tokens >= req.max_tokens
                      or len(req.token_ids) >= req.max_len):
                    reason = "length"
                if reason is not None:
                    break
            out.progressed.append(req)
            if reason is not None:
                self._leave(req, RequestStatus.FINISHED, reason)
                out.finished.append(req)
                continue
            self.kv.rollback(handle, len(req.token_ids) - 1)
            cap = min(num_speculative_tokens, len(dr),
                      req.max_tokens - req.num_output_tokens - 1,
                      req.max_len - len(req.token_ids) - 1)
            if cap > 0:
                req.spec_draft = list(dr[:cap])
                req.spec_draft_probs = None if dp is None else dp[:cap]
                handle.num_draft_tokens = cap
        return out

    def _leave(self, req: Request, status: RequestStatus, reason: str) -> None:
        if (req.hold_for_remote_decode and status is RequestStatus.FINISHED
                and reason != "error"):
            req.held = (req.kv, self.kv.hold(req.req_id))
        self.kv.free(req.req_id)
        req.kv = None
        self.running.remove(req)
        del self._running_by_id[req.req_id]
        req.status = status
        req.finish_reason = reason


def drop_drafts(req: Request) -> None:
    """Forget a request's draft tokens (it decodes one token in its next step)."""
    req.spec_draft, req.spec_draft_probs = [], None
    if req.kv is not None:
        req.kv.num_draft_tokens = 0
