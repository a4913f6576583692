"""A generation request as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request:
    """``token_ids`` is the prompt followed by every sampled token; the KV coordinator holds a
    reference to the same list. ``num_computed`` tokens have KV; ``max_len`` bounds the total."""

    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    max_len: int
    sampling: Any = None
    stop_token_ids: frozenset[int] = frozenset()
    arrival: int = 0
    token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    finish_reason: str | None = None
    prompt_text: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)
