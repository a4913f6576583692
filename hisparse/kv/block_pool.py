"""A pool of fixed-size blocks with ref counts, an LRU free queue and prefix-hash identity.

One class serves the GPU arena, the pinned host pool and the indexer cache.

Free queue order (head is handed out first):
  never-hashed free blocks | released blocks in release order (cached prefixes, unpinned pages).
A released block keeps its content until the pool hands it out again: a hashed block stays
findable through ``lookup``; an *unpinned* block stays readable by the request that lent it,
and that request is told through ``on_reuse`` when the block is handed to someone else.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

ReuseCallback = Callable[[int, Any], None]


class BlockPool:
    def __init__(self, num_blocks: int, name: str = "blocks",
                 on_reuse: ReuseCallback | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"{name}: num_blocks must be positive, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[Hashable | None] = [None] * num_blocks
        self.hash_to_block: dict[Hashable, int] = {}
        # block -> tokens of the requests still reading it after unpinning it.
        self.lenders: dict[int, list[Any]] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_reuse = on_reuse

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref 1 each), evicting cached content; raises if short."""
        if n > len(self.free_queue):
            raise RuntimeError(f"{self.name}: asked for {n} blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _forget(self, block: int) -> None:
        """The block's old content is about to be overwritten: drop hash and tell lenders."""
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
        lenders = self.lenders.pop(block, None)
        if lenders and self.on_reuse is not None:
            for token in lenders:
                self.on_reuse(block, token)

    def touch(self, block: int) -> None:
        """Take one more reference to a block (possibly a free cached one)."""
        if self.ref_counts[block] == 0:
            self.free_queue.pop(block)
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference. At zero the block is free; content is kept only if hashed."""
        self._decref(block)
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None
            if self.block_hash[block] is None and block not in self.lenders:
                self.free_queue.move_to_end(block, last=False)

    def unpin(self, block: int, token: Any) -> None:
        """Drop the caller's reference but keep the block readable by it until reuse.

        When the pool later hands the block out, ``on_reuse(block, token)`` runs first.
        """
        self.lenders.setdefault(block, []).append(token)
        self._decref(block)
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None

    def _decref(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"{self.name}: block {block} released more often than taken")
        self.ref_counts[block] -= 1

    def set_hash(self, block: int, block_hash: Hashable) -> None:
        """Publish ``block`` as the holder of the page with ``block_hash``."""
        old = self.block_hash[block]
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.block_hash[block] = block_hash
        self.hash_to_block.setdefault(block_hash, block)

    def lookup(self, block_hash: Hashable) -> int | None:
        return self.hash_to_block.get(block_hash)

    def is_free(self, block: int) -> bool:
        return block in self.free_queue

    def check_consistency(self) -> None:
        """Raise if ref counts, the free queue and the hash map disagree (for tests)."""
        for block in range(self.num_blocks):
            free = block in self.free_queue
            if free != (self.ref_counts[block] == 0):
                raise AssertionError(f"{self.name}: block {block} free={free} "
                                     f"ref={self.ref_counts[block]}")
        for h, block in self.hash_to_block.items():
            if self.block_hash[block] != h:
                raise AssertionError(f"{self.name}: hash map points {h} at block {block}")
