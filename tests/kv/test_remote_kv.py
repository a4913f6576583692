"""The KV core's side of disaggregation: where a remote prompt lands, the mirrors that make it
durable (I1-I3), holding a prefill's blocks, and no leaks (I2)."""

import numpy as np
import pytest

from hisparse.config import KVCacheConfig
from hisparse.kv.coordinator import KVCoordinator
from hisparse.kv.transfer_plan import RemotePrefill

BS = 8


def core(num_gpu_blocks=40, **kw):
    return KVCoordinator(KVCacheConfig(block_size=BS, num_gpu_blocks=num_gpu_blocks,
                                       num_host_blocks=60, num_indexer_blocks=60,
                                       max_model_len=128, index_topk=16, max_num_seqs=4,
                                       max_num_batched_tokens=32, hot_buffer_size=32, **kw))


def remote(n):
    return RemotePrefill(engine_id="p", request_id="r", host="h", port=1,
                         host_blocks=tuple(range(-(-n // BS))), num_tokens=n, first_token=5,
                         compat_hash="x", layout={})


def assert_full(kv):
    assert (kv.gpu_pool.num_free, kv.host_pool.num_free, kv.indexer_pool.num_free) == (
        kv.cfg.num_gpu_blocks, kv.cfg.num_host_blocks, kv.cfg.num_indexer_blocks)
    for pool in (kv.gpu_pool, kv.host_pool, kv.indexer_pool):
        pool.check_consistency()


@pytest.mark.parametrize("num_gpu_blocks,n,gpu_landing", [(40, 30, True), (11, 60, False),
                                                           (40, 32, True), (11, 64, False)])
def test_landing_then_mirrors_make_the_prompt_durable(num_gpu_blocks, n, gpu_landing):
    kv = core(num_gpu_blocks)
    ids = list(range(100, 100 + n)) + [5]
    job = kv.admit_remote("a", ids, n + 10, remote(n))
    pages = -(-n // BS)
    assert len(job.gpu_blocks) == len(job.host_blocks) == len(job.indexer_blocks) == pages
    if gpu_landing:
        assert (job.gpu_blocks >= 0).all()
    else:   # rows land in host blocks; only a partial last page (decode writes it) on GPU
        assert list(job.gpu_pages) == ([pages - 1] if n % BS else [])
    req = kv.get("a")
    assert req.num_computed == 0 and kv.build_plan(0).mirrors.src_rows.size == 0
    kv.finish_remote("a")
    assert kv.allocate_slots(req, 1)
    plan = kv.build_plan(1)
    assert req.host_read == (not gpu_landing)
    # the landed GPU rows and every landed key go to their host rows, plus the decode token
    pos = np.arange(n)
    host_rows = job.host_blocks[pos // BS].astype(np.int64) * BS + pos % BS
    on_gpu = job.gpu_blocks[pos // BS] >= 0
    m, im = plan.mirrors, plan.indexer_mirrors
    assert m.copy_id == im.copy_id == 1
    np.testing.assert_array_equal(m.dst_rows[:on_gpu.sum()], host_rows[on_gpu])
    np.testing.assert_array_equal(
        m.src_rows[:on_gpu.sum()],
        (job.gpu_blocks[pos // BS].astype(np.int64) * BS + pos % BS)[on_gpu])
    np.testing.assert_array_equal(im.dst_rows[:n], host_rows)
    np.testing.assert_array_equal(
        im.src_rows[:n], job.indexer_blocks[pos // BS].astype(np.int64) * BS + pos % BS)
    assert len(m) == on_gpu.sum() + 1 and len(im) == n + 1
    assert req.num_durable == 0 and not kv.host_pool.hash_to_block    # I3: not before ack
    kv.apply_acks([1])
    assert req.num_durable == n + 1
    assert len(kv.host_pool.hash_to_block) == (n + 1) // BS          # full pages published
    kv.free("a")
    assert_full(kv)


def test_a_failed_load_frees_everything_and_publishes_nothing():
    kv = core()
    kv.admit_remote("a", list(range(20)) + [5], 30, remote(20))
    kv.free("a")
    assert_full(kv)
    assert not kv.host_pool.hash_to_block


def test_admission_waits_for_room():
    kv = core(11)
    assert kv.admit_remote("a", list(range(60)) + [5], 120, remote(60)) is not None
    for i in range(3):
        kv.admit_remote(f"b{i}", list(range(60)) + [5], 120, remote(60))
    assert kv.admit_remote("c", list(range(60)) + [5], 120, remote(60)) is None   # no slot
    with pytest.raises(ValueError, match="remote tokens"):
        core().admit_remote("d", list(range(20)), 30, remote(20))   # no first token


def test_hold_keeps_the_prefills_host_blocks_past_free():
    kv = core()
    req = kv.admit("a", list(range(21)), 22)
    assert kv.allocate_slots(req, 21)
    kv.build_plan(1)
    kv.apply_acks([1])
    held = kv.hold("a")
    assert held == [int(b) for b in req.host[:3]]
    kv.free("a")
    assert kv.host_pool.num_free == kv.cfg.num_host_blocks - 3
    assert all(kv.host_pool.ref_counts[b] == 1 for b in held)
    kv.release_held(held)
    assert_full(kv)


@pytest.mark.parametrize("num_gpu_blocks", [40, 11])
def test_prefix_hits_are_not_pulled(num_gpu_blocks):
    kv = core(num_gpu_blocks)
    prompt = list(range(200, 236))                     # 4 full pages + 4 tokens
    req = kv.admit("a", prompt[:33], 34)               # publishes pages 0..3
    assert kv.allocate_slots(req, 33)
    kv.build_plan(1)
    kv.apply_acks([1])
    kv.free("a")
    if num_gpu_blocks == 11:     # push the cached pages off the GPU: hits are host-only
        kv.gpu_pool.allocate(kv.gpu_pool.num_free)
        for b in range(num_gpu_blocks):
            kv.gpu_pool.release(b)
    job = kv.admit_remote("b", prompt + [5], 40, remote(36))
    assert job.first_page == 4 and len(job.gpu_blocks) == 1   # only the partial page
    r = kv.get("b")
    assert r.num_durable == 32 and r.landed_start == 32
    plan = kv.build_plan(2)           # the hit pages' keys are restored to the indexer cache
    assert len(plan.indexer_restores) == 32
    kv.finish_remote("b")
    assert kv.allocate_slots(r, 1)
    plan = kv.build_plan(3)
    assert len(plan.indexer_mirrors) == 4 + 1            # pulled keys + the decode token's
    kv.apply_acks([3])
    assert r.num_durable == 37
    kv.free("b")
    assert_full(kv)


def test_a_failed_load_drops_its_unplanned_restores():
    kv = core()
    req = kv.admit("a", list(range(17)), 18)
    assert kv.allocate_slots(req, 17)
    kv.build_plan(1)
    kv.apply_acks([1])
    kv.free("a")
    kv.admit_remote("b", list(range(20)) + [5], 30, remote(20))
    kv.free("b")                      # before any plan ran its restores
    plan = kv.build_plan(2)
    assert len(plan.restores) == len(plan.indexer_restores) == 0
    assert_full(kv)


@pytest.mark.parametrize("num_gpu_blocks,n", [(40, 30), (11, 60)])
def test_quarantined_blocks_stay_out_of_the_pools_until_released(num_gpu_blocks, n):
    """A failed load whose READs may still write: the blocks they target (landing GPU pages,
    host blocks of host-landed pages, every indexer block) outlive the request's free and are
    never handed out (admissions until the pools run dry get none of them) until released;
    the rest of the request's blocks (host blocks of GPU-landed pages) free at once."""
    kv = core(num_gpu_blocks)
    job = kv.admit_remote("a", list(range(100, 100 + n)) + [5], n + 10, remote(n))
    gpu, host, idx = job.read_targets()
    assert len(gpu) + len(host) == len(job.gpu_blocks) and len(idx) == len(job.indexer_blocks)
    kv.quarantine(job)
    kv.free("a")
    assert kv.quarantined_blocks == len(gpu) + len(host) + len(idx)
    assert (kv.gpu_pool.num_free, kv.host_pool.num_free, kv.indexer_pool.num_free) == (
        kv.cfg.num_gpu_blocks - len(gpu), kv.cfg.num_host_blocks - len(host),
        kv.cfg.num_indexer_blocks - len(idx))
    taken = {name: set() for name in ("gpu", "host", "indexer")}
    for i in range(100):     # take every free block of every pool, 1-token-page requests
        other = kv.admit(f"b{i}", [7 + i], BS)
        if other is None:
            break
        assert kv.allocate_slots(other, 1)
        kv.build_plan(i)
        taken["gpu"].update(int(b) for b in other.resident[:1] if b >= 0)
        taken["host"].update(int(b) for b in other.host[:1])
        taken["indexer"].update(int(b) for b in other.indexer[:1])
        kv.free(f"b{i}")    # freed, its mirror unacked: its blocks stay taken (draining)
    assert taken["gpu"] and taken["host"] and taken["indexer"]
    for name, blocks in (("gpu", gpu), ("host", host), ("indexer", idx)):
        assert not taken[name] & set(blocks.tolist()), name
    kv.apply_acks(range(100))
    kv.release_quarantine(job)
    assert kv.quarantined_blocks == 0
    assert_full(kv)
