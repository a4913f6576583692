import numpy as np
import pytest

from hisparse.config import KVCacheConfig
from hisparse.engine.simulate import Simulation
from hisparse.kv.coordinator import KVCoordinator
from hisparse.kv.plan import flat_rows


def cfg(**kw):
    base = dict(block_size=4, num_gpu_blocks=40, num_host_blocks=100, num_indexer_blocks=100,
                max_model_len=64, index_topk=4, hot_buffer_size=8, max_num_seqs=4,
                max_num_batched_tokens=16)
    base.update(kw)
    return KVCacheConfig(**base)


@pytest.mark.parametrize("field,value,match", [
    ("block_size", 3, "block_size must be a power of two"),
    ("block_size", 0, "block_size must be a positive integer"),
    ("num_gpu_blocks", -1, "num_gpu_blocks must be a positive integer"),
    ("hot_buffer_size", 3, r"hot_buffer_size must be >= index_topk \(4\)"),
    ("num_host_blocks", 15, r"num_host_blocks must hold one max-length request \(>= 16"),
    ("num_gpu_blocks", 8, r"num_gpu_blocks must be >= 9"),
    ("mode", "sometimes", "mode must be one of"),
])
def test_bad_config_names_field_and_limit(field, value, match):
    with pytest.raises(ValueError, match=match):
        cfg(**{field: value})


def test_mirrors_cover_exactly_the_rows_written():
    kv = KVCoordinator(cfg())
    tokens = list(range(10))
    req = kv.admit("a", tokens, 20)
    assert req.num_computed == 0
    assert kv.allocate_slots(req, 10)
    plan = kv.build_plan(1)
    pos = np.arange(10)
    want_gpu = flat_rows(req.resident[None], 0, pos, 4)
    want_host = flat_rows(req.host[None], 0, pos, 4)
    assert np.array_equal(plan.mirrors.src_rows, want_gpu)
    assert np.array_equal(plan.mirrors.dst_rows, want_host)
    assert plan.mirrors.copy_id == 1 and plan.seqs[0].sample


def test_publication_waits_for_ack_and_follows_the_contiguous_prefix():
    kv = KVCoordinator(cfg())
    a = kv.admit("a", list(range(12)), 20)
    kv.allocate_slots(a, 4)
    kv.build_plan(1)
    kv.allocate_slots(a, 8)
    kv.build_plan(2)
    assert kv.host_pool.hash_to_block == {}
    kv.apply_acks([2])                    # out of order: page 1-2 durable only after step 1
    assert kv.host_pool.hash_to_block == {} and kv.get("a").num_durable == 0
    kv.apply_acks([1])
    assert kv.get("a").num_durable == 12 and len(kv.host_pool.hash_to_block) == 3


def test_prefix_hit_after_finish_restores_indexer_and_reuses_cached_gpu_pages():
    kv = KVCoordinator(cfg())
    prompt = list(range(13))
    kv.allocate_slots(kv.admit("a", prompt, 20), 13)
    kv.build_plan(1)
    kv.apply_acks([1])
    kv.free("a")
    assert kv.admit("b", prompt[:12] + [99, 98], 20).num_computed == 12
    plan = kv.build_plan(2)
    assert len(plan.restores) == 0          # GPU copies were still cached
    assert len(plan.indexer_restores) == 12  # indexer keys always come back from host
    assert kv.stats.prefix_hit_tokens == 12 and kv.stats.host_prefix_hit_tokens == 0


def test_admission_reclaims_before_rejecting():
    # Pool of 24 blocks: two 48-token requests cannot both stay resident.
    c = cfg(num_gpu_blocks=24, max_model_len=64, max_num_batched_tokens=64)
    sim = Simulation(c, seed=3, max_delay=0)
    sim.add(list(range(48)), 8)
    for _ in range(4):
        sim.step()
    assert sim.kv.num_free_gpu_blocks < 13
    sim.add(list(range(100, 148)), 8)
    sim.step()
    sim.step()
    assert sim.kv.stats.host_read_switches >= 1
    assert len(sim.scheduler.running) == 2 and sim.scheduler.num_preempted == 0
    sim.run_to_completion(check=True)
    sim.check_all_free()


