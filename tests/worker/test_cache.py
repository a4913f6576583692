import torch

from hisparse.config import KVCacheConfig
from hisparse.worker.cache import CacheGeometry, KVCaches


def test_layer_views_of_the_packed_arena_do_not_overlap():
    cfg = KVCacheConfig(block_size=4, num_gpu_blocks=8, num_host_blocks=8, num_indexer_blocks=8,
                        max_model_len=32, index_topk=4, hot_buffer_size=8, max_num_seqs=2,
                        max_num_batched_tokens=8)
    geo = CacheGeometry(num_layers=3, row_dim=6, indexer_layers=(0, 2), index_head_dim=5,
                        dtype=torch.float32)
    c = KVCaches(cfg, geo, torch.device("cpu"))
    data = [torch.randn(32, 6) for _ in range(3)]
    keys = {layer: torch.randn(32, 5) for layer in (0, 2)}
    for layer in range(3):
        c.arena_layer(layer)[:32].copy_(data[layer])
        c.host_layer(layer).copy_(data[layer] + 1)
    for layer, k in keys.items():
        c.indexer_layer(layer)[:32].copy_(k)
    for layer in range(3):     # each layer reads back its own rows, after every layer wrote
        assert torch.equal(c.arena_layer(layer)[:32], data[layer])
        assert torch.equal(c.host_layer(layer), data[layer] + 1)
        assert c.arena_layer(layer).data_ptr() == (c.arena.data_ptr()
                                                   + layer * c.arena.stride(0) * 4)
    for layer, k in keys.items():
        assert torch.equal(c.indexer_layer(layer)[:32], k)


def _fp8_caches(num_layers=3, indexer_layers=(0, 2), row_dim=576, rope=64, idx_dim=128):
    cfg = KVCacheConfig(block_size=4, num_gpu_blocks=8, num_host_blocks=8, num_indexer_blocks=8,
                        max_model_len=32, index_topk=4, hot_buffer_size=8, max_num_seqs=2,
                        max_num_batched_tokens=8)
    geo = CacheGeometry(num_layers=num_layers, row_dim=row_dim, indexer_layers=indexer_layers,
                        index_head_dim=idx_dim, dtype=torch.bfloat16, kv_cache_dtype="fp8",
                        rope_dim=rope)
    return cfg, geo, KVCaches(cfg, geo, torch.device("cpu"))


def test_fp8_layer_views_start_at_their_own_offsets():
    """The packed-binding bug class: every layer's FP8 byte view (and its quantize-write and
    resolver views) must start at its own layer offset."""
    from hisparse import ops
    cfg, geo, c = _fp8_caches()
    assert c.arena.dtype == torch.uint8 and c.arena.shape[-1] == 656
    assert c.indexer.shape == (2, cfg.num_indexer_blocks + 1, cfg.block_size * 132)
    assert c.host_indexer.shape == (2, cfg.num_host_blocks, cfg.block_size * 132)
    assert c.host.shape[-1] == 656
    lay = ops.FP8KeyLayout(128, cfg.block_size)
    rows = torch.arange(32)
    data = [torch.randn(32, 576) * (layer + 1) for layer in range(3)]
    keys = {layer: torch.randn(32, 128) for layer in (0, 2)}
    for layer in range(3):
        ops.quantize_write_mla_rows(data[layer], c.arena_layer(layer), rows, 512)
        c.host_layer(layer).copy_(c.arena_layer(layer)[:32])
    for layer, k in keys.items():
        ops.quantize_write_index_keys(k, c.indexer_layer(layer), rows)
    for layer in range(3):
        want = ops.quantize_mla_rows_reference(data[layer], 512)
        assert torch.equal(c.arena_layer(layer)[:32], want)
        assert torch.equal(c.host_layer(layer), want)
        layer_bytes = c.arena.stride(0)
        assert c.arena_layer(layer).data_ptr() == c.arena.data_ptr() + layer * layer_bytes
        words = c.resolve_view(c.arena_layer(layer))
        assert words.dtype == torch.int32 and words.shape[-1] == 164
        assert words.data_ptr() == c.arena_layer(layer).data_ptr()
        assert torch.equal(c.resolve_view(c.host_layer(layer))[:32], want.view(torch.int32))
    for i, (layer, k) in enumerate(keys.items()):
        assert torch.equal(lay.gather(c.indexer_layer(layer), rows),
                           ops.quantize_index_keys_reference(k))
        assert c.indexer_layer(layer).data_ptr() == c.indexer.data_ptr() + i * c.indexer.stride(0)


