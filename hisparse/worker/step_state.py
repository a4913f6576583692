"""Device-resident step state: persistent block tables updated incrementally, and the step's
token inputs and copy row lists, all uploaded from pinned staging (DESIGN section 7).

Per step the worker calls :meth:`StepState.stage_plan` once (changed table rows, hot resets and
every copy's row lists: one host->device copy from pinned staging), then
:meth:`StepState.stage_tokens` per forward (ids, positions, slots, sampled-token indices: one
more). Both the eager path and the captured CUDA graphs read the same persistent buffers
(``tables``, ``ids``, ``positions``, ``slots``), so a graph replay needs no table upload of
its own. No ``.tolist()``, ``.item()`` or pageable upload happens here.

The rows to upload are the plan's ``changed_rows`` (the KV core reports every table row it
wrote since the previous plan), so the table work per step is proportional to what changed, not
to the tables. The device tables are correct only if every plan is staged, in order.

Staging buffers are double-buffered: the host fills one while the copy from the other may still
be in flight; before reusing one it waits for the copy that last read it (an event recorded
right after that copy, which ran at the start of the step before the previous one).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from hisparse.config import KVCacheConfig
from hisparse.kv.plan import TABLES, ScheduledSeq, StepPlan, token_layout

COPIES = ("restores", "indexer_restores", "mirrors", "indexer_mirrors")


class _Staging:
    """Two pinned (CUDA) host buffers (int64 unless ``dtype``) and a device buffer; grows only
    between steps."""

    def __init__(self, device: torch.device, capacity: int,
                 dtype: torch.dtype = torch.int64) -> None:
        self.device = device
        self.dtype = dtype
        self.pin = device.type == "cuda"
        self.turn = 0
        self.events: list[torch.cuda.Event | None] = [None, None]
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.host = [torch.empty(capacity, dtype=self.dtype, pin_memory=self.pin)
                     for _ in range(2)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = torch.empty(capacity, dtype=self.dtype, device=self.device)

    def begin(self, n: int) -> np.ndarray:
        """A host array of ``n`` values to fill (safe to write now)."""
        if n > self.capacity:
            for e in self.events:
                if e is not None:
                    e.synchronize()
            self.events = [None, None]
            self._alloc(max(n, 2 * self.capacity))
        self.turn ^= 1
        e = self.events[self.turn]
        if e is not None:
            e.synchronize()   # the copy from this buffer (two uploads ago) has finished
        return self.host_np[self.turn][:n]

    def upload(self, n: int) -> Tensor:
        """One host -> device copy of the filled prefix; returns its device view."""
        if self.dev.device.type == "cpu":
            self.dev[:n].copy_(self.host[self.turn][:n])
            return self.dev[:n]
        self.dev[:n].copy_(self.host[self.turn][:n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.events[self.turn] = ev
        return self.dev[:n]


class StepState:
    def __init__(self, cfg: KVCacheConfig, device: torch.device, max_tokens: int) -> None:
        R = cfg.max_num_seqs
        widths = {"resident": cfg.max_pages_per_request, "host": cfg.max_pages_per_request,
                  "indexer": cfg.max_pages_per_request, "hot": cfg.hot_blocks_per_request}
        self.device = device
        self.max_tokens = max(1, int(max_tokens))
        self.tables = {n: torch.full((R, w), -1, dtype=torch.int32, device=device)
                       for n, w in widths.items()}
        self.ids = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
        self.slots = torch.full((self.max_tokens,), -1, dtype=torch.int32, device=device)
        self.sample_idx = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
        self.sample_slots: Tensor = self.tables["hot"].new_zeros(0, dtype=torch.long)
        # The token each request slot sampled last (device-side): the input of a decode token
        # whose id the host does not know yet (an overlapped step; ``-1`` in ``input_ids``).
        self.last_sampled = torch.zeros(R, dtype=torch.long, device=device)
        fixed = sum(R * (1 + w) for w in widths.values()) + R
        self._plan_staging = _Staging(device, fixed + 4096)
        self._token_staging = _Staging(device, 4 * self.max_tokens)
        self.hot_resets: Tensor = self.tables["hot"].new_zeros(0, dtype=torch.long)
        self.copies: dict[str, tuple[Tensor, Tensor]] = {}
        self.rows_uploaded = 0   # table rows uploaded so far (tests, stats)

    # ------------------------------------------------------------------ per step
    def stage_plan(self, plan: StepPlan) -> None:
        """Upload the table rows the plan reports changed since the previous plan, the hot
        resets and every copy's row lists (one host -> device copy). Call for every plan, in
        order."""
        changed = plan.changed_rows
        n = sum(getattr(changed, name).size * (1 + getattr(plan, f"{name}_block_table").shape[1])
                for name in TABLES)
        resets = np.asarray(plan.hot_resets, dtype=np.int64)
        n += resets.size
        sample_slots = np.fromiter((s.slot for s in plan.seqs if s.sample), dtype=np.int64)
        n += sample_slots.size
        ops = [getattr(plan, c) for c in COPIES]
        n += sum(2 * len(op) for op in ops)
        buf = self._plan_staging.begin(n)
        o = 0
        spans = {}
        for name in TABLES:
            rows = getattr(changed, name)
            if rows.size:
                new = getattr(plan, f"{name}_block_table")
                w = new.shape[1]
                buf[o:o + rows.size] = rows
                buf[o + rows.size:o + rows.size * (1 + w)] = new[rows].ravel()
                spans[name] = (o, rows.size, w)
                o += rows.size * (1 + w)
        buf[o:o + resets.size] = resets
        reset_span = (o, resets.size)
        o += resets.size
        buf[o:o + sample_slots.size] = sample_slots
        sample_span = (o, sample_slots.size)
        o += sample_slots.size
        copy_spans = {}
        for c, op in zip(COPIES, ops):
            k = len(op)
            buf[o:o + k] = op.src_rows
            buf[o + k:o + 2 * k] = op.dst_rows
            copy_spans[c] = (o, k)
            o += 2 * k
        dev = self._plan_staging.upload(n) if n else self._plan_staging.dev[:0]
        for name, (o, k, w) in spans.items():
            self.tables[name].index_copy_(0, dev[o:o + k],
                                          dev[o + k:o + k * (1 + w)].view(k, w).to(torch.int32))
            self.rows_uploaded += k
        o, k = reset_span
        self.hot_resets = dev[o:o + k]
        o, k = sample_span
        self.sample_slots = dev[o:o + k]
        self.copies = {c: (dev[o:o + k], dev[o + k:o + 2 * k]) for c, (o, k) in copy_spans.items()}

    def stage_tokens(self, seqs: list[ScheduledSeq], input_ids: list[int],
                     pad_to: int | None = None) -> tuple[int, int]:
        """Fill ``ids``, ``positions``, ``slots`` (padding: slot -1, position 0, id 0 up to
        ``pad_to``) and ``sample_idx`` (flat index of each sampling sequence's last token).
        An id of ``-1`` is the token its slot sampled last (:meth:`commit_sampled`), still on
        the device. Returns ``(num_tokens, num_sampled)``."""
        positions, token_slot, counts = token_layout(seqs)
        T = positions.size
        Tp = max(T, pad_to or 0)
        if Tp > self.max_tokens:
            raise ValueError(f"step has {Tp} tokens, more than the {self.max_tokens} the step "
                             f"state was sized for")
        last = np.cumsum(counts) - 1
        sample = np.fromiter((s.sample for s in seqs), dtype=bool, count=len(seqs))
        sidx = last[sample]
        S = sidx.size
        buf = self._token_staging.begin(3 * Tp + S)
        buf[:T] = input_ids
        from_device = bool((buf[:T] < 0).any())
        buf[T:Tp] = 0
        buf[Tp:Tp + T] = positions
        buf[Tp + T:2 * Tp] = 0
        buf[2 * Tp:2 * Tp + T] = token_slot
        buf[2 * Tp + T:3 * Tp] = -1
        buf[3 * Tp:] = sidx
        dev = self._token_staging.upload(3 * Tp + S)
        self.ids[:Tp].copy_(dev[:Tp])
        self.positions[:Tp].copy_(dev[Tp:2 * Tp])
        self.slots[:Tp].copy_(dev[2 * Tp:3 * Tp])
        self.sample_idx[:S].copy_(dev[3 * Tp:])
        if from_device:
            ids = self.ids[:T]
            ids.copy_(torch.where(ids < 0, self.last_sampled[self.slots[:T].long().clamp(min=0)],
                                  ids))
        return T, S

    def commit_sampled(self, tokens: Tensor) -> None:
        """Record the tokens sampled for the staged plan's sampling sequences (int64, device,
        plan order) as their slots' last tokens; call before the next :meth:`stage_plan`."""
        if self.sample_slots.numel():
            # A failed row (-1) still feeds a valid id to a step already queued for it (whose
            # result is dropped): an out-of-range embedding index would fault the device.
            self.last_sampled.index_copy_(0, self.sample_slots,
                                          tokens.to(torch.long).clamp(min=0))
