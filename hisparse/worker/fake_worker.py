"""A CPU stand-in for the GPU worker that executes StepPlans with real byte copies.

It is how tests (and ``hisparse simulate``) exercise the KV core without a model:
- the "GPU arena", "indexer cache" and "host pool" are CPU tensors ``[layers, rows, width]``,
  poisoned at start;
- the "forward" writes, for every scheduled token, a row whose bytes are a function of the
  request's token prefix and the layer, and reads every history row it is entitled to read
  (resident rows directly, host-only rows through a per-(slot, layer) hot buffer), checking the
  bytes;
- its own copy of the block tables is updated only from each plan's ``changed_rows`` (as the
  real worker's device tables are) and must equal the plan's tables: a table write the KV core
  does not report is caught;
- mirror copies are performed *lazily*, when their acknowledgement is released 0..``max_delay``
  steps later and in random order: a page released before its acknowledgement has no valid host
  copy, and the checks see it.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from hisparse.config import KVCacheConfig
from hisparse.kv.plan import TABLES, RowCopy, ScheduledSeq, StepPlan, flat_rows

POISON = -7

# (req_id, positions int64 [n]) -> expected row keys int64 [n] (must depend only on the
# token prefix up to and including each position).
RowKeyFn = Callable[[str, np.ndarray], np.ndarray]


class KVMismatch(AssertionError):
    pass


class FakeWorker:
    def __init__(self, cfg: KVCacheConfig, row_key: RowKeyFn, num_layers: int = 2,
                 max_delay: int = 3, seed: int = 0, reads_per_token: int = 8) -> None:
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.num_layers = num_layers
        self.row_key = row_key
        self.max_delay = max_delay
        self.reads_per_token = reads_per_token
        self.rng = random.Random(seed)
        host_rows = cfg.num_host_blocks * self.block_size if cfg.uses_host else 1
        self.arena = torch.full((num_layers, cfg.num_gpu_blocks * self.block_size), POISON,
                                dtype=torch.int64)
        self.indexer = torch.full((num_layers, cfg.num_indexer_blocks * self.block_size), POISON,
                                  dtype=torch.int64)
        self.host = torch.full((num_layers, host_rows), POISON, dtype=torch.int64)
        self.staged_rows = 0
        self.host_indexer = torch.full((num_layers, host_rows), POISON, dtype=torch.int64)
        self.layer_salt = torch.arange(num_layers, dtype=torch.int64)[:, None] * 1_000_003
        # hot[slot][layer]: {position: hot slot index}, in LRU order (oldest first); the rows
        # themselves live in the arena rows of the slot's leased hot blocks.
        self.hot: dict[int, list[OrderedDict[int, int]]] = {}
        self.in_flight: list[tuple[int, int, RowCopy, RowCopy]] = []  # (due, copy_id, ...)
        self.tables = {name: np.full((cfg.max_num_seqs, width), -1, dtype=np.int32)
                       for name, width in zip(TABLES, (cfg.max_pages_per_request,) * 3
                                              + (cfg.hot_blocks_per_request,))}
        self.step = 0
        self.hot_hits = self.hot_misses = 0
        self.h2d_rows = self.d2h_rows = 0

    # ------------------------------------------------------------------ execution
    def execute(self, plan: StepPlan | None) -> list[int]:
        """Run one step (or none) and return the copy ids acknowledged now."""
        self.step += 1
        if plan is not None:
            self._apply_changed_rows(plan)
            for slot in plan.hot_resets.tolist():
                self.hot[slot] = [OrderedDict() for _ in range(self.num_layers)]
            self._copy(self.host, self.arena, plan.restores)
            self._copy(self.host_indexer, self.indexer, plan.indexer_restores)
            self.h2d_rows += len(plan.restores)
            for seq in plan.seqs:
                self._forward_seq(plan, seq)
            if len(plan.mirrors) or len(plan.indexer_mirrors):
                due = self.step + self.rng.randint(0, self.max_delay)
                self.in_flight.append((due, plan.mirrors.copy_id, plan.mirrors,
                                       plan.indexer_mirrors))
        return self._release_acks()

    def _apply_changed_rows(self, plan: StepPlan) -> None:
        for name in TABLES:
            table, rows = getattr(plan, f"{name}_block_table"), getattr(plan.changed_rows, name)
            self.tables[name][rows] = table[rows]
            if not np.array_equal(self.tables[name], table):
                stale = np.flatnonzero((self.tables[name] != table).any(axis=1)).tolist()
                raise KVMismatch(f"step {plan.step_id}: {name} table rows {stale} changed but "
                                 f"were not reported in changed_rows")

    def drain(self) -> list[int]:
        """Complete every in-flight copy now."""
        done = [item[1] for item in self.in_flight]
        for _, _, mirrors, indexer_mirrors in self.in_flight:
            self._apply_mirror(mirrors, indexer_mirrors)
        self.in_flight = []
        return done

    def _release_acks(self) -> list[int]:
        due = [item for item in self.in_flight if item[0] <= self.step]
        self.in_flight = [item for item in self.in_flight if item[0] > self.step]
        self.rng.shuffle(due)
        for _, _, mirrors, indexer_mirrors in due:
            self._apply_mirror(mirrors, indexer_mirrors)
        return [item[1] for item in due]

    def _apply_mirror(self, mirrors: RowCopy, indexer_mirrors: RowCopy) -> None:
        self._copy(self.arena, self.host, mirrors)
        self._copy(self.indexer, self.host_indexer, indexer_mirrors)
        self.d2h_rows += len(mirrors)

    @staticmethod
    def _copy(src: torch.Tensor, dst: torch.Tensor, op: RowCopy) -> None:
        if len(op):
            dst[:, torch.from_numpy(op.dst_rows)] = src[:, torch.from_numpy(op.src_rows)]

    def land(self, job, req_id: str) -> None:
        """A remote prefill's rows arrive (what a NIXL load writes): the pulled positions' rows
        and keys into the job's host blocks (the KV core's next plan restores the GPU ones)."""
        bs, first = self.block_size, job.first_page * self.block_size
        pos = np.arange(first, job.remote.num_tokens, dtype=np.int64)
        i, off = pos // bs - job.first_page, pos % bs
        rows = self.expected(req_id, pos)
        host = torch.from_numpy(job.host_blocks[i].astype(np.int64) * bs + off)
        self.host[:, host] = rows
        self.host_indexer[:, host] = rows

    def expected(self, req_id: str, positions: np.ndarray) -> torch.Tensor:
        """The rows every layer must hold at ``positions`` of a request (``[layers, n]``)."""
        keys = torch.from_numpy(np.asarray(self.row_key(req_id, positions), dtype=np.int64))
        return keys[None, :] + self.layer_salt

    def _forward_seq(self, plan: StepPlan, seq: ScheduledSeq) -> None:
        block_size = self.block_size
        slot = seq.slot
        if seq.host_read and seq.num_tokens > 1:
            raise KVMismatch(f"{seq.req_id}: a multi-token chunk in host-read mode (its union "
                             "of selections may not fit the hot buffer)")
        # Write this step's rows (MLA row and indexer key) in every layer.
        new_pos = np.arange(seq.start_pos, seq.start_pos + seq.num_tokens, dtype=np.int64)
        kv_rows = flat_rows(plan.resident_block_table, slot, new_pos, block_size)
        if (kv_rows < 0).any():
            raise KVMismatch(f"{seq.req_id}: writing positions without a GPU page")
        expected_new = self.expected(seq.req_id, new_pos)
        self.arena[:, torch.from_numpy(kv_rows)] = expected_new
        idx_rows = flat_rows(plan.indexer_block_table, slot, new_pos, block_size)
        self.indexer[:, torch.from_numpy(idx_rows)] = expected_new
        # The indexer reads every history key; attention reads a sample (a fake top-k).
        hist = np.arange(seq.start_pos, dtype=np.int64)
        if len(hist):
            idx_rows = flat_rows(plan.indexer_block_table, slot, hist, block_size)
            if not torch.equal(self.indexer[:, torch.from_numpy(idx_rows)],
                               self.expected(seq.req_id, hist)):
                raise KVMismatch(f"{seq.req_id}: indexer keys differ from what was written")
            k = min(len(hist), self.reads_per_token)
            reads = np.asarray(sorted(self.rng.sample(range(len(hist)), k)), dtype=np.int64)
            self._read_rows(plan, seq, reads)

    def _read_rows(self, plan: StepPlan, seq: ScheduledSeq, positions: np.ndarray) -> None:
        block_size = self.block_size
        rows = flat_rows(plan.resident_block_table, seq.slot, positions, block_size)
        expected = self.expected(seq.req_id, positions)
        got = torch.full_like(expected, POISON)
        is_res = rows >= 0
        if is_res.any():
            got[:, torch.from_numpy(is_res)] = self.arena[:, torch.from_numpy(rows[is_res])]
        if not is_res.all() and seq.staged and not seq.host_read:
            # Staged prefill (issue 14): host-only rows are read from the host pool through
            # the staging area; they must be durable there.
            miss = ~is_res
            host_rows = flat_rows(plan.host_block_table, seq.slot, positions[miss], block_size)
            if (host_rows < 0).any():
                raise KVMismatch(f"{seq.req_id}: staged history row without a host block")
            got[:, torch.from_numpy(miss)] = self.host[:, torch.from_numpy(host_rows)]
            self.staged_rows += int(miss.sum())
        elif not is_res.all():
            if not seq.host_read:
                raise KVMismatch(f"{seq.req_id}: non-resident history but not in host-read mode")
            hot = self.hot[seq.slot]
            hot_blocks = plan.hot_block_table[seq.slot]
            capacity = self.cfg.hot_buffer_size
            host_rows = flat_rows(plan.host_block_table, seq.slot, positions, block_size)
            for i in np.nonzero(~is_res)[0].tolist():
                pos = int(positions[i])
                for layer in range(self.num_layers):
                    lru = hot[layer]
                    if pos in lru:
                        self.hot_hits += 1
                        lru.move_to_end(pos)
                    else:
                        self.hot_misses += 1
                        j = lru.popitem(last=False)[1] if len(lru) >= capacity else len(lru)
                        lru[pos] = j
                        self.arena[layer, self._hot_row(hot_blocks, j)] = \
                            self.host[layer, int(host_rows[i])]
                    got[layer, i] = self.arena[layer, self._hot_row(hot_blocks, lru[pos])]
        if not torch.equal(got, expected):
            bad = (got != expected).any(0).nonzero().flatten()[:5].tolist()
            raise KVMismatch(f"{seq.req_id}: rows at positions {positions[bad].tolist()} "
                             f"read back wrong (resident={is_res[bad].tolist()})")

    def _hot_row(self, hot_blocks: np.ndarray, j: int) -> int:
        """Flat row of hot slot ``j`` (the buffer's rows in leased-block order)."""
        row = int(flat_rows(hot_blocks[None], 0, j, self.block_size))
        if row < 0:
            raise KVMismatch("host-read request without leased hot blocks")
        return row

    # ------------------------------------------------------------------ checks
    def read_back(self, resident: np.ndarray, host: np.ndarray,
                  positions: np.ndarray) -> torch.Tensor:
        """What a request's tables say its rows are: GPU copy if resident, else host copy.

        ``resident`` and ``host`` are one request's rows of the block tables."""
        rows = flat_rows(resident[None], 0, positions, self.block_size)
        out = torch.full((self.num_layers, len(positions)), POISON, dtype=torch.int64)
        is_res = rows >= 0
        if is_res.any():
            out[:, torch.from_numpy(is_res)] = self.arena[:, torch.from_numpy(rows[is_res])]
        if not is_res.all():
            hrows = flat_rows(host[None], 0, positions[~is_res], self.block_size)
            out[:, torch.from_numpy(~is_res)] = self.host[:, torch.from_numpy(hrows)]
        return out
