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

from dataclasses import dataclass, field

import torch
from torch import Tensor

from hisparse.engine import sampling
from hisparse.engine.request import Request
from hisparse.engine.scheduler import Scheduler, StepUpdate
from hisparse.kv.plan import StepPlan


@dataclass
class _LaunchedStep:
    """A step queued on the device whose sampled tokens are not applied yet."""

    plan: StepPlan
    requests: list[Request]                 # its sampling sequences' requests, plan order
    tokens: Tensor | None = None            # int64 [S] host copy being filled (pinned on CUDA)
    event: torch.cuda.Event | None = None   # recorded after the copy
    errors: dict[str, str] = field(default_factory=dict)  # req_id -> why its sampling failed


class EngineCore:
    """Owns the step loop over a scheduler (policy, no GPU work) and a runner (GPU, no policy).

    :meth:`step` returns a :class:`StepUpdate` and the error message of each failed request.
    An exception it raises is engine-wide: the caller stops the engine.
    """

    def __init__(self, scheduler: Scheduler, runner, eos_token_ids: frozenset[int],
                 async_scheduling: bool) -> None:
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

    # ------------------------------------------------------------------ the loop
    def step(self) -> tuple[StepUpdate, dict[str, str]]:
        plan = self.scheduler.schedule(self._acks)
        self._acks = []
        launched = self._launch(plan) if plan is not None else None
        previous, self._in_flight = self._in_flight, None
        if self.async_scheduling:
            self._in_flight = launched
            done = previous
        else:
            done = launched
        if done is not None:
            return self._apply(done)
        if plan is None:
            if self.runner.in_flight:   # finished requests hold KV until their mirrors land
                self._acks += self.runner.drain()
            elif self._acks:            # a prefill waits for these acks to free its pages
                pass
            elif self.scheduler.has_unfinished:
                raise RuntimeError("requests wait but nothing can be scheduled")
        return StepUpdate(), {}

    @property
    def idle(self) -> bool:
        """No request left and no step in flight."""
        return not self.scheduler.has_unfinished and self._in_flight is None

    def release(self) -> None:
        """Apply the step in flight (its results are dropped: call when no request is left)
        and wait for every mirror, so freed requests give their blocks back."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._apply(launched)
        self.scheduler.kv.apply_acks(self._acks + self.runner.drain())
        self._acks = []

    # ------------------------------------------------------------------ one step
    def _launch(self, plan: StepPlan) -> _LaunchedStep:
        requests = self.scheduler.running_requests(plan)
        input_ids = []
        for seq, req in zip(plan.seqs, requests):
            ids = req.token_ids[seq.start_pos:seq.start_pos + seq.num_tokens]
            if len(ids) < seq.num_tokens:   # sampled by the step in flight: on the device
                ids = ids + [-1] * (seq.num_tokens - len(ids))
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
        try:
            tokens = sampling.sample_tensor(logits, sampling.SamplingTensors.build(
                params, steps, logits.device, self._sampling_staging))
        except Exception:  # noqa: BLE001 - find the rows that fail, one by one
            tokens = self._sample_rows(logits, launched, params, steps)
        self.runner.commit_sampled(tokens)
        buf = self._token_bufs[self._turn][:len(samplers)]
        self._turn ^= 1
        if self.device.type == "cuda":
            buf.copy_(tokens, non_blocking=True)
            launched.event = torch.cuda.Event()
            launched.event.record()
        else:
            buf.copy_(tokens)
        launched.tokens = buf
        return launched

    def _sample_rows(self, logits: Tensor, launched: _LaunchedStep, params, steps) -> Tensor:
        """Row-by-row fallback after the batched sampler raised: a row that raises fails its
        request; if every row of several fails, the fault is engine-wide."""
        rows = sampling.sample_rows(logits, params, steps)
        if len(rows) > 1 and all(isinstance(t, Exception) for t in rows):
            raise rows[0]
        for req, tok in zip(launched.requests, rows):
            if isinstance(tok, Exception):
                launched.errors[req.req_id] = f"sampling failed: {type(tok).__name__}: {tok}"
        return torch.tensor([-1 if isinstance(t, Exception) else t for t in rows],
                            dtype=torch.int64, device=logits.device)

    def _apply(self, launched: _LaunchedStep) -> tuple[StepUpdate, dict[str, str]]:
        tokens: list[int] = []
        if launched.tokens is not None:
            if launched.event is not None:
                launched.event.synchronize()
            tokens = launched.tokens.tolist()
        update = self.scheduler.update(launched.plan, tokens, self.eos_token_ids)
        errors = {}
        for req in update.failed:
            errors[req.req_id] = launched.errors.get(req.req_id) or (
                f"non-finite logits (NaN/inf) at output token {req.num_output_tokens}")
        return update, errors
