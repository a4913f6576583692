import pytest

from hisparse.kv.block_pool import BlockPool


def test_allocate_release_and_exhaustion():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert sorted(blocks) == [0, 1, 2, 3] and pool.num_free == 0
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    pool.release(blocks[2])
    assert pool.allocate(1) == [blocks[2]]
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(blocks[0]), pool.release(blocks[0])


def test_cached_blocks_are_evicted_last_and_in_lru_order():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.set_hash(a, "ha")
    pool.set_hash(b, "hb")
    pool.release(a)          # cached, older
    pool.release(b)          # cached, newer
    pool.release(c)          # plain free: handed out before cached blocks
    assert pool.lookup("ha") == a
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [a]          # LRU cached block goes first
    assert pool.lookup("ha") is None and pool.lookup("hb") == b
    pool.touch(b)                           # a cached hit leaves the free queue
    assert not pool.is_free(b) and pool.ref_counts[b] == 1
    pool.check_consistency()


def test_unpinned_block_stays_readable_until_reuse_then_lender_is_told():
    told = []
    pool = BlockPool(3, on_reuse=lambda block, token: told.append((block, token)))
    a, b, c = pool.allocate(3)
    pool.unpin(a, ("req", 0))
    assert pool.is_free(a) and told == []
    pool.touch(a)            # someone adopts it: still readable, not reused
    pool.release(a)
    assert told == []
    pool.release(b)          # plain free block goes first
    assert pool.allocate(1) == [b] and told == []
    assert pool.allocate(1) == [a]
    assert told == [(a, ("req", 0))]
    pool.check_consistency()
