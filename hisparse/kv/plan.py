"""StepPlan: everything a worker needs to run one step, and nothing it must decide.

Addresses:
- A *flat row id* is ``block_id * block_size + offset`` inside one layer's view of a pool. Every
  copy below is applied to the same rows of every layer (block ids are shared by all layers).
- Tables are ``int32`` with ``-1`` for "no block". They are indexed by a request's *slot*, a row
  that stays fixed while the request holds KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

EMPTY_ROWS = np.zeros(0, dtype=np.int64)

# The block tables of a plan, by name (``StepPlan.<name>_block_table``).
TABLES = ("resident", "host", "indexer", "hot")


@dataclass(frozen=True)
class RowCopy:
    """One batched copy: ``dst[:, dst_rows[i]] = src[:, src_rows[i]]`` over all layers.

    ``copy_id`` is what the worker acknowledges once the copy is durable (-1: needs no ack).
    """

    src_rows: np.ndarray = field(default_factory=lambda: EMPTY_ROWS)  # int64 [n]
    dst_rows: np.ndarray = field(default_factory=lambda: EMPTY_ROWS)  # int64 [n]
    copy_id: int = -1

    def __len__(self) -> int:
        return int(self.src_rows.shape[0])


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of the step: tokens ``[start_pos, start_pos + num_tokens)``.

    ``slot`` is the request's row in every block table (fixed while it holds KV). All fields are
    final when the plan is emitted (``host_read`` included: reclaim runs before seqs are made).
    """

    req_id: str
    slot: int
    start_pos: int
    num_tokens: int
    host_read: bool      # history may miss GPU: reads go through the hot buffer
    sample: bool         # the last token's logits are sampled (prompt finished)
    prefill: bool = False  # the tokens belong to the prompt (as admitted)
    # A prefill chunk whose history has host-only pages: the worker reads its selected rows
    # through the staging area (host-only ones zero-copy from the host pool), not the hot buffer.
    staged: bool = False


@dataclass(frozen=True)
class ChangedRows:
    """Per block table, the slots (int64, unique, any order) whose row was written since the
    previous plan. A worker whose copy of the tables equals the previous plan's holds this
    plan's tables after copying just these rows (per-step table work proportional to what
    changed, DESIGN.md section 7). The first plan lists every row written since start-up."""

    resident: np.ndarray = field(default_factory=lambda: EMPTY_ROWS)
    host: np.ndarray = field(default_factory=lambda: EMPTY_ROWS)
    indexer: np.ndarray = field(default_factory=lambda: EMPTY_ROWS)
    hot: np.ndarray = field(default_factory=lambda: EMPTY_ROWS)


@dataclass
class StepPlan:
    step_id: int
    seqs: list[ScheduledSeq]
    # [max_num_seqs, max_pages] int32: GPU arena block of each logical page, or -1.
    resident_block_table: np.ndarray
    # [max_num_seqs, max_pages] int32: host block of each logical page, or -1.
    host_block_table: np.ndarray
    # [max_num_seqs, max_pages] int32: indexer-cache block of each logical page, or -1.
    indexer_block_table: np.ndarray
    # [max_num_seqs, hot_blocks_per_request] int32: leased hot blocks, or -1 (not host-read).
    hot_block_table: np.ndarray
    # The table rows written since the previous plan (every worker applies every plan).
    changed_rows: ChangedRows
    # Slots whose hot-buffer state (keys and LRU, every layer) is cleared before the forward.
    hot_resets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    # Before the forward: host -> GPU arena, and host indexer keys -> GPU indexer cache.
    restores: RowCopy = field(default_factory=RowCopy)
    indexer_restores: RowCopy = field(default_factory=RowCopy)
    # After the forward, on a copy stream: GPU -> host write-through of every row written.
    mirrors: RowCopy = field(default_factory=RowCopy)
    indexer_mirrors: RowCopy = field(default_factory=RowCopy)


def flat_rows(table, slots, positions, block_size: int):
    """Flat row id of each ``(slots[i], positions[i])``:
    ``table[slot, pos // block_size] * block_size + pos % block_size``, as int64.

    ``table`` is a ``[slots, pages]`` block table (numpy array or torch tensor; the result has the
    same kind; a single numpy position gives a numpy scalar). A ``-1`` block gives a negative
    row: callers that may meet one mask it. The one place this formula is written outside the
    kernels (a misplaced offset here corrupts KV).
    """
    blocks = table[slots, positions // block_size]
    blocks = blocks.long() if hasattr(blocks, "long") else np.asarray(blocks, dtype=np.int64)
    return blocks * block_size + positions % block_size


def page_rows(blocks, block_size: int) -> np.ndarray:
    """Every flat row of each block in ``blocks`` (int64, ``[len(blocks) * block_size]``, in
    block order)."""
    blocks = np.asarray(blocks, dtype=np.int64)
    return (blocks[:, None] * block_size + np.arange(block_size, dtype=np.int64)).ravel()


def token_layout(seqs: list[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The flat batch of ``seqs``: per token its position and slot (int64 ``[T]`` each), and
    per sequence its token count (``[len(seqs)]``)."""
    n = len(seqs)
    counts = np.fromiter(map(attrgetter("num_tokens"), seqs), dtype=np.int64, count=n)
    starts = np.fromiter(map(attrgetter("start_pos"), seqs), dtype=np.int64, count=n)
    slots = np.fromiter(map(attrgetter("slot"), seqs), dtype=np.int64, count=n)
    offsets = np.cumsum(counts) - counts
    positions = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - offsets, counts)
    return positions, np.repeat(slots, counts), counts
