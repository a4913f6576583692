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