def test_fp8_keys_mirror_and_restore_through_the_host_pool():
    """Page-split FP8 keys: mirror (GPU -> host) then restore (host -> other GPU blocks) with
    KVCaches.copy_keys, every indexer layer at once, random keys and rows; each layer gets its
    own keys back, the sink block and unlisted rows keep their bytes."""
    from hisparse import ops
    cfg, geo, c = _fp8_caches(num_layers=4, indexer_layers=(0, 1, 3))
    bs = cfg.block_size
    lay = ops.FP8KeyLayout(128, bs)
    c.indexer.random_(0, 256)
    c.host_indexer.random_(0, 256)
    keys = {layer: torch.randn(6 * bs, 128) * (layer + 1) for layer in geo.indexer_layers}
    src = torch.randperm(6 * bs)
    for layer, k in keys.items():
        ops.quantize_write_index_keys(k, c.indexer_layer(layer), src)
    host_rows = torch.randperm(cfg.num_host_blocks * bs)[:6 * bs]
    c.copy_keys(c.indexer, c.host_indexer, src, host_rows)
    before = c.indexer.clone()
    dst = torch.randperm(cfg.num_indexer_blocks * bs)[:5 * bs]
    c.copy_keys(c.host_indexer, c.indexer, host_rows[:5 * bs], dst)
    for i, (layer, k) in enumerate(keys.items()):
        want = ops.quantize_index_keys_reference(k)
        assert torch.equal(lay.gather(c.host_indexer[i], host_rows), want)
        assert torch.equal(lay.gather(c.indexer_layer(layer), dst), want[:5 * bs])
    keep = torch.ones(cfg.num_indexer_blocks * bs, dtype=torch.bool)
    keep[dst] = False
    kept = keep.nonzero().squeeze(1)
    assert torch.equal(lay.gather(c.indexer, kept), lay.gather(before, kept))
    assert torch.equal(c.indexer[:, -1], before[:, -1])                 # the sink block


def test_fp8_host_bytes_per_token_match_the_pool():
    cfg, geo, c = _fp8_caches(num_layers=4, indexer_layers=(0, 1, 3))
    assert geo.row_bytes == 656 and geo.key_bytes == 132
    assert geo.bytes_per_token == 4 * 656 + 3 * 132
    host_rows = cfg.num_host_blocks * cfg.block_size
    real = (c.host.numel() * c.host.element_size()
            + c.host_indexer.numel() * c.host_indexer.element_size())
    assert real == host_rows * geo.bytes_per_token
    per_layer = (c.host.numel() * c.host.element_size() // 4
                 + c.host_indexer.numel() * c.host_indexer.element_size() // 3) // host_rows
    assert per_layer == 656 + 132
    assert geo.gpu_bytes_per_block(cfg.block_size) == cfg.block_size * 4 * 656
    from hisparse.engine.capacity import ModelGeometry
    mg = ModelGeometry(num_layers=4, num_indexer_layers=3, kv_lora_rank=512, qk_rope_head_dim=64,
                       index_head_dim=128, index_topk=2048)
    assert (mg.row_bytes("fp8"), mg.key_bytes("fp8")) == (geo.row_bytes, geo.key_bytes)
    bf = CacheGeometry(num_layers=4, row_dim=576, indexer_layers=(0, 1, 3), index_head_dim=128,
                       dtype=torch.bfloat16)
    assert (mg.row_bytes("bf16"), mg.key_bytes("bf16")) == (bf.row_bytes, bf.key_bytes)
    assert (bf.row_bytes, bf.key_bytes) == (1152, 256)


def test_bad_kv_cache_dtype():
    import pytest
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheGeometry(num_layers=1, row_dim=576, indexer_layers=(0,), index_head_dim=128,
                      dtype=torch.bfloat16, kv_cache_dtype="int8")
