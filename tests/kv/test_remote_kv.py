"""The KV core's side of disaggregation: where a remote prompt lands (the host pool), the
restores that bring its GPU pages and keys back and make it durable (I1-I3), holding a
prefill's blocks, and no leaks (I2)."""

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
def test_landing_then_restores_make_the_prompt_durable(num_gpu_blocks, n, gpu_landing):
    kv = core(num_gpu_blocks)
    ids = list(range(100, 100 + n)) + [5]
    job = kv.admit_remote("a", ids, n + 10, remote(n))
    pages = -(-n // BS)
    assert len(job.gpu_blocks) == len(job.host_blocks) == len(job.indexer_blocks) == pages
    np.testing.assert_array_equal(job.read_targets(), job.host_blocks)   # READs: host only
    if gpu_landing:
        assert (job.gpu_blocks >= 0).all()
    else:   # rows stay in host blocks; only a partial last page (decode writes it) on GPU
        assert list(job.gpu_pages) == ([pages - 1] if n % BS else [])
    req = kv.get("a")
    plan = kv.build_plan(0)
    assert req.num_computed == 0 and len(plan.restores) == len(plan.indexer_restores) == 0
    kv.finish_remote("a")
    assert req.num_durable == 0 and not kv.host_pool.hash_to_block    # not before the plan
    assert kv.allocate_slots(req, 1)
    plan = kv.build_plan(1)
    assert req.host_read == (not gpu_landing)
    # the landed host rows of GPU pages go to their GPU rows, every landed key to the indexer
    pos = np.arange(n)
    host_rows = job.host_blocks[pos // BS].astype(np.int64) * BS + pos % BS
    on_gpu = job.gpu_blocks[pos // BS] >= 0
    r, ir = plan.restores, plan.indexer_restores
    np.testing.assert_array_equal(r.src_rows, host_rows[on_gpu])
    np.testing.assert_array_equal(
        r.dst_rows, (job.gpu_blocks[pos // BS].astype(np.int64) * BS + pos % BS)[on_gpu])
    np.testing.assert_array_equal(ir.src_rows, host_rows)
    np.testing.assert_array_equal(
        ir.dst_rows, job.indexer_blocks[pos // BS].astype(np.int64) * BS + pos % BS)
    assert len(plan.mirrors) == len(plan.indexer_mirrors) == 1         # the decode token only
    # durable from the restoring plan on: the prompt's full pages are published
    assert req.num_durable == n and len(kv.host_pool.hash_to_block) == n // BS
    assert len(kv.build_plan(2).restores) == 0                          # restored once
    kv.apply_acks([1])
    assert req.num_durable == n + 1
    assert len(kv.host_pool.hash_to_block) == (n + 1) // BS
    kv.free("a")
    assert_full(kv)


def test_a_load_freed_before_its_restoring_plan_restores_and_publishes_nothing():
    kv = core()
    kv.admit_remote("a", list(range(20)) + [5], 30, remote(20))
    kv.finish_remote("a")
    kv.free("a")                      # e.g. preempted before any plan
    plan = kv.build_plan(1)
    assert len(plan.restores) == len(plan.indexer_restores) == 0
    assert not kv.host_pool.hash_to_block and not kv.has_landed
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
    assert len(plan.indexer_restores) == len(plan.restores) == 4   # the pulled partial page
    assert len(plan.indexer_mirrors) == 1                # the decode token's
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
    """A failed load whose READs may still write: the blocks they target (the host blocks of
    every pulled page) outlive the request's free and are never handed out (admissions until
    the pools run dry get none of them) until released; the request's GPU and indexer blocks
    (no READ writes them) free at once."""
    kv = core(num_gpu_blocks)
    job = kv.admit_remote("a", list(range(100, 100 + n)) + [5], n + 10, remote(n))
    host = job.read_targets()
    assert len(host) == len(job.host_blocks) == -(-n // BS)
    kv.quarantine(job)
    kv.free("a")
    assert kv.quarantined_blocks == len(host)
    assert (kv.gpu_pool.num_free, kv.host_pool.num_free, kv.indexer_pool.num_free) == (
        kv.cfg.num_gpu_blocks, kv.cfg.num_host_blocks - len(host), kv.cfg.num_indexer_blocks)
    taken = set()
    for i in range(100):     # take blocks until a pool runs dry, 1-token-page requests
        other = kv.admit(f"b{i}", [7 + i], BS)
        if other is None:
            break
        assert kv.allocate_slots(other, 1)
        kv.build_plan(i)
        taken.update(int(b) for b in other.host[:1])
        kv.free(f"b{i}")    # freed, its mirror unacked: its blocks stay taken (draining)
    assert taken and not taken & set(host.tolist())
    kv.apply_acks(range(100))
    kv.release_quarantine(job)
    assert kv.quarantined_blocks == 0
    assert_full(kv)
