"""Host-read reclaim policy: which requests switch to host-read mode and when, and which of
their GPU pages they give up (unpin).

A request in host-read mode keeps only its tail pages, its dirty pages and its leased hot
blocks on GPU (DESIGN.md §4, I4/I5); its clean pages are unpinned: the GPU block goes back to
the pool but stays readable by the request until the pool hands it to someone else.
"""

from __future__ import annotations

import numpy as np

from hisparse.config import ACTIVE_TAIL_PAGES, KVCacheConfig, Mode, cdiv
from hisparse.kv.block_pool import BlockPool
from hisparse.kv.state import KVStats, RequestKV


class Reclaimer:
    def __init__(self, cfg: KVCacheConfig, gpu_pool: BlockPool, hot_table: np.ndarray,
                 stats: KVStats) -> None:
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.gpu_pool = gpu_pool
        self.hot_table = hot_table
        self.stats = stats
        # Decoding requests not in host-read mode (by uid): the only ones a switch may pick.
        self.candidates: dict[int, RequestKV] = {}
        # Requests still prefilling (by uid, admission order): under pressure their clean pages
        # (durable, outside the tail) are released; later chunks read them through staging.
        self.prefilling: dict[int, RequestKV] = {}
        self.hot_resets: list[int] = []     # slots whose hot state the next plan clears

    # ------------------------------------------------------------------ membership
    def started_prefill(self, req: RequestKV) -> None:
        if self.cfg.mode is not Mode.GPU_ONLY and req.host_backed:
            self.prefilling[req.uid] = req

    def started_decoding(self, req: RequestKV) -> None:
        self.prefilling.pop(req.uid, None)
        if self.cfg.mode is not Mode.GPU_ONLY and not req.host_read and req.host_backed:
            self.candidates[req.uid] = req

    def forget(self, req: RequestKV) -> None:
        self.candidates.pop(req.uid, None)
        self.prefilling.pop(req.uid, None)

    # ------------------------------------------------------------------ unpinning
    def clean_pinned_pages(self, req: RequestKV) -> range:
        """Pages we may unpin now: clean, pinned, and not among the last 2 pages (I4)."""
        tail_start = max(0, cdiv(req.num_computed, self.block_size) - ACTIVE_TAIL_PAGES)
        durable_end = req.num_durable // self.block_size
        return range(req.pinned_start, min(tail_start, durable_end))

    def unpin_clean_pages(self, req: RequestKV) -> int:
        """Unpin the clean pages outside the tail; returns how many GPU blocks were unpinned."""
        pages = self.clean_pinned_pages(req)
        n = 0
        for p in pages:
            block = int(req.resident[p])
            if block >= 0:
                self.gpu_pool.unpin(block, (req.uid, p))
                n += 1
        self.stats.spilled_pages += n
        req.pinned_start = max(req.pinned_start, pages.stop)
        return n

    def release_prefill_pages(self, need: int) -> None:
        """Unpin clean pages of prefilling requests (oldest first) until ``need`` blocks are
        free: a long prompt's complete, durable pages go host-only during its own prefill."""
        for req in list(self.prefilling.values()):
            if self.gpu_pool.num_free >= need:
                return
            self.stats.prefill_released_pages += self.unpin_clean_pages(req)

    @staticmethod
    def has_host_only_history(req: RequestKV, end: int, block_size: int) -> bool:
        """Some page of tokens ``[0, end)`` has no GPU block of ours: never restored
        (``resident[p] < 0``) or unpinned (``p < pinned_start``). An unpinned page keeps its
        block id in ``resident`` until the pool hands the block to someone else, which may
        happen at any later allocation: it must count as host-only from the moment it is
        unpinned, or a request could start decoding outside host-read mode over history that
        is about to disappear from the GPU."""
        if end <= 0:
            return False
        num_pages = cdiv(end, block_size)
        return req.pinned_start > 0 or bool((req.resident[:num_pages] < 0).any())

    # ------------------------------------------------------------------ switching
    def switch(self, req: RequestKV) -> bool:
        """Move a decoding request to host-read mode: unpin its clean pages, lease hot blocks.

        Both happen before the worker sees the plan, so the hot blocks may come from the
        request's own unpinned pages: those pages turn host-only and are read through them.
        """
        n_hot = self.cfg.hot_blocks_per_request
        refs = self.gpu_pool.ref_counts
        freed = sum(1 for p in self.clean_pinned_pages(req)
                    if req.resident[p] >= 0 and refs[req.resident[p]] == 1)
        if self.gpu_pool.num_free + freed < n_hot:
            return False
        req.host_read = True
        self.candidates.pop(req.uid, None)
        self.unpin_clean_pages(req)
        req.hot_blocks = self.gpu_pool.allocate(n_hot)
        self.hot_table[req.slot] = req.hot_blocks
        self.hot_resets.append(req.slot)
        self.stats.host_read_switches += 1
        return True

    def switch_to_host_read(self, target_free: int | None = None) -> None:
        """Switch requests until ``target_free`` blocks are free (default: the watermark).

        ``always-host`` switches every decoding request. Work is proportional to the number of
        candidates, and nothing is sorted while enough blocks are free.
        """
        cfg = self.cfg
        if not self.candidates:
            return
        if cfg.mode is Mode.ALWAYS_HOST:
            for req in sorted(self.candidates.values(), key=_admission_order):
                self.switch(req)
        target = cfg.watermark if target_free is None else target_free
        if self.gpu_pool.num_free >= target or not self.candidates:
            return
        # Most reclaimable pages first (ties: oldest admission); switching one whose pages are
        # not clean yet still pays off a few steps later as its acknowledgements arrive.
        candidates = sorted(self.candidates.values(),
                            key=lambda r: (-len(self.clean_pinned_pages(r)), r.uid))
        for req in candidates:
            if self.gpu_pool.num_free >= target:
                break
            if self._worth_switching(req):
                self.switch(req)

    def _worth_switching(self, req: RequestKV) -> bool:
        """Longer than its hot buffer and tail: switching it can give pages back."""
        return (req.num_computed // self.block_size
                > self.cfg.hot_blocks_per_request + ACTIVE_TAIL_PAGES)

    def reclaimable_blocks(self) -> int:
        """An upper bound on the GPU blocks :meth:`ensure_free_gpu` could free now: the clean
        pinned pages of the candidates a switch would pick (less the hot blocks each switch
        leases) and of the prefilling requests (shared pages counted too: O(requests), cheap
        enough for every step the queue's head waits). Used to refuse a hopeless reclaim
        before it switches anyone."""
        n_hot = self.cfg.hot_blocks_per_request
        n = sum(max(0, len(self.clean_pinned_pages(r)) - n_hot)
                for r in self.candidates.values() if self._worth_switching(r))
        return n + sum(len(self.clean_pinned_pages(r)) for r in self.prefilling.values())

    def ensure_free_gpu(self, need: int) -> bool:
        """Reclaim (switch requests) until ``need`` GPU blocks are free; False if it cannot."""
        if self.gpu_pool.num_free < need:
            self.switch_to_host_read(target_free=max(need, self.cfg.watermark))
        if self.gpu_pool.num_free < need:
            self.release_prefill_pages(need)
        return self.gpu_pool.num_free >= need


def _admission_order(req: RequestKV) -> int:
    return req.uid
