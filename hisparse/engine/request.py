"""A generation request as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from hisparse.kv.state import RequestKV
from hisparse.kv.transfer_plan import RemotePrefill


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"   # its prompt's KV is being pulled
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    """``token_ids`` is the prompt followed by every sampled token (the engine appends; the KV
    core reads the same list). ``kv`` is the request's KV handle while it is admitted: the KV
    core owns its progress (``num_computed``), the engine only reads it. ``max_len`` bounds the
    total length."""

    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    max_len: int
    sampling: Any = None
    stop_token_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    prompt_text: str | None = None
    kv: RequestKV | None = field(default=None, repr=False)
    # Speculative decoding: the draft tokens the next step verifies, and (sampled requests)
    # their draft distributions ``[len(spec_draft), vocab]`` on the device.
    spec_draft: list[int] = field(default_factory=list, repr=False)
    spec_draft_probs: Any = field(default=None, repr=False)
    # per output token, ``{token id: log-probability}`` (sampled token first), when the request
    # asked for logprobs (``SamplingParams.logprobs``); else None
    logprobs: list[dict[int, float]] | None = field(default=None, repr=False)
    # structured output: the request's xgrammar matcher (advanced with every appended token)
    grammar: Any = field(default=None, repr=False)
    # Disaggregation: a decode request whose prompt KV a prefill instance computed (cleared
    # once the load ends, either way), and a prefill request whose prompt KV is held for a
    # remote decode (``held``: its KV handle and the host blocks held, set when it finishes).
    remote_prefill: RemotePrefill | None = field(default=None, repr=False)
    hold_for_remote_decode: bool = False
    held: tuple[RequestKV, list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.logprobs is None and getattr(self.sampling, "logprobs", None) is not None:
            self.logprobs = []

    @property
    def num_computed(self) -> int:
        """Tokens with KV (0 while waiting: a preempted request starts over)."""
        return self.kv.num_computed if self.kv is not None else 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Known tokens (pending ones included) without KV."""
        if self.kv is None:
            return len(self.token_ids)
        return self.kv.num_tokens - self.kv.num_computed

    @property
    def finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)
