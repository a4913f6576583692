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
