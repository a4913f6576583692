"""Scheduler-side tiered KV: where every page of every request lives, and the copies that move it.

Pure Python and numpy; never touches a GPU. The engine's scheduler decides *which* tokens run;
this class decides *where* their KV lives and emits a :class:`StepPlan` per step.

Per request and logical page ``p`` (tables indexed by the request's slot):
- ``resident[p]`` GPU arena block or -1; ``host[p]`` host block (always set once admitted);
  ``indexer[p]`` indexer-cache block (always set once admitted).
- page state: *dirty* (its rows are not all durable on host), *clean* (durable host copy and a
  GPU block), *host-only* (``resident[p] == -1``; reads go through the hot buffer).

Durability: every row written in a step is mirrored GPU->host after the forward; the worker
acknowledges the step's mirror by ``copy_id == step_id``. ``num_durable`` is the end of the
contiguous acknowledged prefix of a request's tokens.

Modes: ``hisparse`` (GPU first, requests switch to host-read mode under pressure),
``always-host`` (every request reads history through its hot buffer once its prompt is done),
``gpu-only`` (no host tier, full-length GPU reservation at admission, no prefix caching).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hisparse.config import ACTIVE_TAIL_PAGES, KVCacheConfig, cdiv
from hisparse.kv.block_pool import BlockPool
from hisparse.kv.plan import RowCopy, ScheduledSeq, StepPlan, token_layout


@dataclass
class RequestKV:
    """KV bookkeeping of one admitted request (see module docstring for the tables)."""

    req_id: str
    uid: int
    slot: int
    token_ids: list[int]            # shared with the engine: it appends sampled tokens
    prompt_len: int
    num_pages: int                  # pages reserved for max length
    resident: np.ndarray            # views into the coordinator's tables (copies once detached)
    host: np.ndarray
    indexer: np.ndarray
    num_computed: int = 0
    num_durable: int = 0
    num_published: int = 0          # pages whose hash is published (contiguous from page 0)
    page_hashes: list[int] = field(default_factory=list)
    # In-flight mirrors, oldest first: [end of the rows written, acknowledged?].
    pending: deque[list] = field(default_factory=deque)
    host_read: bool = False
    hot_blocks: list[int] = field(default_factory=list)
    # Pages below this index hold no GPU reference of ours (unpinned, lost or never restored).
    pinned_start: int = 0

    @property
    def decoding(self) -> bool:
        """Past its first decode token: every later step computes one token, so it may read
        history through a hot buffer (a prefill chunk reads resident pages only)."""
        return self.num_computed > self.prompt_len


@dataclass
class KVStats:
    spilled_pages: int = 0          # GPU blocks given up by host-read requests (unpinned)
    lost_pages: int = 0             # unpinned pages whose block was reused by someone else
    restored_pages: int = 0         # host -> GPU page restores planned
    prefix_hit_tokens: int = 0
    host_prefix_hit_tokens: int = 0  # hit tokens whose rows had to come back from host
    host_read_switches: int = 0
    mirrored_rows: int = 0


class KVCoordinator:
    def __init__(self, cfg: KVCacheConfig) -> None:
        self.cfg = cfg
        self.bs = cfg.block_size
        self.gpu_pool = BlockPool(cfg.num_gpu_blocks, "gpu", on_reuse=self._on_gpu_block_reuse)
        self.host_pool = BlockPool(cfg.num_host_blocks, "host") if cfg.uses_host else None
        self.indexer_pool = BlockPool(cfg.num_indexer_blocks, "indexer")
        shape = (cfg.max_num_seqs, cfg.max_pages_per_request)
        self.resident_table = np.full(shape, -1, dtype=np.int32)
        self.host_table = np.full(shape, -1, dtype=np.int32)
        self.indexer_table = np.full(shape, -1, dtype=np.int32)
        self.hot_table = np.full((cfg.max_num_seqs, cfg.hot_blocks_per_request), -1,
                                 dtype=np.int32)
        self.free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self.requests: dict[str, RequestKV] = {}
        self.by_uid: dict[int, RequestKV] = {}       # live and draining requests
        self.draining: dict[int, RequestKV] = {}     # finished, waiting for in-flight mirrors
        self.pending_by_step: dict[int, list[tuple[RequestKV, list]]] = {}
        self.stats = KVStats()
        self._uids = itertools.count()
        self._scheduled: list[ScheduledSeq] = []
        self._restore_pages: list[tuple[int, int]] = []          # (host block, gpu block)
        self._indexer_restore_pages: list[tuple[int, int]] = []  # (host block, indexer block)
        self._hot_resets: list[int] = []

    # ------------------------------------------------------------------ queries
    @property
    def num_free_gpu_blocks(self) -> int:
        return self.gpu_pool.num_free

    def get(self, req_id: str) -> RequestKV:
        try:
            return self.requests[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r}") from None

    # ------------------------------------------------------------------ admission
    def admit(self, req_id: str, token_ids: list[int], max_len: int) -> int | None:
        """Admit a request whose prompt is ``token_ids`` and whose length may reach ``max_len``.

        Returns the number of prompt tokens already computed (prefix hit), or None when the pools
        cannot hold it now (GPU blocks are reclaimed from other requests before giving up).
        """
        cfg = self.cfg
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} is already admitted")
        if not 0 < len(token_ids) <= max_len <= cfg.max_model_len:
            raise ValueError(f"request {req_id!r}: need 0 < prompt length ({len(token_ids)}) "
                             f"<= max_len ({max_len}) <= max_model_len ({cfg.max_model_len})")
        if not self.free_slots:
            return None
        num_pages = cdiv(max_len, self.bs)
        hits = self._lookup_prefix(token_ids)
        if self.indexer_pool.num_free < num_pages:
            return None
        if self.host_pool is not None:
            hit_host_free = sum(self.host_pool.is_free(h) for h, _ in hits)
            if self.host_pool.num_free - hit_host_free < num_pages - len(hits):
                return None
        first_chunk = min(len(token_ids) - len(hits) * self.bs, cfg.max_num_batched_tokens)

        def gpu_need() -> int:
            if cfg.mode == "gpu-only":
                return num_pages
            # Restores, plus cached hit blocks that leave the free queue when claimed.
            restore = sum(g is None or self.gpu_pool.is_free(g) for _, g in hits)
            return restore + cdiv(first_chunk, self.bs)

        if self.gpu_pool.num_free < gpu_need():
            self._ensure_free_gpu(gpu_need())
            # Reclaiming may have handed cached hit blocks to others (as hot blocks) or unpinned
            # new ones: look the GPU copies up again. The host hits are unchanged.
            hits = self._lookup_prefix(token_ids)
            if self.gpu_pool.num_free < gpu_need():
                return None

        slot = self.free_slots.pop()
        req = RequestKV(req_id=req_id, uid=next(self._uids), slot=slot, token_ids=token_ids,
                        prompt_len=len(token_ids), num_pages=num_pages,
                        resident=self.resident_table[slot], host=self.host_table[slot],
                        indexer=self.indexer_table[slot])
        self.requests[req_id] = req
        self.by_uid[req.uid] = req
        req.indexer[:num_pages] = self.indexer_pool.allocate(num_pages)
        if self.host_pool is not None:
            # Take every hit block before allocating anything: an allocation could otherwise
            # evict a cached hit that is still to be claimed.
            for page, (host_block, gpu_block) in enumerate(hits):
                self.host_pool.touch(host_block)
                req.host[page] = host_block
                if gpu_block is not None:
                    self.gpu_pool.touch(gpu_block)
                    req.resident[page] = gpu_block
            req.host[len(hits):num_pages] = self.host_pool.allocate(num_pages - len(hits))
            for page, (host_block, gpu_block) in enumerate(hits):
                if gpu_block is None:
                    req.resident[page] = self.gpu_pool.allocate(1)[0]
                    self._restore_pages.append((host_block, int(req.resident[page])))
                    self.stats.restored_pages += 1
                    self.stats.host_prefix_hit_tokens += self.bs
                self._indexer_restore_pages.append((host_block, int(req.indexer[page])))
            req.page_hashes = self._page_hashes(token_ids, len(hits))
        if cfg.mode == "gpu-only":
            req.resident[:num_pages] = self.gpu_pool.allocate(num_pages)
        hit_tokens = len(hits) * self.bs
        req.num_computed = req.num_durable = hit_tokens
        req.num_published = len(hits)
        self.stats.prefix_hit_tokens += hit_tokens
        return hit_tokens

    def _page_hashes(self, token_ids: list[int], num_pages: int) -> list[int]:
        hashes, parent = [], 0
        for p in range(num_pages):
            parent = hash((parent, tuple(token_ids[p * self.bs:(p + 1) * self.bs])))
            hashes.append(parent)
        return hashes

    def _lookup_prefix(self, token_ids: list[int]) -> list[tuple[int, int | None]]:
        """(host block, GPU block or None) for each leading page found in the prefix cache.

        At least one prompt token is always left to compute (its logits start decoding).
        """
        if not self.cfg.enable_prefix_caching or self.host_pool is None:
            return []
        hits = []
        for h in self._page_hashes(token_ids, (len(token_ids) - 1) // self.bs):
            host_block = self.host_pool.lookup(h)
            if host_block is None:
                break
            hits.append((host_block, self.gpu_pool.lookup(h)))
        return hits

    # ------------------------------------------------------------------ per-step scheduling
    def schedule(self, req_id: str, num_tokens: int) -> bool:
        """Put tokens ``[num_computed, num_computed + num_tokens)`` of a request in this step.

        Allocates the GPU pages they write (reclaiming first if short). False: no room; the
        caller should preempt someone and retry, or leave the request for a later step.
        """
        req = self.get(req_id)
        start = req.num_computed
        end = start + num_tokens
        if num_tokens <= 0 or end > min(len(req.token_ids), req.num_pages * self.bs):
            raise ValueError(f"request {req_id!r}: cannot schedule tokens [{start}, {end}) "
                             f"with {len(req.token_ids)} known tokens")
        first_page, last_page = start // self.bs, (end - 1) // self.bs
        resident = req.resident
        if first_page == last_page:  # the decode fast path
            new_pages = [first_page] if resident[first_page] < 0 else []
        else:
            new_pages = [p for p in range(first_page, last_page + 1) if resident[p] < 0]
        if new_pages:
            if not self._ensure_free_gpu(len(new_pages)):
                return False
            resident[new_pages] = self.gpu_pool.allocate(len(new_pages))
        req.num_computed = end
        if req.host_read and new_pages:
            self._unpin_clean_pages(req)  # the tail moved on
        self._scheduled.append(ScheduledSeq(req_id, req.slot, start, num_tokens, req.host_read,
                                            end >= len(req.token_ids), start < req.prompt_len))
        return True

    def build_plan(self, step_id: int) -> StepPlan:
        """Emit the plan of the tokens scheduled since the last call."""
        self._switch_to_host_read()
        seqs, self._scheduled = self._scheduled, []
        requests = self.requests
        for s in seqs:  # a request may have been switched after it was scheduled
            s.host_read = requests[s.req_id].host_read
        mirrors = indexer_mirrors = RowCopy()
        if self.cfg.uses_host and seqs:
            mirrors, indexer_mirrors = self._plan_mirrors(step_id, seqs)
        restores = self._pages_to_rows(self._restore_pages)
        indexer_restores = self._pages_to_rows(self._indexer_restore_pages)
        self._restore_pages, self._indexer_restore_pages = [], []
        hot_resets = np.asarray(self._hot_resets, dtype=np.int32)
        self._hot_resets = []
        return StepPlan(step_id=step_id, seqs=seqs, block_size=self.bs,
                        resident_block_table=self.resident_table,
                        host_block_table=self.host_table,
                        indexer_block_table=self.indexer_table,
                        hot_block_table=self.hot_table, hot_resets=hot_resets,
                        restores=restores, indexer_restores=indexer_restores,
                        mirrors=mirrors, indexer_mirrors=indexer_mirrors)

    def _plan_mirrors(self, step_id: int, seqs: list[ScheduledSeq]) -> tuple[RowCopy, RowCopy]:
        entries = []
        requests = self.requests
        for s in seqs:
            req = requests[s.req_id]
            write = [s.start_pos + s.num_tokens, False]
            req.pending.append(write)
            entries.append((req, write))
        self.pending_by_step[step_id] = entries
        positions, row_slots, _ = token_layout(seqs)
        pages, offs = positions // self.bs, positions % self.bs
        host_rows = self.host_table[row_slots, pages].astype(np.int64) * self.bs + offs
        gpu_rows = self.resident_table[row_slots, pages].astype(np.int64) * self.bs + offs
        idx_rows = self.indexer_table[row_slots, pages].astype(np.int64) * self.bs + offs
        self.stats.mirrored_rows += len(positions)
        return (RowCopy(gpu_rows, host_rows, copy_id=step_id),
                RowCopy(idx_rows, host_rows.copy(), copy_id=step_id))

    def _pages_to_rows(self, pages: list[tuple[int, int]]) -> RowCopy:
        if not pages:
            return RowCopy()
        src, dst = np.asarray(pages, dtype=np.int64).T
        offs = np.arange(self.bs, dtype=np.int64)
        return RowCopy((src[:, None] * self.bs + offs).ravel(),
                       (dst[:, None] * self.bs + offs).ravel())

    # ------------------------------------------------------------------ acknowledgements
    def apply_acks(self, copy_ids) -> None:
        """The worker reports the mirrors of these steps durable on host (any order)."""
        touched = {}
        for step_id in copy_ids:
            for req, write in self.pending_by_step.pop(step_id, ()):
                write[1] = True
                touched[req.uid] = req
        for req in touched.values():
            pending = req.pending
            old_pages = req.num_durable // self.bs
            while pending and pending[0][1]:
                req.num_durable = pending.popleft()[0]
            if req.num_durable // self.bs > old_pages:  # a page turned clean
                self._publish_durable(req)
                if req.host_read:
                    self._unpin_clean_pages(req)
            if not pending and req.uid in self.draining:
                self._free_blocks(self.draining.pop(req.uid))

    def _publish_durable(self, req: RequestKV) -> None:
        """Publish prefix hashes of full, durable pages, contiguously from page 0 (I3)."""
        if not self.cfg.enable_prefix_caching or self.host_pool is None:
            return
        num_full = req.num_durable // self.bs
        if num_full <= req.num_published:
            return
        parent = req.page_hashes[-1] if req.page_hashes else 0
        for p in range(len(req.page_hashes), num_full):
            parent = hash((parent, tuple(req.token_ids[p * self.bs:(p + 1) * self.bs])))
            req.page_hashes.append(parent)
        for p in range(req.num_published, num_full):
            self.host_pool.set_hash(int(req.host[p]), req.page_hashes[p])
            if req.resident[p] >= 0:
                self.gpu_pool.set_hash(int(req.resident[p]), req.page_hashes[p])
        req.num_published = num_full

    # ------------------------------------------------------------------ host-read mode
    def _clean_pinned_pages(self, req: RequestKV) -> range:
        """Pages we may unpin now: clean, pinned, and not among the last 2 pages (I4)."""
        tail_start = max(0, cdiv(req.num_computed, self.bs) - ACTIVE_TAIL_PAGES)
        durable_end = req.num_durable // self.bs
        return range(req.pinned_start, min(tail_start, durable_end))

    def _unpin_clean_pages(self, req: RequestKV) -> None:
        pages = self._clean_pinned_pages(req)
        for p in pages:
            block = int(req.resident[p])
            if block >= 0:
                self.gpu_pool.unpin(block, (req.uid, p))
                self.stats.spilled_pages += 1
        req.pinned_start = max(req.pinned_start, pages.stop)

    def _on_gpu_block_reuse(self, block: int, token: tuple[int, int]) -> None:
        uid, page = token
        req = self.by_uid.get(uid)
        if req is not None and req.resident[page] == block:
            req.resident[page] = -1
            self.stats.lost_pages += 1

    def _switch(self, req: RequestKV) -> bool:
        """Move a decoding request to host-read mode: unpin its clean pages, lease hot blocks.

        Both happen before the worker sees the plan, so the hot blocks may come from the
        request's own unpinned pages: those pages turn host-only and are read through them.
        """
        n_hot = self.cfg.hot_blocks_per_request
        refs = self.gpu_pool.ref_counts
        freed = sum(1 for p in self._clean_pinned_pages(req)
                    if req.resident[p] >= 0 and refs[req.resident[p]] == 1)
        if self.gpu_pool.num_free + freed < n_hot:
            return False
        req.host_read = True
        self._unpin_clean_pages(req)
        req.hot_blocks = self.gpu_pool.allocate(n_hot)
        self.hot_table[req.slot] = req.hot_blocks
        self._hot_resets.append(req.slot)
        self.stats.host_read_switches += 1
        return True

    def _switch_to_host_read(self, target_free: int | None = None) -> None:
        """Switch requests until ``target_free`` blocks are free (default: the watermark)."""
        cfg = self.cfg
        if cfg.mode == "gpu-only":
            return
        if cfg.mode == "always-host":
            for req in list(self.requests.values()):
                if req.decoding and not req.host_read:
                    self._switch(req)
        target = cfg.watermark if target_free is None else target_free
        if self.gpu_pool.num_free >= target:
            return
        candidates = [r for r in self.requests.values() if r.decoding and not r.host_read]
        # Most reclaimable pages first; switching one whose pages are not clean yet still
        # pays off a few steps later as its acknowledgements arrive.
        candidates.sort(key=lambda r: len(self._clean_pinned_pages(r)), reverse=True)
        for req in candidates:
            if self.gpu_pool.num_free >= target:
                break
            if req.num_computed // self.bs > cfg.hot_blocks_per_request + ACTIVE_TAIL_PAGES:
                self._switch(req)

    def _ensure_free_gpu(self, need: int) -> bool:
        if self.gpu_pool.num_free < need:
            self._switch_to_host_read(target_free=max(need, self.cfg.watermark))
        return self.gpu_pool.num_free >= need

    # ------------------------------------------------------------------ leaving
    def finish(self, req_id: str) -> None:
        """Request finished or aborted: free its KV once its in-flight mirrors are durable."""
        req = self.requests.pop(req_id)
        self._scheduled = [s for s in self._scheduled if s.req_id != req_id]
        if req.hot_blocks:
            for block in req.hot_blocks:
                self.gpu_pool.release(block)
            req.hot_blocks = []
        self.hot_table[req.slot] = -1
        # Detach: keep our own copies of the tables and give the slot back.
        req.resident, req.host, req.indexer = (req.resident.copy(), req.host.copy(),
                                               req.indexer.copy())
        self.resident_table[req.slot] = self.host_table[req.slot] = -1
        self.indexer_table[req.slot] = -1
        self.free_slots.append(req.slot)
        if req.pending:
            self.draining[req.uid] = req
        else:
            self._free_blocks(req)

    abort = finish

    def preempt(self, req_id: str) -> None:
        """Give back all of a running request's KV; published pages stay in the prefix cache,
        so re-admitting it (same token ids) resumes from its durable prefix."""
        self.finish(req_id)

    def _free_blocks(self, req: RequestKV) -> None:
        self.by_uid.pop(req.uid, None)
        for p in range(req.num_pages):
            block = int(req.resident[p])
            if block >= 0 and p >= req.pinned_start:
                self.gpu_pool.release(block)
            if self.host_pool is not None:
                self.host_pool.release(int(req.host[p]))
            self.indexer_pool.release(int(req.indexer[p]))