@pytest.mark.parametrize("mode", ["hisparse", "always-host", "gpu-only"])
def test_simulated_workload_completes_with_invariants(mode):
    c = cfg(mode=mode, num_gpu_blocks=40 if mode != "gpu-only" else 64)
    sim = Simulation(c, seed=7)
    rng = np.random.default_rng(0)
    shared = list(rng.integers(0, 50, 20))
    for i in range(10):
        prompt = (shared if i % 2 else []) + list(rng.integers(0, 50, int(rng.integers(1, 30))))
        sim.add([int(t) for t in prompt], int(rng.integers(1, 20)))
    result = sim.run_to_completion(check=True)
    sim.check_all_free()
    assert result.finished == 10
    if mode == "gpu-only":
        assert result.stats["hot_misses"] == 0 and result.stats["mirrored_rows"] == 0
    else:
        assert result.stats["spilled_pages"] > 0 and result.stats["hot_misses"] > 0
        assert result.stats["prefix_hit_tokens"] > 0


def test_prefix_hit_after_reclaim_never_aliases_a_hot_block():
    """Reclaim during admission hands cached blocks out as hot blocks: the hits must be looked
    up again, or a prefix page would alias another request's hot buffer."""
    c = cfg(num_gpu_blocks=16, num_host_blocks=64, num_indexer_blocks=64, hot_buffer_size=4,
            max_num_batched_tokens=4, watermark_blocks=0)
    sim = Simulation(c, seed=0, max_delay=0)
    a = sim.add(list(range(100, 109)), 3)
    sim.run_to_completion(check=True)              # A's pages stay cached (GPU and host)
    b = sim.add(list(range(200, 255)), 8)
    while b.num_output_tokens < 2:
        sim.step()
    sim.add(a.prompt_token_ids[:8] + [999], 3)     # prefix hit while GPU blocks are short
    sim.run_to_completion(check=True)
    assert sim.kv.stats.host_read_switches >= 1 and sim.kv.stats.prefix_hit_tokens >= 8
    sim.check_all_free()


def test_prefill_released_pages_switch_to_host_read_at_first_decode():
    """Staged prefill (issue 14): pages a prefilling request gave up under pressure are
    host-only from the moment they are unpinned, even while their blocks still hold the rows
    (no one reused them yet): later chunks are staged and the first decode step switches to
    host-read mode, before any reuse could pull the history from under a resident-only read."""
    kv = KVCoordinator(cfg(num_gpu_blocks=12))
    a = kv.admit("a", list(range(36)), 48)
    assert kv.allocate_slots(a, 16)
    kv.build_plan(1)
    kv.apply_acks([1])
    kv.reclaim.release_prefill_pages(kv.gpu_pool.num_free + 2)   # pressure during prefill
    assert a.pinned_start == 2 and (a.resident[:2] >= 0).all()   # unpinned, blocks intact
    assert kv.allocate_slots(a, 16)
    assert kv.build_plan(2).seqs[0].staged
    assert kv.allocate_slots(a, 4)                                # the prompt's last chunk
    assert kv.build_plan(3).seqs[0].sample
    assert (a.resident[:2] >= 0).all() and not a.host_read
    assert kv.allocate_slots(a, 1)                                # first decode token
    assert a.host_read and len(a.hot_blocks) == kv.cfg.hot_blocks_per_request
    assert not kv.build_plan(4).seqs[0].staged


