"""Scheduler-side tiered KV: where every page of every request lives, and the copies that move it.

Pure Python and numpy; never touches a GPU (importing it loads no torch). The engine's scheduler
decides *which* tokens run; this class decides *where* their KV lives and emits a
:class:`StepPlan` per step. Its parts: :class:`~hisparse.kv.prefix.PrefixCache` (hashing,
lookup, publication) and :class:`~hisparse.kv.reclaim.Reclaimer` (host-read switches, unpinning);
the coordinator owns the state (:class:`~hisparse.kv.state.RequestKV`, tables, pools) and builds
the plans.

Page states (DESIGN.md §4): *dirty* (its rows are not all durable on host), *clean* (durable
host copy and a GPU block), *host-only* (``resident[p] == -1``; reads go through the hot buffer).

Durability: every row written in a step is mirrored GPU->host after the forward; the worker
acknowledges the step's mirror by ``copy_id == step_id``. ``num_durable`` is the end of the
contiguous acknowledged prefix of a request's tokens.

Modes: ``hisparse`` (GPU first, requests switch to host-read mode under pressure),
``always-host`` (every request reads history through its hot buffer once its prompt is done),
``gpu-only`` (no host tier, full-length GPU reservation at admission, no prefix caching).

*GPU-held* requests (``hisparse`` only): once the host pool cannot hold another request, a
request whose full length fits the GPU arena with the watermark still free is admitted as
``gpu-only`` admits it -- every page reserved on GPU, no host blocks of its own -- instead of
waiting. Its rows are never mirrored, its pages never turn clean, it never switches to host-read
mode and never publishes prefix pages (I1 holds: every row stays resident). Its prompt's cached
pages are used as a host-backed request uses them, except that a host-only one is always
restored: it shares their host blocks (already allocated) until it is freed. So the host pool
bounds only the requests that may leave the GPU: a small host pool no longer caps ``hisparse``
below what its GPU arena holds (less the watermark).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

from hisparse.config import KVCacheConfig, Mode, cdiv
from hisparse.kv.block_pool import BlockPool
from hisparse.kv.plan import (
    TABLES,
    ChangedRows,
    RowCopy,
    ScheduledSeq,
    StepPlan,
    flat_rows,
    page_rows,
    token_layout,
)
from hisparse.kv.prefix import PrefixCache
from hisparse.kv.reclaim import Reclaimer
from hisparse.kv.state import KVStats, PendingWrite, RequestKV
from hisparse.kv.transfer_plan import LoadJob, RemotePrefill

__all__ = ["KVCoordinator", "KVStats", "PendingWrite", "RequestKV"]


class KVCoordinator:
    def __init__(self, cfg: KVCacheConfig) -> None:
        self.cfg = cfg
        self.block_size = cfg.block_size
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
        # Per table, the slots whose row was written since the last plan (StepPlan.changed_rows).
        self._changed: dict[str, set[int]] = {name: set() for name in TABLES}
        self.requests: dict[str, RequestKV] = {}
        self.by_uid: dict[int, RequestKV] = {}       # live and draining requests
        self.draining: dict[int, RequestKV] = {}     # freed, waiting for in-flight mirrors
        # Per planned step with mirrors: its requests and their writes (parallel lists).
        self.pending_by_step: dict[int, tuple[list[RequestKV], list[PendingWrite]]] = {}
        self.stats = KVStats()
        self.prefix = PrefixCache(cfg.block_size, self.host_pool, self.gpu_pool,
                                  cfg.enable_prefix_caching)
        self.reclaim = Reclaimer(cfg, self.gpu_pool, self.hot_table, self.stats)
        self._uids = itertools.count()
        self._scheduled: list[tuple[RequestKV, int, int]] = []   # (request, start, num_tokens)
        self._restore_pages: list[tuple[int, int]] = []          # (host block, gpu block)
        self._indexer_restore_pages: list[tuple[int, int]] = []  # (host block, indexer block)
        # Remote prefills whose rows landed in the host pool: the next plan restores their GPU
        # pages and keys (the rows are durable, and the pages published, from that plan on).
        self._landed: list[RequestKV] = []
        # Blocks taken by :meth:`quarantine` now (a gauge): failed loads' READs may write them.
        self.quarantined_blocks = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_gpu_blocks(self) -> int:
        return self.gpu_pool.num_free

    def page_state_counts(self) -> dict[str, int]:
        """Computed pages of live requests by state (DESIGN.md §4): ``dirty`` (GPU copy only),
        ``clean`` (GPU block and a durable host copy), ``host_only`` (no GPU block of ours)."""
        reqs = list(self.requests.values())
        if not reqs:
            return {"dirty": 0, "clean": 0, "host_only": 0}
        bs = self.block_size
        slots = np.fromiter((r.slot for r in reqs), np.int64, len(reqs))
        computed = np.fromiter((r.num_computed for r in reqs), np.int64, len(reqs))
        durable = np.fromiter((r.num_durable for r in reqs), np.int64, len(reqs)) // bs
        pinned = np.fromiter((r.pinned_start for r in reqs), np.int64, len(reqs))
        page = np.arange(self.resident_table.shape[1])[None, :]
        valid = page < -(-computed // bs)[:, None]
        on_gpu = (self.resident_table[slots] >= 0) & (page >= pinned[:, None]) & valid
        clean = on_gpu & (page < durable[:, None])
        n_gpu, n_clean = int(on_gpu.sum()), int(clean.sum())
        return {"dirty": n_gpu - n_clean, "clean": n_clean,
                "host_only": int(valid.sum()) - n_gpu}

    def get(self, req_id: str) -> RequestKV:
        try:
            return self.requests[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r}") from None

    def num_computed(self, req_id: str) -> int:
        """Tokens of an admitted request whose KV is computed (or planned in this step)."""
        return self.get(req_id).num_computed

    # ------------------------------------------------------------------ admission
    def admit(self, req_id: str, token_ids: list[int], max_len: int,
              need_host: bool = False) -> RequestKV | None:
        """Admit a request whose prompt is ``token_ids`` and whose length may reach ``max_len``.

        ``token_ids`` stays the caller's list: it appends sampled tokens; the KV core only reads
        it. Returns the request's KV handle (``num_computed`` = prompt tokens already computed,
        a prefix hit), or None when the pools cannot hold it now (GPU blocks are reclaimed from
        other requests before giving up). In ``hisparse`` mode a request the host pool cannot
        hold is admitted *GPU-held* (module docstring) when its full length fits the arena,
        unless ``need_host`` (its KV must reach the host pool: a prefill held for a remote
        decode).
        """
        cfg, block_size = self.cfg, self.block_size
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} is already admitted")
        if not 0 < len(token_ids) <= max_len <= cfg.max_model_len:
            raise ValueError(f"request {req_id!r}: need 0 < prompt length ({len(token_ids)}) "
                             f"<= max_len ({max_len}) <= max_model_len ({cfg.max_model_len})")
        if not self.free_slots:
            return None
        num_pages = cdiv(max_len, block_size)
        hits = self.prefix.lookup(token_ids)
        if self.indexer_pool.num_free < num_pages:
            return None
        if self.host_pool is not None:
            hit_host_free = sum(self.host_pool.is_free(h) for h, _ in hits)
            if self.host_pool.num_free - hit_host_free < num_pages - len(hits):
                if cfg.mode is Mode.HISPARSE and not need_host:
                    return self._admit_gpu_held(req_id, token_ids, num_pages)
                return None
        first_chunk = min(len(token_ids) - len(hits) * block_size, cfg.max_num_batched_tokens)

        def gpu_need(restore: bool) -> int:
            if cfg.mode is Mode.GPU_ONLY:
                return num_pages
            # Cached hit blocks leave the free queue when claimed; restores take new blocks.
            claimed = sum(g is not None and self.gpu_pool.is_free(g) for _, g in hits)
            host_only = sum(g is None for _, g in hits) if restore else 0
            return claimed + host_only + cdiv(first_chunk, block_size)

        if self.gpu_pool.num_free < gpu_need(False):
            self.reclaim.ensure_free_gpu(gpu_need(False))
            # Reclaiming may have handed cached hit blocks to others (as hot blocks) or unpinned
            # new ones: look the GPU copies up again. The host hits are unchanged.
            hits = self.prefix.lookup(token_ids)
            if self.gpu_pool.num_free < gpu_need(False):
                return None
        # Host-only hits: restore them (one batched host->GPU page copy, then HBM-speed reads
        # by every later chunk and decode step) only while that leaves the watermark free;
        # otherwise use them in place: prefill chunks read them through the staging area and
        # decode through the hot buffer (DESIGN.md §4; issue 14: no restore needed).
        restore = self.gpu_pool.num_free - gpu_need(True) >= cfg.watermark

        req = self._new_request(req_id, token_ids, len(token_ids), num_pages)
        if self.host_pool is not None:
            self._claim_hits(req, hits)
            req.host[len(hits):num_pages] = self.host_pool.allocate(num_pages - len(hits))
            self._restore_hits(req, hits, restore)
        if cfg.mode is Mode.GPU_ONLY:
            req.resident[:num_pages] = self.gpu_pool.allocate(num_pages)
        self._count_hits(req, hits)
        self.reclaim.started_prefill(req)
        return req

    def _admit_gpu_held(self, req_id: str, token_ids: list[int],
                        num_pages: int) -> RequestKV | None:
        """Admit a request the host pool cannot hold with all ``num_pages`` pages on GPU, if
        they fit with the watermark still free (reclaiming first, but only when reclaim can
        reach that: a hopeless admission must not switch anyone to host-read mode). Prefix hits
        are used: GPU copies shared, host-only pages restored into its own blocks."""
        def need(hits: list[tuple[int, int | None]]) -> int:
            # a cached GPU copy leaves the free queue when claimed; every other page is new
            shared = [g for _, g in hits if g is not None]
            claimed = sum(self.gpu_pool.is_free(g) for g in shared)
            return claimed + num_pages - len(shared) + self.cfg.watermark

        hits = self.prefix.lookup(token_ids)
        free, blocks = self.gpu_pool.num_free, need(hits)
        if free < blocks:
            if (free + self.reclaim.reclaimable_blocks() < blocks
                    or not self.reclaim.ensure_free_gpu(blocks)):
                return None
            hits = self.prefix.lookup(token_ids)    # reclaim may have handed GPU copies out
            if self.gpu_pool.num_free < need(hits):
                return None
        req = self._new_request(req_id, token_ids, len(token_ids), num_pages, host_backed=False)
        self._claim_hits(req, hits)
        req.resident[len(hits):num_pages] = self.gpu_pool.allocate(num_pages - len(hits))
        self._restore_hits(req, hits, restore=True)
        self._count_hits(req, hits)
        self.stats.gpu_held_admissions += 1
        return req

    def _claim_hits(self, req: RequestKV, hits: list[tuple[int, int | None]]) -> None:
        """Take every hit's host block and GPU copy (if any) for ``req``'s leading pages. Done
        before allocating anything: an allocation could evict a cached hit still to be
        claimed."""
        for page, (host_block, gpu_block) in enumerate(hits):
            self.host_pool.touch(host_block)
            req.host[page] = host_block
            if gpu_block is not None:
                self.gpu_pool.touch(gpu_block)
                req.resident[page] = gpu_block

    def _restore_hits(self, req: RequestKV, hits: list[tuple[int, int | None]],
                      restore: bool) -> None:
        """Host-only hit pages: restored into new GPU blocks (``restore``) or left to be read in
        place; every hit page's indexer keys restored into ``req``'s indexer blocks."""
        for page, (host_block, gpu_block) in enumerate(hits):
            if gpu_block is None:
                self.stats.host_prefix_hit_tokens += self.block_size
                if restore:
                    req.resident[page] = self.gpu_pool.allocate(1)[0]
                    self._restore_pages.append((host_block, int(req.resident[page])))
                    self.stats.restored_pages += 1
                else:
                    self.stats.unrestored_hit_pages += 1
            self._indexer_restore_pages.append((host_block, int(req.indexer[page])))
        req.page_hashes = self.prefix.page_hashes(req.token_ids, len(hits))

    def _count_hits(self, req: RequestKV, hits: list[tuple[int, int | None]]) -> None:
        """The hit pages are computed, durable (on host) and published."""
        hit_tokens = len(hits) * self.block_size
        req.num_computed = req.num_durable = hit_tokens
        req.num_published = len(hits)
        self.stats.prefix_hit_tokens += hit_tokens

    def _new_request(self, req_id: str, token_ids: list[int], prompt_len: int, num_pages: int,
                     host_backed: bool = True) -> RequestKV:
        """A request in a free slot with ``num_pages`` indexer blocks (its other tables empty)."""
        slot = self.free_slots.pop()
        req = RequestKV(req_id=req_id, uid=next(self._uids), slot=slot, token_ids=token_ids,
                        prompt_len=prompt_len, num_pages=num_pages,
                        resident=self.resident_table[slot], host=self.host_table[slot],
                        indexer=self.indexer_table[slot], host_backed=host_backed)
        self.requests[req_id] = req
        self.by_uid[req.uid] = req
        self._mark_changed(slot, "resident", "host", "indexer")
        req.indexer[:num_pages] = self.indexer_pool.allocate(num_pages)
        return req

    # ------------------------------------------------------------------ disaggregation
    def admit_remote(self, req_id: str, token_ids: list[int], max_len: int,
                     remote: RemotePrefill) -> LoadJob | None:
        """Admit a decode request whose first ``remote.num_tokens`` rows (its prompt) a prefill
        instance computed: allocate where they land and return the worker's :class:`LoadJob`
        (None: the pools cannot hold it now). The request waits for its KV (``num_computed``
        stays 0, no reclaim policy sees it) until :meth:`finish_remote`, or :meth:`free` on a
        failed load. ``token_ids`` is the engine's list: the prompt, then the first token.

        Landing (DESIGN.md §7): the READs write the host pool (the authority; host blocks are
        taken for the full length); then every prompt page lives on GPU when they all fit
        above the watermark (``hisparse`` mode); otherwise the request reads its history from
        the host pool through its hot buffer from its first step, except a partial last page,
        which lives on GPU (its decode rows are written there). Indexer keys always live in the
        GPU indexer cache. The pages on GPU and the keys are restored from host by the first
        plan after :meth:`finish_remote`.
        Leading prompt pages found in this instance's prefix cache are not transferred: they
        are claimed as :meth:`admit` claims hits (restored to GPU when every page lands there,
        else read in place), their keys restored into the GPU indexer cache.
        """
        cfg, block_size = self.cfg, self.block_size
        n = remote.num_tokens
        if self.host_pool is None:
            raise ValueError("remote prefill needs a host tier (mode 'hisparse' or "
                             "'always-host')")
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} is already admitted")
        if not 0 < n < len(token_ids) <= max_len <= cfg.max_model_len:
            raise ValueError(f"request {req_id!r}: need 0 < remote tokens ({n}) < known tokens "
                             f"({len(token_ids)}) <= max_len ({max_len}) <= max_model_len "
                             f"({cfg.max_model_len})")
        if not self.free_slots:
            return None
        num_pages = cdiv(max_len, block_size)
        prompt_pages = cdiv(n, block_size)
        hits = self.prefix.lookup(token_ids[:n])     # leaves at least one page to pull
        h = len(hits)
        hit_host_free = sum(self.host_pool.is_free(b) for b, _ in hits)
        if (self.indexer_pool.num_free < num_pages
                or self.host_pool.num_free - hit_host_free < num_pages - h):
            return None
        claimed = sum(g is not None and self.gpu_pool.is_free(g) for _, g in hits)
        host_only_hits = [p for p, (_, g) in enumerate(hits) if g is None]
        all_gpu = (cfg.mode is Mode.HISPARSE and self.gpu_pool.num_free - claimed
                   - len(host_only_hits) - (prompt_pages - h) >= cfg.watermark)
        gpu_pages = list(range(h, prompt_pages)) if all_gpu else (
            [prompt_pages - 1] if n % block_size else [])
        restores = host_only_hits if all_gpu else []
        need = claimed + len(restores) + len(gpu_pages)
        if need and self.gpu_pool.num_free < need:
            if not self.reclaim.ensure_free_gpu(need):
                return None
            hits = self.prefix.lookup(token_ids[:n])[:h]   # reclaim may have reused GPU hits
            if len(hits) < h or self.gpu_pool.num_free < need:
                return None
        req = self._new_request(req_id, token_ids, n, num_pages)
        for page, (host_block, gpu_block) in enumerate(hits):   # claim before allocating
            self.host_pool.touch(host_block)
            req.host[page] = host_block
            if gpu_block is not None:
                self.gpu_pool.touch(gpu_block)
                req.resident[page] = gpu_block
        req.host[h:num_pages] = self.host_pool.allocate(num_pages - h)
        for page in restores:
            req.resident[page] = self.gpu_pool.allocate(1)[0]
            self._restore_pages.append((int(req.host[page]), int(req.resident[page])))
            self.stats.restored_pages += 1
        for page in range(h):
            self._indexer_restore_pages.append((int(req.host[page]), int(req.indexer[page])))
        if gpu_pages:
            req.resident[gpu_pages] = self.gpu_pool.allocate(len(gpu_pages))
        req.page_hashes = self.prefix.page_hashes(token_ids, h)
        req.num_durable = h * block_size
        req.num_published = h
        req.landed_start = h * block_size
        req.remote = True
        self.stats.prefix_hit_tokens += h * block_size
        self.stats.host_prefix_hit_tokens += len(host_only_hits) * block_size
        self.stats.remote_gpu_pages += len(gpu_pages)
        self.stats.remote_host_pages += prompt_pages - h - len(gpu_pages)
        return LoadJob(req_id, remote, req.resident[h:prompt_pages].copy(),
                       req.host[h:prompt_pages].copy(), req.indexer[h:prompt_pages].copy(),
                       first_page=h)

    def finish_remote(self, req_id: str) -> RequestKV:
        """The load of an :meth:`admit_remote` request completed: its prompt rows count as
        computed. The next plan restores its GPU pages and keys from the landed host rows;
        the rows turn durable (and their hashes are published) when that plan is built: from
        then on no reader sees a GPU page before its restore (the runner restores before the
        forward), and a request freed before it restores and publishes nothing."""
        req = self.get(req_id)
        if req.num_computed:
            raise ValueError(f"request {req_id!r} is not waiting for remote KV")
        req.num_computed = req.prompt_len
        self._landed.append(req)
        return req

    @property
    def has_landed(self) -> bool:
        """Landed remote prompts wait for a plan to restore them (the scheduler then plans a
        copy-only step if nothing else runs: their pages turn durable only by it)."""
        return bool(self._landed)

    def _landing_restores(self) -> tuple[np.ndarray, ...]:
        """(host rows, GPU rows, host rows, indexer rows) that restore the landed prompts of
        live requests; those rows turn durable and their full pages are published."""
        parts = [], [], [], []
        bs = self.block_size
        landed, self._landed = self._landed, []
        for req in landed:     # the rows pulled (prefix hits are durable already)
            if req.freed:
                continue
            pos = np.arange(req.landed_start, req.prompt_len, dtype=np.int64)
            page, off = pos // bs, pos % bs
            gpu = req.resident[page].astype(np.int64)
            host_rows = req.host[page].astype(np.int64) * bs + off
            on_gpu = gpu >= 0
            parts[0].append(host_rows[on_gpu])
            parts[1].append(gpu[on_gpu] * bs + off[on_gpu])
            parts[2].append(host_rows)
            parts[3].append(req.indexer[page].astype(np.int64) * bs + off)
            req.num_durable = req.prompt_len
            self.prefix.publish(req)
            if req.host_read:
                self.reclaim.unpin_clean_pages(req)
        return tuple(np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts)

    def quarantine(self, job: LoadJob) -> None:
        """Keep the blocks a failed load's READs may still write (:meth:`LoadJob.read_targets
        <hisparse.kv.transfer_plan.LoadJob.read_targets>`: host blocks) out of the pool: one
        more reference each, so the request's :meth:`free` leaves them taken, until
        :meth:`release_quarantine` of the same job (its READs ended). Call before the free."""
        blocks = job.read_targets()
        for block in blocks.tolist():
            self.host_pool.touch(block)
        self.quarantined_blocks += len(blocks)

    def release_quarantine(self, job: LoadJob) -> None:
        """The READs of a job given to :meth:`quarantine` ended: its blocks go back to the pool
        (their content is garbage: nothing was published from them)."""
        blocks = job.read_targets()
        for block in blocks.tolist():
            self.host_pool.release(block)
        self.quarantined_blocks -= len(blocks)

    def hold(self, req_id: str) -> list[int]:
        """Keep the host blocks of a request's prompt pages past its :meth:`free` (a prefill
        instance holds them until the decode side read them); returns them for
        :meth:`release_held`. Their rows are readable once ``num_durable >= prompt_len``."""
        req = self.get(req_id)
        if self.host_pool is None:
            raise ValueError("holding KV for a remote decode needs a host tier")
        if not req.host_backed:
            raise ValueError(f"request {req_id!r} is GPU-held (its rows never reach the host "
                             "pool): admit it with "
                             "need_host=True to hold its KV for a remote decode")
        blocks = [int(b) for b in req.host[:cdiv(req.prompt_len, self.block_size)]]
        for block in blocks:
            self.host_pool.touch(block)
        return blocks

    def release_held(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.host_pool.release(int(block))

    # ------------------------------------------------------------------ per-step allocation
    def allocate_slots(self, req: RequestKV, num_tokens: int) -> bool:
        """Put tokens ``[num_computed, num_computed + num_tokens)`` of ``req`` in this step.

        Allocates the GPU pages they write (reclaiming first if short) and advances
        ``req.num_computed``. False: no room; the caller should preempt someone and retry, or
        leave the request for a later step.
        """
        block_size = self.block_size
        start = req.num_computed
        end = start + num_tokens
        if (num_tokens <= 0 or req.freed or end > req.num_tokens
                or end > req.num_pages * block_size):
            raise ValueError(f"request {req.req_id!r}: cannot schedule tokens [{start}, {end}) "
                             f"with {req.num_tokens} known tokens (freed={req.freed})")
        first_page, last_page = start // block_size, (end - 1) // block_size
        resident = req.resident
        prompt_ends = end > req.prompt_len >= start     # its first decode token is in here
        if prompt_ends:
            self.reclaim.prefilling.pop(req.uid, None)   # its pages stay until it switches
        if (prompt_ends and not req.host_read and self.cfg.uses_host
                and self.reclaim.has_host_only_history(req, start, block_size)):
            # Its history has host-only pages (released during prefill or unrestored prefix
            # hits): decode must read through a hot buffer, so it switches now.
            n_hot = self.cfg.hot_blocks_per_request
            if not self.reclaim.switch(req):
                self.reclaim.ensure_free_gpu(n_hot)
                if not self.reclaim.switch(req):
                    return False
        if first_page == last_page:  # the decode fast path
            new_pages = [first_page] if resident[first_page] < 0 else []
        else:
            new_pages = [p for p in range(first_page, last_page + 1) if resident[p] < 0]
        if new_pages:
            if not self.reclaim.ensure_free_gpu(len(new_pages)):
                return False
            resident[new_pages] = self.gpu_pool.allocate(len(new_pages))
            self._changed["resident"].add(req.slot)
        if prompt_ends:
            self.reclaim.started_decoding(req)
        req.num_computed = end
        if req.host_read and new_pages:
            self.reclaim.unpin_clean_pages(req)  # the tail moved on
        self._scheduled.append((req, start, num_tokens))
        return True

    def build_plan(self, step_id: int) -> StepPlan:
        """Emit the plan of the tokens allocated since the last call.

        Reclaim runs first, so every sequence's ``host_read`` is final when it is created.
        """
        self.reclaim.switch_to_host_read()
        scheduled, self._scheduled = self._scheduled, []
        uses_host = self.cfg.uses_host
        seqs, write_reqs, writes, mirror_seqs = [], [], [], []
        for req, start, n in scheduled:
            if req.freed:
                continue
            end = start + n
            sample = end >= req.num_tokens
            prefill = start < req.prompt_len
            staged = (prefill and uses_host and not req.host_read
                      and self.reclaim.has_host_only_history(req, start, self.block_size))
            self.stats.staged_chunks += staged
            seq = ScheduledSeq(req.req_id, req.slot, start, n, req.host_read, sample, prefill,
                               staged)
            seqs.append(seq)
            if sample:  # the engine appends it when the step's result comes back
                req.num_pending_tokens += 1
            if uses_host and req.host_backed:
                write = PendingWrite(end)
                req.pending.append(write)
                write_reqs.append(req)
                writes.append(write)
                mirror_seqs.append(seq)
        mirrors = indexer_mirrors = RowCopy()
        if writes:
            self.pending_by_step[step_id] = (write_reqs, writes)
            mirrors, indexer_mirrors = self._plan_mirrors(step_id, mirror_seqs)
        restores = self._pages_to_rows(self._restore_pages)
        indexer_restores = self._pages_to_rows(self._indexer_restore_pages)
        self._restore_pages, self._indexer_restore_pages = [], []
        if self._landed:
            h, g, hi, i = self._landing_restores()
            restores = RowCopy(np.concatenate((restores.src_rows, h)),
                               np.concatenate((restores.dst_rows, g)))
            indexer_restores = RowCopy(np.concatenate((indexer_restores.src_rows, hi)),
                                       np.concatenate((indexer_restores.dst_rows, i)))
        # A switch to host-read mode writes the request's hot-table row and resets its state.
        self._changed["hot"].update(self.reclaim.hot_resets)
        hot_resets = np.asarray(self.reclaim.hot_resets, dtype=np.int32)
        self.reclaim.hot_resets = []
        return StepPlan(step_id=step_id, seqs=seqs,
                        resident_block_table=self.resident_table,
                        host_block_table=self.host_table,
                        indexer_block_table=self.indexer_table,
                        hot_block_table=self.hot_table, changed_rows=self._take_changed(),
                        hot_resets=hot_resets,
                        restores=restores, indexer_restores=indexer_restores,
                        mirrors=mirrors, indexer_mirrors=indexer_mirrors)

    def _mark_changed(self, slot: int, *tables: str) -> None:
        for name in tables:
            self._changed[name].add(slot)

    def _take_changed(self) -> ChangedRows:
        changed = {name: np.fromiter(slots, dtype=np.int64, count=len(slots))
                   for name, slots in self._changed.items()}
        for slots in self._changed.values():
            slots.clear()
        return ChangedRows(**changed)

    def _plan_mirrors(self, step_id: int, seqs: list[ScheduledSeq]) -> tuple[RowCopy, RowCopy]:
        block_size = self.block_size
        positions, slots, _ = token_layout(seqs)
        host_rows = flat_rows(self.host_table, slots, positions, block_size)
        gpu_rows = flat_rows(self.resident_table, slots, positions, block_size)
        idx_rows = flat_rows(self.indexer_table, slots, positions, block_size)
        self.stats.mirrored_rows += len(positions)
        return (RowCopy(gpu_rows, host_rows, copy_id=step_id),
                RowCopy(idx_rows, host_rows.copy(), copy_id=step_id))

    def _pages_to_rows(self, pages: list[tuple[int, int]]) -> RowCopy:
        if not pages:
            return RowCopy()
        src, dst = np.asarray(pages, dtype=np.int64).T
        return RowCopy(page_rows(src, self.block_size), page_rows(dst, self.block_size))

    def rollback(self, req: RequestKV, num_computed: int) -> None:
        """Speculative decoding: the rows of positions ``>= num_computed`` were computed for
        rejected draft tokens; forget them. Their pages stay allocated (the next step rewrites
        the same positions); in-flight mirrors of theirs no longer count towards durability, so
        no page holding a rejected row turns clean or gets its hash published (I3)."""
        if not 0 <= num_computed <= req.num_computed:
            raise ValueError(f"request {req.req_id!r}: cannot roll back to {num_computed} "
                             f"(computed {req.num_computed})")
        req.num_computed = num_computed
        req.num_durable = min(req.num_durable, num_computed)
        for write in req.pending:
            write.end = min(write.end, num_computed)

    # ------------------------------------------------------------------ acknowledgements
    def apply_acks(self, copy_ids: Iterable[int]) -> None:
        """The worker reports the mirrors of these steps durable on host (any order)."""
        pending_by_step = self.pending_by_step
        batches = [pending_by_step.pop(step_id, ((), ())) for step_id in copy_ids]
        if len(batches) == 1:  # the usual case: one step's writes (processing twice is harmless)
            touched, writes = batches[0]
            for write in writes:
                write.acked = True
        else:
            by_uid = {}
            for reqs, writes in batches:
                for write in writes:
                    write.acked = True
                for req in reqs:
                    by_uid[req.uid] = req
            touched = by_uid.values()
        block_size = self.block_size
        for req in touched:
            pending = req.pending
            old_pages = req.num_durable // block_size
            while pending and pending[0].acked:
                req.num_durable = pending.popleft().end
            if req.num_durable // block_size > old_pages:  # a page turned clean
                self.prefix.publish(req)
                if req.host_read:
                    self.reclaim.unpin_clean_pages(req)
            if not pending and req.freed and self.draining.pop(req.uid, None) is not None:
                self._free_blocks(req)

    # ------------------------------------------------------------------ leaving
    def free(self, req_id: str) -> None:
        """Give back a request's KV (it finished, was aborted or is preempted: the KV core does
        the same for each). Its blocks return to the pools once its in-flight mirrors are
        durable; published pages stay in the prefix cache, so re-admitting the same tokens
        resumes from the durable prefix."""
        req = self.requests.pop(req_id)
        req.freed = True
        self.reclaim.forget(req)
        if self._restore_pages or self._indexer_restore_pages:
            self._drop_restores(req)
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
        self._mark_changed(req.slot, *TABLES)
        self.free_slots.append(req.slot)
        if req.pending:
            self.draining[req.uid] = req
        else:
            self._free_blocks(req)

    def _drop_restores(self, req: RequestKV) -> None:
        """Forget the unplanned restores into a request's blocks: it leaves before any plan
        ran them (a remote prefill whose load failed), and its blocks may be reused."""
        gpu = set(req.resident[:req.num_pages].tolist())
        idx = set(req.indexer[:req.num_pages].tolist())
        self._restore_pages = [(h, g) for h, g in self._restore_pages if g not in gpu]
        self._indexer_restore_pages = [(h, i) for h, i in self._indexer_restore_pages
                                       if i not in idx]

    def _free_blocks(self, req: RequestKV) -> None:
        self.by_uid.pop(req.uid, None)
        for p in range(req.num_pages):
            block = int(req.resident[p])
            if block >= 0 and p >= req.pinned_start:
                self.gpu_pool.release(block)
            # a GPU-held request holds host blocks only for its prefix hits
            if self.host_pool is not None and (req.host_backed or req.host[p] >= 0):
                self.host_pool.release(int(req.host[p]))
            self.indexer_pool.release(int(req.indexer[p]))

    def _on_gpu_block_reuse(self, block: int, token: tuple[int, int]) -> None:
        uid, page = token
        req = self.by_uid.get(uid)
        if req is not None and req.resident[page] == block:
            req.resident[page] = -1
            self.stats.lost_pages += 1
            if not req.freed:   # a freed request's tables are its own copies
                self._changed["resident"].add(req.slot)
