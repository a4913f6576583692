"""Per-request KV bookkeeping shared by the coordinator, the prefix cache and the reclaim policy."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class PendingWrite:
    """One in-flight mirror of a request: rows up to ``end`` written, durable once ``acked``."""

    end: int
    acked: bool = False


@dataclass(eq=False)
class RequestKV:
    """KV bookkeeping of one admitted request, and the owner of its progress.

    Per logical page ``p`` (views into the coordinator's tables, indexed by ``slot``):
    ``resident[p]`` GPU arena block or -1; ``host[p]`` host block; ``indexer[p]`` indexer-cache
    block. ``token_ids`` is the engine's list (prompt then sampled tokens): read here, never
    written. ``num_computed`` is the one count of tokens with KV; the engine reads it.
    """

    req_id: str
    uid: int
    slot: int
    token_ids: list[int]
    prompt_len: int
    num_pages: int                  # pages reserved for max length
    resident: np.ndarray            # views into the coordinator's tables (copies once freed)
    host: np.ndarray
    indexer: np.ndarray
    num_computed: int = 0
    num_durable: int = 0
    num_published: int = 0          # pages whose hash is published (contiguous from page 0)
    page_hashes: list[int] = field(default_factory=list)
    pending: deque[PendingWrite] = field(default_factory=deque)  # in-flight mirrors, oldest first
    host_read: bool = False
    hot_blocks: list[int] = field(default_factory=list)
    # Pages below this index hold no GPU reference of ours (unpinned, lost or never restored).
    pinned_start: int = 0
    freed: bool = False             # its KV was given back (it may still drain mirrors)
    # Tokens that planned steps sample but the engine has not appended to ``token_ids`` yet
    # (one while an overlapped step is in flight): they count as known tokens here, so the
    # next step can already compute them (their ids come from the device).
    num_pending_tokens: int = 0
    # Speculative decoding: draft tokens (the engine holds their ids) the next step verifies
    # after the last known token; they count as known tokens, so one step computes them all.
    num_draft_tokens: int = 0
    # Remote prefill (decode side): the first position whose row was pulled (the pages
    # before it were prefix-cache hits here).
    landed_start: int = 0
    remote: bool = False            # admitted by admit_remote (its prompt rows were pulled)
    # False: GPU-held (hisparse, host pool full): every page on GPU from admission, no host
    # blocks of its own (``host`` is -1 past its prefix hits, whose cached host blocks it
    # holds), never mirrored, switched to host-read mode or published.
    host_backed: bool = True

    @property
    def num_tokens(self) -> int:
        """Known tokens: ``token_ids`` plus those sampled by planned steps, plus drafts."""
        return len(self.token_ids) + self.num_pending_tokens + self.num_draft_tokens

    @property
    def decoding(self) -> bool:
        """Past its first decode token: every later step computes one token, so it may read
        history through a hot buffer (a prefill chunk reads host-only history through the
        worker's staging area instead)."""
        return self.num_computed > self.prompt_len


@dataclass
class KVStats:
    spilled_pages: int = 0          # GPU blocks given up by host-read requests (unpinned)
    lost_pages: int = 0             # unpinned pages whose block was reused by someone else
    restored_pages: int = 0         # host -> GPU page restores planned
    prefix_hit_tokens: int = 0
    host_prefix_hit_tokens: int = 0  # hit tokens whose rows had to come back from host
    host_read_switches: int = 0
    staged_chunks: int = 0          # prefill chunks whose history had host-only pages
    prefill_released_pages: int = 0  # clean pages a prefilling request gave up (issue 14)
    unrestored_hit_pages: int = 0   # host-only prefix hits used in place (no restore)
    mirrored_rows: int = 0
    remote_gpu_pages: int = 0       # remote-prefill prompt pages landed in GPU pages
    remote_host_pages: int = 0      # ... landed in the host pool (read through hot buffers)
    gpu_held_admissions: int = 0    # requests admitted GPU-held (the host pool was full)
