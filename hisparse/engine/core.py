"""The step loop: schedule, launch the forward, sample on the device, apply the results.

One call of :meth:`EngineCore.step` plans and launches a step. With ``async_scheduling`` (the
overlapped loop, like vLLM's async scheduling and SGLang's overlap scheduler) it then applies the
*previous* step's results while the GPU runs the new one, so the CPU work of step n+1 (schedule,
plan, staging, launch) hides behind the GPU time of step n. The one host wait per step is on the
previous step's sampled tokens, placed after the next step is queued. Without it, a step's
results are applied in the call that launched it.

The one-step lag is handled where the state lives: a token a planned step samples is *pending*
in the KV core until applied (the next step computes it from the device: the worker keeps each
slot's last sampled token); the scheduler drops results of requests that finished, were aborted
or preempted after the plan; a freed request keeps its pages until every step that wrote them
has mirrored them (acks), and its GPU blocks are reused only by later steps on the same stream.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hisparse.engine import sampling, spec
from hisparse.engine.logits import LogitsBatch, LogitsState
from hisparse.engine.request import Request
from hisparse.engine.scheduler import Scheduler, StepUpdate
from hisparse.kv.plan import StepPlan

logger = logging.getLogger(__name__)


class RequestFreezer:
    """Keeps the cyclic garbage collector off admitted requests' token lists.

    Why: a request holds its prompt list (shared by every output, ``RequestOutput``) and
    ``Request.token_ids`` (prompt plus sampled tokens), each a list of context-length entries.
    A full collection walks every entry of every such list: at 256 requests x 32k tokens it
    stalled one step for 170-320 ms (CPU box), about every 250 decode steps
    (``benchmarks/bench_scheduler.py``, docs/BENCHMARKS.md). Lists cannot be untracked, so,
    like vLLM after start-up, the engine moves them to the collector's permanent generation
    with ``gc.freeze()``.

    The contract (``gc.freeze`` is process-wide, so this is what every caller sees):

    - :meth:`request_added` marks that requests arrived; the next engine step (before it
      schedules) runs ``gc.collect(1)`` and then ``gc.freeze()``. Only the young generations
      are collected first (the new requests' lists, recent garbage: ~0.7 ms per 32k-token
      request, once per request); the old heap is not walked, so a request reaching an idle
      engine does not pay for the whole heap.
    - Frozen objects are still freed by reference counting: a finished request (no cycles:
      ``tests/engine/test_gc.py`` checks that finished requests die with the engine frozen)
      goes away as before. Lists keep growing while frozen (appends), and are never walked.
    - Garbage *in reference cycles* among frozen objects (the whole process's: a server's
      per-request objects too) waits for a full pass: when the engine is idle (no request
      left, or shutdown) and the frozen set has grown past twice its size after the first
      freeze since the previous full pass (and by at least :attr:`FULL_PASS_MIN_GROWTH`
      objects), :meth:`idle` runs ``gc.unfreeze()`` and ``gc.collect()``, which walks the
      whole heap once (~0.2 s at 460k objects on the CPU box). A server that never goes idle
      keeps such garbage until it does.
    - Another engine's full pass may unfreeze this engine's lists; they return to the oldest
      generation and are frozen again at this engine's next admission.
    - The engine's own objects (model, caches, captured graphs) are frozen too, and some sit in
      reference cycles: :meth:`release` (``LLM.shutdown``) unfreezes so that they can be freed;
      an engine dropped without shutdown keeps its memory until some full pass runs.
    - ``enabled=False`` (``LLM(gc_freeze=False)``) leaves the collector alone.
    """

    FULL_PASS_MIN_GROWTH = 50_000
    _unfreeze_at_exit = False   # one atexit hook per process: frozen objects would otherwise
    #                             skip interpreter teardown (extensions report them as leaks)

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._added = False
        self._baseline: int | None = None   # frozen objects after the first freeze since a pass
        self.freezes = 0
        self.full_passes = 0

    def request_added(self) -> None:
        if self.enabled:
            self._added = True

    def before_step(self) -> None:
        if self._added:
            self._added = False
            gc.collect(1)
            gc.freeze()
            self.freezes += 1
            if not RequestFreezer._unfreeze_at_exit:
                RequestFreezer._unfreeze_at_exit = True
                atexit.register(gc.unfreeze)
            if self._baseline is None:
                self._baseline = gc.get_freeze_count()

    def release(self) -> None:
        """The engine is shut down: unfreeze the heap so that the engine's own objects (caches,
        captured graphs: they sit in reference cycles, frozen by this engine's freezes) can be
        collected. Other engines' lists are frozen again at their next admission."""
        self._added = False
        if gc.get_freeze_count():     # frozen by this engine or another: either way unfreeze
            gc.unfreeze()
        self._baseline = None

    def idle(self) -> None:
        """No request is left in this engine: a full pass if the frozen set grew enough."""
        self._added = False
        if self._baseline is None:
            return
        frozen = gc.get_freeze_count()
        if frozen > 2 * self._baseline and frozen - self._baseline >= self.FULL_PASS_MIN_GROWTH:
            gc.unfreeze()
            gc.collect()
            self._baseline = None
            self.full_passes += 1


