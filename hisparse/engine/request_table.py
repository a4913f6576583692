"""The engine's live requests: :class:`RequestTable` owns the ``request id -> Request`` map
from a request's enqueue to its last output (or abort), hands out request ids and puts each
new :class:`~hisparse.engine.request.Request` on the scheduler."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from hisparse.engine.core import EngineCore
from hisparse.engine.disagg import Disaggregation
from hisparse.engine.request import Request
from hisparse.engine.sampling import SamplingParams
from hisparse.engine.scheduler import Scheduler


class RequestTable:
    """``requests``: every request queued and not yet returned finished or aborted (read it;
    only this table adds or removes entries). ``grammar(field)`` gives the structured-output
    backend (:meth:`InputProcessor.grammar`); ``disagg`` is ``None`` without ``kv_role``."""

    def __init__(self, scheduler: Scheduler, core: EngineCore, disagg: Disaggregation | None,
                 max_model_len: int, grammar: Callable[[str], object]) -> None:
        self.requests: dict[str, Request] = {}
        self._scheduler = scheduler
        self._core = core
        self._disagg = disagg
        self._max_model_len = max_model_len
        self._grammar = grammar
        self._ids = itertools.count()

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    def check_id(self, request_id, taken: set[str] = frozenset()) -> None:
        """A caller's id: a non-empty string no live request (nor ``taken``) has."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests or request_id in taken:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def new_id(self, taken: set[str] = frozenset()) -> str:
        """A fresh ``req-N`` id, skipping ids in use (and ``taken``)."""
        while True:  # auto ids skip ids the caller chose
            req_id = f"req-{next(self._ids)}"
            if req_id not in self.requests and req_id not in taken:
                return req_id

    def enqueue(self, text: str | None, ids: list[int], params: SamplingParams,
                req_id: str) -> None:
        """Queue a checked request (:class:`InputProcessor`'s output) under ``req_id``."""
        remote, hold = None, False
        if params.kv_transfer_params:
            if self._disagg is None:
                raise ValueError("kv_transfer_params need an instance started with kv_role "
                                 "'prefill' or 'decode'")
            params, remote, hold = self._disagg.prepare(ids, params)
        max_len = min(len(ids) + params.max_tokens, self._max_model_len)
        req = Request(req_id, ids, max_tokens=params.max_tokens, max_len=max_len,
                      sampling=params, stop_token_ids=frozenset(params.stop_token_ids),
                      prompt_text=text)
        if params.structured_outputs is not None:    # compiled when checked: a cache hit
            backend = self._grammar("structured_outputs")
            req.grammar = backend.matcher(backend.compile(params.structured_outputs))
        if remote is not None:      # its first token comes from the prefill instance
            req.remote_prefill = remote
            req.token_ids.append(remote.first_token)
        req.hold_for_remote_decode = hold
        self._scheduler.add(req)
        self.requests[req_id] = req
        self._core.request_added()

    def abort(self, req_id: str) -> bool:
        """Abort a live request (a KV load in flight is cancelled); False if none has the id."""
        if req_id in self._scheduler.loading:
            self._core.kv_transfer.cancel(req_id)
        if self._scheduler.abort(req_id) is None:
            return False
        self.forget(req_id)
        return True

    def fail(self, req_id: str) -> None:
        """Finish a running request with ``"error"`` and forget it."""
        self._scheduler.finish(req_id, "error")
        self.forget(req_id)

    def forget(self, req_id: str) -> Request:
        """Remove a request that got its last output; returns it."""
        return self.requests.pop(req_id)
