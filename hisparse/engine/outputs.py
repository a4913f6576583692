"""What the engine hands back: :class:`RequestOutput` / :class:`CompletionOutput`, built from a
:class:`~hisparse.engine.request.Request` by :class:`OutputBuilder`, which owns the per-request
incremental detokenizers and the error messages of requests that failed in a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hisparse.engine.detokenizer import IncrementalDetokenizer
from hisparse.engine.request import Request


@dataclass
class CompletionOutput:
    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None      # "stop" | "length" | "abort" | "error"
    error: str | None = None       # why, when finish_reason == "error"
    # per output token ``{token id: log-probability}``, the sampled token first, then the
    # ``SamplingParams.logprobs`` most likely (raw model distribution); None unless asked
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """One request's tokens so far (``finished`` once it is done). ``prompt_token_ids`` is the
    engine's own list of the prompt, shared by every output of the request: read it, do not
    mutate it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True          # False: a streaming update (tokens so far) of a running one
    # Prefill instance (``kv_role="prefill"``): the params of the decode request of a
    # ``do_remote_decode`` request (vLLM's protocol; :mod:`hisparse.kv.transfer_plan`)
    kv_transfer_params: dict | None = None


class OutputBuilder:
    """Builds each output of a request; text comes from one incremental detokenizer per
    request that streams (``tokenizer`` ``None``: ``text`` is ``None``).

    ``stop_request(req_id)`` is called when a running request's text cannot be decoded: it
    must finish the request (``"error"``) and drop it from the engine, since it would fail
    again at every step. State per request lives here until its last output (or
    :meth:`drop`)."""

    def __init__(self, tokenizer, stop_request: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self._stop_request = stop_request
        self._errors: dict[str, str] = {}           # by request id, until its output
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}   # by request id

    def record_errors(self, errors: dict[str, str]) -> None:
        """Why each of these requests failed (reported by its output)."""
        self._errors.update(errors)

    def drop(self, req_id: str) -> None:
        """Forget a request that gets no last output (aborted)."""
        self._detokenizers.pop(req_id, None)

    def build(self, req: Request, kv_transfer_params: dict | None = None) -> RequestOutput:
        """``req``'s output now: every output token so far (a new list), its text (extending
        the previous output's), the finish reason and error, the logprobs if asked."""
        ids = req.token_ids[len(req.prompt_token_ids):]     # one copy (a new list)
        error = self._errors.pop(req.req_id, None)
        reason = req.finish_reason
        text = None
        if self.tokenizer is not None:
            try:
                # the last output uses the same detokenizer: every text extends the previous one
                detok = (self._detokenizers.pop(req.req_id, None) if req.finished
                         else self._detokenizers.get(req.req_id))
                if detok is None:
                    detok = IncrementalDetokenizer(
                        self.tokenizer, getattr(req.sampling, "skip_special_tokens", True))
                    if not req.finished:
                        self._detokenizers[req.req_id] = detok
                text = detok.update(ids, final=req.finished)
            except Exception as e:  # noqa: BLE001 - one request's failure
                reason, error = "error", f"detokenizing failed: {type(e).__name__}: {e}"
                if not req.finished:    # stop it now: it would fail again at every step
                    self._stop_request(req.req_id)
                    self._detokenizers.pop(req.req_id, None)
        # The prompt list is shared, not copied: step() builds an output per running request
        # per step, and copying 147 prompts of 32k tokens cost 27-34 ms per step (CPU box).
        return RequestOutput(req.req_id, req.prompt_text, req.prompt_token_ids,
                             [CompletionOutput(0, text, ids, reason, error,
                                               None if req.logprobs is None
                                               else req.logprobs[:len(ids)])],
                             finished=req.finished, kv_transfer_params=kv_transfer_params)