@dataclass
class _LaunchedStep:
    """A step queued on the device whose sampled tokens are not applied yet."""

    plan: StepPlan
    requests: list[Request]                 # its sampling sequences' requests, plan order
    tokens: Tensor | None = None            # int64 [S] host copy being filled (pinned on CUDA)
    # host copies of sampling.token_logprobs for the rows that asked (sampled [m], top values
    # [m, n], top ids [m, n]), rows ``logprob_rows`` of ``requests``; behind ``event`` too
    logprobs: tuple[Tensor, Tensor, Tensor] | None = None
    logprob_rows: list[int] = field(default_factory=list)
    event: torch.cuda.Event | None = None   # recorded after the copies
    errors: dict[str, str] = field(default_factory=dict)  # req_id -> why its sampling failed


def _attach_logprobs(launched: _LaunchedStep, update: StepUpdate) -> None:
    """Append ``{token id: log-probability}`` (the sampled token first, then the requested
    number of most likely ones) to ``Request.logprobs`` of each row whose token was appended."""
    chosen, top_vals, top_ids = (t.tolist() for t in launched.logprobs)
    appended = {id(r) for r in update.progressed}
    for k, i in enumerate(launched.logprob_rows):
        req = launched.requests[i]
        if id(req) not in appended:
            continue
        n = req.sampling.logprobs
        entry = {req.token_ids[-1]: chosen[k]}
        for tok, val in zip(top_ids[k][:n], top_vals[k][:n]):
            entry.setdefault(tok, val)
        req.logprobs.append(entry)