def test_gpu_held_admission_once_the_host_pool_is_full():
    """hisparse: a request the host pool cannot hold runs with every page on GPU and no host
    blocks (when they fit above the watermark); it is never mirrored, never a switch
    candidate, and frees its pages like any other."""
    c = cfg(num_host_blocks=16, num_gpu_blocks=40, watermark_blocks=4)
    kv = KVCoordinator(c)
    a = kv.admit("a", list(range(10)), 64)          # takes the whole host pool (16 pages)
    assert a.host_backed and (a.host[:16] >= 0).all() and kv.host_pool.num_free == 0
    free = kv.gpu_pool.num_free
    b = kv.admit("b", list(range(50, 60)), 32)      # 8 pages
    assert not b.host_backed and kv.stats.gpu_held_admissions == 1
    assert (b.resident[:8] >= 0).all() and (b.host == -1).all()
    assert kv.gpu_pool.num_free == free - 8
    # kv_role="prefill" requests must reach the host pool: they wait instead
    assert kv.admit("p", list(range(5)), 8, need_host=True) is None
    with pytest.raises(ValueError, match="GPU-held"):
        kv.hold("b")
    assert kv.allocate_slots(a, 10) and kv.allocate_slots(b, 10)
    plan = kv.build_plan(1)
    pos = np.arange(10)
    assert np.array_equal(plan.mirrors.src_rows, flat_rows(a.resident[None], 0, pos, 4))
    assert np.array_equal(plan.indexer_mirrors.src_rows, flat_rows(a.indexer[None], 0, pos, 4))
    assert not b.pending and b.num_durable == 0
    kv.apply_acks([1])
    b.token_ids.append(7)
    b.num_pending_tokens = 0
    assert kv.allocate_slots(b, 1)                   # decoding: not a host-read candidate
    assert b.uid not in kv.reclaim.candidates and not b.host_read
    assert len(kv.build_plan(2).mirrors) == 0
    # GPU-held admissions leave the watermark (4) free: 40 - 3 (a) - 8 (b) = 29 free
    assert kv.gpu_pool.num_free == 29
    assert not kv.admit("c", list(range(3)), 64).host_backed          # 16 pages: 13 left
    # 11 pages + the watermark: 15 > 13 free + a's one reclaimable clean page, so nothing
    # is reclaimed for an admission that cannot succeed
    assert kv.admit("d", list(range(3)), 44) is None
    assert a.pinned_start == 0 and kv.gpu_pool.num_free == 13
    # 10 pages: reclaim first (a's clean page outside its tail is unpinned), 4 left
    assert kv.admit("d", list(range(3)), 40) is not None
    assert a.pinned_start == 1 and kv.gpu_pool.num_free == 4
    for req_id in "bcda":
        kv.free(req_id)
    kv.apply_acks([2])
    assert kv.gpu_pool.num_free == 40 and kv.host_pool.num_free == 16
    assert kv.indexer_pool.num_free == 100


def test_gpu_held_admission_keeps_the_watermark():
    c = cfg(num_host_blocks=16, num_gpu_blocks=20, watermark_blocks=4, max_model_len=64)
    kv = KVCoordinator(c)
    kv.admit("a", list(range(4)), 64)               # host pool full, 1 GPU page so far
    assert kv.allocate_slots(kv.get("a"), 4)
    assert kv.admit("b", list(range(4)), 64) is None          # 16 pages + 4 > 20 - 1 free
    b = kv.admit("b", list(range(4)), 60)                     # 15 pages: 19 - 15 = 4 left
    assert b is not None and not b.host_backed and kv.gpu_pool.num_free == 4


