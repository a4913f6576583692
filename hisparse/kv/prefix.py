"""Prefix caching: page hashes, lookup of a prompt's cached pages, publication of durable pages.

A page's hash chains the hashes of every page before it. The host pool is the authority: a page
is published there (and on its GPU block, while it has one) only once its host copy is durable,
and only along the contiguous durable prefix (DESIGN.md §4, I3).
"""

from __future__ import annotations

from hisparse.kv.block_pool import BlockPool
from hisparse.kv.state import RequestKV


class PrefixCache:
    def __init__(self, block_size: int, host_pool: BlockPool | None, gpu_pool: BlockPool,
                 enabled: bool) -> None:
        self.block_size = block_size
        self.host_pool = host_pool
        self.gpu_pool = gpu_pool
        self.enabled = enabled and host_pool is not None

    def page_hashes(self, token_ids: list[int], num_pages: int, start: int = 0,
                    parent: int = 0) -> list[int]:
        """Hashes of pages ``[start, num_pages)``; ``parent`` is the hash of page ``start - 1``."""
        block_size = self.block_size
        hashes = []
        for p in range(start, num_pages):
            parent = hash((parent, tuple(token_ids[p * block_size:(p + 1) * block_size])))
            hashes.append(parent)
        return hashes

    def lookup(self, token_ids: list[int]) -> list[tuple[int, int | None]]:
        """(host block, GPU block or None) for each leading page found in the prefix cache.

        At least one prompt token is always left to compute (its logits start decoding).
        """
        if not self.enabled:
            return []
        hits = []
        for h in self.page_hashes(token_ids, (len(token_ids) - 1) // self.block_size):
            host_block = self.host_pool.lookup(h)
            if host_block is None:
                break
            hits.append((host_block, self.gpu_pool.lookup(h)))
        return hits

    def publish(self, req: RequestKV) -> None:
        """Publish the hashes of a request's full durable pages, contiguously from page 0."""
        if not self.enabled:
            return
        # Only pages whose tokens are all appended: a durable row whose token the engine later
        # discarded (an overlapped step past a request's end) must never be hashed.
        num_full = min(req.num_durable, len(req.token_ids)) // self.block_size
        if num_full <= req.num_published:
            return
        hashes = req.page_hashes
        hashes += self.page_hashes(req.token_ids, num_full, start=len(hashes),
                                   parent=hashes[-1] if hashes else 0)
        for p in range(req.num_published, num_full):
            self.host_pool.set_hash(int(req.host[p]), hashes[p])
            if req.resident[p] >= 0:
                self.gpu_pool.set_hash(int(req.resident[p]), hashes[p])
        req.num_published = num_full