class EngineCore:
    """Owns the step loop over a scheduler (policy, no GPU work) and a runner (GPU, no policy).

    :meth:`step` returns a :class:`StepUpdate` and the error message of each failed request.
    An exception it raises is engine-wide: the caller stops the engine.
    """

    def __init__(self, scheduler: Scheduler, runner, eos_token_ids: frozenset[int],
                 async_scheduling: bool, num_speculative_tokens: int = 0,
                 gc_freeze: bool = True, vocab_size: int | None = None) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.freezer = RequestFreezer(gc_freeze)
        self.spec_stats = spec.SpecStats()
        # Test / benchmark seam: ``draft_hook(requests, outs, drafts) -> drafts`` (``outs``:
        # the tokens each request gets from this step, not appended yet) replaces the MTP
        # drafts (e.g. to inject an acceptance rate: random weights cannot give a real one).
        # Replaced drafts are verified as one-hot draft distributions (still exact).
        self.draft_hook = None
        if num_speculative_tokens:
            async_scheduling = False    # speculative steps run in the synchronous loop
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.async_scheduling = async_scheduling
        self.device = runner.device
        self._acks: list[int] = []
        self._in_flight: _LaunchedStep | None = None
        # Two host buffers for sampled tokens: one is filled while the other is read.
        pin = self.device.type == "cuda"
        n = scheduler.cfg.max_num_seqs
        self._token_bufs = [torch.empty(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self._sampling_staging = sampling.SamplingStaging(n, self.device)
        # Penalty / bad-word token state (None: a core without a vocabulary, benchmarks; such
        # a core serves no request that uses them). ``grammar``: the structured-output
        # backend, set by the LLM at the first constrained request.
        self.logits_state = (LogitsState(n, vocab_size, self.device)
                             if vocab_size is not None else None)
        self.grammar = None
        self._early: tuple[StepUpdate, dict[str, str]] | None = None
        # Disaggregation, decode side: the KV transfer agent that pulls remote prompts
        # (:mod:`hisparse.worker.kv_transfer`) and what a failed load does.
        self.kv_transfer = None
        self.recompute_failed_loads = True
        self._starved_since: float | None = None   # since when only quarantine blocks a step

    # ------------------------------------------------------------------ the loop
    def request_added(self) -> None:
        """A request was queued: its token lists are frozen before the next step."""
        self.freezer.request_added()

    def step(self) -> tuple[StepUpdate, dict[str, str]]:
        if self.kv_transfer is None:
            return self._step()
        ended, errors = self._poll_loads()
        update, step_errors = self._step()
        for job in self.scheduler.take_loads():
            self.kv_transfer.start_load(job)
        for req in ended:
            (update.failed if req.finish_reason == "error" else update.finished).append(req)
        errors.update(step_errors)
        return update, errors

    def _poll_loads(self) -> tuple[list[Request], dict[str, str]]:
        """Apply the remote-KV loads that ended: requests that finished with them (an error
        under ``--kv-load-failure fail``, or done with their first token) and the errors."""
        ended, errors = [], {}
        results = self.kv_transfer.poll()
        # a failed load whose READs still run: its blocks stay taken past the request's free
        for job in self.kv_transfer.take_quarantined():
            self.scheduler.kv.quarantine(job)
        for req_id, error in results:
            req = self.scheduler.load_finished(req_id, error is None,
                                               self.recompute_failed_loads, self.eos_token_ids)
            if error is not None and error != "aborted":
                logger.warning(
                    "request %s: %s; %s", req_id, error,
                    "recomputing its prompt" if self.recompute_failed_loads else "failed")
            if req is not None:
                ended.append(req)
                if error is not None:
                    errors[req_id] = error
        return ended, errors

    def _step(self) -> tuple[StepUpdate, dict[str, str]]:
        self.freezer.before_step()
        plan = self.scheduler.schedule(self._acks)
        self._acks = []
        if plan is not None:
            self._starved_since = None
        if self.num_speculative_tokens and plan is not None and plan.seqs:
            return self._spec_step(plan)
        launched = self._launch(plan) if plan is not None else None
        previous, self._in_flight = self._in_flight, None
        if self.async_scheduling:
            self._in_flight = launched
            done = previous
        else:
            done = launched
        if self._early is not None:   # the previous step, applied before this one sampled
            early, self._early = self._early, None
            return early
        if done is not None:
            return self._apply(done)
        if plan is None:
            if self.runner.in_flight:   # finished requests hold KV until their mirrors land
                self._acks += self.runner.drain()
            elif self._acks:            # a prefill waits for these acks to free its pages
                pass
            elif self.scheduler.loading:   # remote KV on its way: poll again shortly
                time.sleep(0.001)
            elif self.scheduler.kv.quarantined_blocks:
                return self._wait_for_quarantine()
            elif self.scheduler.has_unfinished:
                raise RuntimeError("requests wait but nothing can be scheduled")
        return StepUpdate(), {}

    def _wait_for_quarantine(self) -> tuple[StepUpdate, dict[str, str]]:
        """Nothing runs and the waiting requests do not fit beside the blocks quarantined by
        stuck READs (which come back when the READs end: ``Disaggregation.service``). After
        the KV load timeout of such waiting, the head of the queue fails with a clear error
        (a stalled prefill that never resumes would hold it forever)."""
        now = time.monotonic()
        if self._starved_since is None:
            self._starved_since = now
        if now - self._starved_since < self.kv_transfer.load_timeout_s:
            time.sleep(0.001)
            return StepUpdate(), {}
        self._starved_since = None
        req = self.scheduler.fail_first_waiting()
        if req is None:
            return StepUpdate(), {}
        why = (f"cannot be scheduled: {self.scheduler.kv.quarantined_blocks} KV blocks are "
               f"quarantined by NIXL READs of failed loads still in flight (a stalled "
               f"prefill instance)")
        logger.warning("request %s: %s", req.req_id, why)
        update = StepUpdate()
        update.failed.append(req)
        return update, {req.req_id: why}

    def release(self) -> None:
        """Apply the step in flight (its results are dropped: call when no request is left)
        and wait for every mirror, so freed requests give their blocks back."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._apply(launched)
        self.scheduler.kv.apply_acks(self._acks + self.runner.drain())
        self._acks = []
        if not self.scheduler.has_unfinished:
            self.freezer.idle()

    # ------------------------------------------------------------------ one step
    def _launch(self, plan: StepPlan) -> _LaunchedStep:
        if not plan.seqs:       # copy-only: restores of landed remote prompts
            self._acks += self.runner.copy_only(plan)
            return _LaunchedStep(plan, [])
        requests = self.scheduler.running_requests(plan)
        input_ids: list[int] = []
        append = input_ids.append
        for seq, req in zip(plan.seqs, requests):
            known, start = req.token_ids, seq.start_pos
            if seq.num_tokens == 1:     # a decode token: no slice
                # -1: sampled by the step in flight, its id is on the device
                append(known[start] if start < len(known) else -1)
                continue
            ids = known[start:start + seq.num_tokens]
            if len(ids) < seq.num_tokens:   # sampled by the step in flight: on the device
                ids += [-1] * (seq.num_tokens - len(ids))
            input_ids += ids
        logits, acks = self.runner.execute(plan, input_ids)
        self._acks += acks
        samplers = self.scheduler.sampling_requests(plan)
        launched = _LaunchedStep(plan, samplers)
        if not samplers:
            return launched
        params = [r.sampling for r in samplers]
        # The output index of the token each row samples (the seeded RNG's counter).
        steps = [r.num_output_tokens + r.kv.num_pending_tokens - 1 for r in samplers]
        handles = [r.kv for r in samplers]
        slots = [s.slot for s in plan.seqs if s.sample]
        if self._in_flight is not None and any(r.grammar is not None for r in samplers):
            # A grammar mask needs the request's last token on the host: apply the step in
            # flight now (this step's forward is queued already; step() returns its update).
            previous, self._in_flight = self._in_flight, None
            self._early = self._apply(previous)
        raw = logits
        logits, finite, batch = self._process(raw, samplers, params, handles, slots, steps)
        try:
            tokens = sampling.sample_tensor(logits, sampling.SamplingTensors.build(
                params, steps, logits.device, self._sampling_staging), finite)
        except Exception:  # noqa: BLE001 - find the rows that fail, one by one
            tokens = self._sample_rows(logits, launched, params, steps, finite)
        if batch is not None:
            self.logits_state.record(batch, tokens)
        self.runner.commit_sampled(tokens)
        buf = self._token_bufs[self._turn][:len(samplers)]
        self._turn ^= 1
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        on_device = None
        if rows:    # only the rows that asked: a [rows, vocab] fp32 log-softmax, not [S, vocab]
            launched.logprob_rows = rows
            pick = torch.tensor(rows, device=logits.device)
            on_device = sampling.token_logprobs(raw[pick], tokens[pick],
                                                max(params[i].logprobs for i in rows))
        if self.device.type == "cuda":
            buf.copy_(tokens, non_blocking=True)
            if on_device is not None:   # rare: a pinned copy per step that asks for them
                launched.logprobs = tuple(
                    torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
                        t, non_blocking=True) for t in on_device)
            launched.event = torch.cuda.Event()
            launched.event.record()
        else:
            buf.copy_(tokens)
            launched.logprobs = on_device
        launched.tokens = buf
        return launched

    def _process(self, logits: Tensor, requests: list[Request], params, handles, slots,
                 out_index: list[int], drafts: list[list[int]] | None = None
                 ) -> tuple[Tensor, Tensor | None, LogitsBatch | None]:
        """The logits processors (grammar masks, bad words, min_tokens, logit bias,
        penalties) on a copy of ``logits``: ``(processed, finite, batch)``. ``finite [N]``
        (None when nothing ran: the sampler checks) is the raw rows' finiteness and that some
        token survived the masks. ``drafts``: speculative rows (see
        :meth:`LogitsState.prepare`); grammar masks are never combined with them."""
        batch = None
        if self.logits_state is not None:
            batch = self.logits_state.prepare(
                params, handles, slots,
                lambda i: (requests[i].token_ids, len(requests[i].prompt_token_ids)),
                out_index, self.eos_token_ids, drafts)
        elif any(p.processors for p in params):
            raise RuntimeError("this engine core has no vocabulary: no logits processors")
        mask = None
        if self.grammar is not None and drafts is None:
            rows = [i for i, r in enumerate(requests) if r.grammar is not None]
            if rows:
                mask = self.grammar.prepare(rows, [requests[i].grammar for i in rows])
        if batch is None and mask is None:
            return logits, None, None
        finite = torch.isfinite(logits).all(dim=-1)
        logits = logits.clone()
        if mask is not None:
            self.grammar.apply(mask, logits)
        if batch is not None:
            self.logits_state.apply(batch, logits)
        return logits, finite & (logits.amax(dim=-1) > float("-inf")), batch

    def _spec_step(self, plan: StepPlan) -> tuple[StepUpdate, dict[str, str]]:
        """One speculative step, synchronously: verify forward, rejection sampling, MTP drafts
        (and the step's mirrors), then the scheduler applies tokens and rolls back rejected
        KV."""
        sched, k = self.scheduler, self.num_speculative_tokens
        requests = sched.running_requests(plan)
        input_ids, num_logits, known_len = [], [], []
        for seq, req in zip(plan.seqs, requests):
            n_known = len(req.token_ids)
            ids = req.token_ids[seq.start_pos:seq.start_pos + seq.num_tokens]
            n_draft = seq.num_tokens - len(ids)
            if n_draft:
                ids = ids + req.spec_draft[:n_draft]
            input_ids += ids
            if seq.sample:
                num_logits.append(n_draft + 1)
                known_len.append(n_known)
        logits, unions = self.runner.spec_forward(plan, input_ids, num_logits)
        self.spec_stats.add_unions(unions)
        samplers = sched.sampling_requests(plan)
        params = [r.sampling for r in samplers]
        outs: list[list[int]] = []
        stats, row = self.spec_stats, 0
        all_greedy = all(p.greedy for p in params)
        finite_t = None
        slots = [s.slot for s in plan.seqs if s.sample]
        if samplers:    # penalties etc. at every verified position (drafts before it count)
            logits, finite_t, _ = self._process(
                logits, samplers, params, [r.kv for r in samplers], slots,
                [r.num_output_tokens for r in samplers], [r.spec_draft[:n - 1] for r, n in
                                                          zip(samplers, num_logits)])
        if samplers and all_greedy:     # one host copy: argmaxes and finiteness of every row
            targets = logits.argmax(dim=-1).tolist()
            finite = (torch.isfinite(logits).all(dim=-1) if finite_t is None
                      else finite_t).tolist()
        elif samplers:
            probs = spec.filtered_probs(logits, [p for p, n in zip(params, num_logits)
                                                 for _ in range(n)])
        for req, p, n in zip(samplers, params, num_logits):
            drafts = req.spec_draft[:n - 1]
            if all_greedy:
                toks = (spec.verify_greedy(targets[row:row + n], drafts)
                        if all(finite[row:row + n]) else [-1])
            else:
                q = req.spec_draft_probs
                toks = spec.verify(probs[row:row + n], None if q is None else q[:n - 1],
                                   drafts, p, req.num_output_tokens)
            row += n
            outs.append(toks)
            if drafts and toks[0] >= 0:
                stats.verify_steps += 1
                stats.drafted += len(drafts)
                stats.accepted += len(toks) - 1
                stats.emitted += len(toks)
        if samplers and self.logits_state is not None:
            self.logits_state.record_spec(slots, outs, params)
        # MTP inputs: each token's next token (accepted, sampled or a known prompt token).
        next_ids, draft_rows, offset, i = [], [], 0, 0
        for seq, req in zip(plan.seqs, requests):
            if seq.sample:
                toks = outs[i]
                known = req.token_ids[:known_len[i]] + [max(t, 0) for t in toks]
                draft_rows.append(offset + known_len[i] - 1 + len(toks) - 1 - seq.start_pos)
                i += 1
            else:
                known = req.token_ids
            nxt = known[seq.start_pos + 1:seq.start_pos + seq.num_tokens + 1]
            next_ids += nxt + [0] * (seq.num_tokens - len(nxt))
            offset += seq.num_tokens
        out_index = [r.num_output_tokens + len(t) for r, t in zip(samplers, outs)]
        draft_q: list[Tensor | None] = []
        draft_toks: list[Tensor] = []

        def sample_draft(draft_logits: Tensor, j: int) -> Tensor:
            toks, q = spec.draft_tokens(draft_logits, params, out_index, j)
            draft_q.append(q)
            draft_toks.append(toks)
            return toks

        acks = self.runner.spec_draft(next_ids, draft_rows, k if samplers else 0,
                                      sample_draft)
        self._acks += acks
        drafts: list[list[int]] = [[] for _ in samplers]
        probs_out: list[Tensor | None] = [None] * len(samplers)
        if samplers and draft_q:
            drafts = torch.stack(draft_toks, dim=1).tolist()
            if all(q is not None for q in draft_q):
                stacked = torch.stack(draft_q, dim=1)          # [S, k, vocab]
                probs_out = [stacked[s] for s in range(len(samplers))]
        if self.draft_hook is not None and samplers:
            # drafts come after the tokens this step produced: show the hook those
            drafts = self.draft_hook(samplers, outs, drafts)
            probs_out = [None] * len(samplers)
        update = sched.update_spec(plan, outs, drafts, probs_out, k, self.eos_token_ids)
        errors = {req.req_id: f"non-finite logits (NaN/inf) at output token "
                  f"{req.num_output_tokens}" for req in update.failed}
        return update, errors

    def _sample_rows(self, logits: Tensor, launched: _LaunchedStep, params, steps,
                     finite: Tensor | None) -> Tensor:
        """Row-by-row fallback after the batched sampler raised: a row that raises fails its
        request; if every row of several fails, the fault is engine-wide."""
        rows = sampling.sample_rows(logits, params, steps, finite)
        if len(rows) > 1 and all(isinstance(t, Exception) for t in rows):
            raise rows[0]
        for req, tok in zip(launched.requests, rows):
            if isinstance(tok, Exception):
                launched.errors[req.req_id] = f"sampling failed: {type(tok).__name__}: {tok}"
        return torch.tensor([-1 if isinstance(t, Exception) else t for t in rows],
                            dtype=torch.int64, device=logits.device)

    def _advance_grammars(self, update: StepUpdate, errors: dict[str, str]) -> None:
        """Advance each constrained request's matcher with the token it got; finish it when
        its grammar terminated (``"stop"``), fail it if the grammar rejects the token."""
        for req in update.progressed:
            m = req.grammar
            if m is None or req.finished:
                continue
            tok = req.token_ids[-1]
            if not m.accept_token(tok):
                errors[req.req_id] = f"structured output: the grammar rejected token {tok}"
                self.scheduler.finish(req.req_id, "error")
                update.failed.append(req)
            elif m.is_terminated():
                self.scheduler.finish(req.req_id, "stop")
                update.finished.append(req)

    def _apply(self, launched: _LaunchedStep) -> tuple[StepUpdate, dict[str, str]]:
        tokens: list[int] = []
        if launched.tokens is not None:
            if launched.event is not None:
                launched.event.synchronize()
            tokens = launched.tokens.tolist()
        update = self.scheduler.update(launched.plan, tokens, self.eos_token_ids)
        if self.grammar is not None:
            self._advance_grammars(update, launched.errors)
        if launched.logprobs is not None:
            _attach_logprobs(launched, update)
        errors = {}
        for req in update.failed:
            errors[req.req_id] = launched.errors.get(req.req_id) or (
                f"non-finite logits (NaN/inf) at output token {req.num_output_tokens}")
        return update, errors