def test_gpu_held_admission_uses_prefix_hits():
    """A GPU-held request claims its prompt's cached pages: a GPU copy is shared, a host-only
    page is restored into its own block; it holds those host blocks (no new ones) until
    freed, and both restores read them. Pools whole at the end."""
    kv = KVCoordinator(cfg(num_host_blocks=16, num_gpu_blocks=60, watermark_blocks=4))
    prompt = list(range(100, 126))                  # 6 full pages + 2 tokens
    a = kv.admit("a", prompt, 64)                   # the whole host pool
    assert kv.allocate_slots(a, 16) and kv.allocate_slots(a, 10)
    kv.build_plan(1)
    kv.apply_acks([1])                              # durable: pages 0-5 published
    assert a.num_published == 6
    assert kv.reclaim.unpin_clean_pages(a) == 5     # pages 0-4 (5-6: the tail stays)
    for block in kv.gpu_pool.allocate(kv.gpu_pool.num_free):   # someone reuses them ...
        kv.gpu_pool.release(int(block))             # ... so pages 0-4 live on host only
    assert (a.resident[:5] == -1).all() and a.resident[5] >= 0
    free, host_free = kv.gpu_pool.num_free, kv.host_pool.num_free
    b = kv.admit("b", prompt[:24] + [7, 8, 9], 40)  # 10 pages, 6 of them cached
    assert b is not None and not b.host_backed and kv.stats.gpu_held_admissions == 1
    assert b.num_computed == b.num_durable == 24 and b.num_published == 6
    assert kv.host_pool.num_free == host_free       # no host block of its own
    assert np.array_equal(b.host[:6], a.host[:6]) and (b.host[6:] == -1).all()
    # page 5 still pinned by a: shared; pages 0-4 restored into new blocks
    assert b.resident[5] == a.resident[5]
    assert (b.resident[:10] >= 0).all() and len(set(b.resident[:10].tolist())) == 10
    assert kv.gpu_pool.num_free == free - 9         # 5 restored + 4 own pages
    plan = kv.build_plan(2)
    restored = {(int(h), int(g)) for h, g in zip(plan.restores.src_rows[::4] // 4,
                                                 plan.restores.dst_rows[::4] // 4)}
    assert restored == {(int(a.host[p]), int(b.resident[p])) for p in range(5)}
    keys = set(zip((plan.indexer_restores.src_rows[::4] // 4).tolist(),
                   (plan.indexer_restores.dst_rows[::4] // 4).tolist()))
    assert keys == {(int(a.host[p]), int(b.indexer[p])) for p in range(6)}
    kv.free("a")
    assert kv.host_pool.num_free == 10              # b still holds the 6 hit blocks
    kv.free("b")
    kv.apply_acks([2])
    assert kv.gpu_pool.num_free == 60 and kv.host_pool.num_free == 16
    assert kv.indexer_pool.num_free == 100


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("mode", ["hisparse", "always-host"])
def test_small_host_pool_workload_with_invariants(mode, shared):
    """A host pool of two requests: hisparse runs the rest GPU-held (every invariant checked
    each step, every pool whole at the end); always-host admits only what the pool holds.
    ``shared``: the prompts share a 16-token prefix, which GPU-held requests claim too (every
    row they read is checked against its expected value)."""
    c = cfg(mode=mode, num_host_blocks=32, num_gpu_blocks=80, max_num_seqs=6)
    sim = Simulation(c, seed=11)
    rng = np.random.default_rng(1)
    system = [int(t) for t in rng.integers(0, 50, 16)] if shared else []
    for _ in range(12):
        prompt = system + [int(t) for t in rng.integers(0, 50, int(rng.integers(20, 40)) -
                                                        len(system))]
        sim.add(prompt, 64 - len(prompt))           # max_len 64: 16 host blocks each
    result = sim.run_to_completion(check=True)
    sim.check_all_free()
    assert result.finished == 12
    if mode == "hisparse":
        assert result.stats["gpu_held_admissions"] > 0
        assert sim.scheduler.peak_running > 32 // 16
        if shared:      # more hits than the host-backed requests alone can claim
            assert result.stats["prefix_hit_tokens"] > 16 * (32 // 16), result.stats
    else:
        assert result.stats["gpu_held_admissions"] == 0
        assert sim.scheduler.peak_running <= 32 // 16


def test_hopeless_gpu_held_admission_switches_no_one():
    """A request that cannot fit the arena GPU-held even after every reclaim is refused before
    anyone is switched to host-read mode (each step would otherwise push another resident
    request to host reads for nothing)."""
    kv = KVCoordinator(cfg(num_host_blocks=16, num_gpu_blocks=18, watermark_blocks=4))
    a = kv.admit("a", list(range(36)), 64)          # the whole host pool
    assert kv.allocate_slots(a, 36)
    kv.build_plan(1)
    kv.apply_acks([1])
    a.token_ids.append(5)
    assert kv.allocate_slots(a, 1)                   # decoding, resident: a switch candidate
    kv.build_plan(2)
    kv.apply_acks([2])
    assert a.uid in kv.reclaim.candidates
    assert kv.admit("d", list(range(3)), 64) is None     # 16 pages + 4 > 18 blocks in all
    assert not a.host_read and a.pinned_start == 0 and kv.stats.host_read_switches == 0
    # one that reclaim can serve switches a: 8 free + (8 clean pages - 4 hot blocks)
    assert kv.admit("e", list(range(3)), 32) is not None     # 8 pages + 4 = 12 <= 12
    assert a.host_read and kv.stats.host_read_switches == 1
