"""Region layouts of the real cache tensors: every (layer, block) descriptor addresses that
layer's own block (a per-layer view starting at layer 0's offset would not pass)."""

import torch

from hisparse.config import KVCacheConfig
from hisparse.kv.transfer_plan import run_descriptors
from hisparse.worker.cache import CacheGeometry, KVCaches
from hisparse.worker.kv_transfer import region_layout


def test_region_layouts_address_each_layers_blocks():
    for kv_dtype in ("bf16", "fp8"):
        cfg = KVCacheConfig(block_size=8, num_gpu_blocks=40, num_host_blocks=30,
                            num_indexer_blocks=24, max_model_len=64, index_topk=16,
                            max_num_seqs=2, max_num_batched_tokens=32)
        geo = CacheGeometry(num_layers=3, row_dim=576, indexer_layers=(0, 2),
                            index_head_dim=128, dtype=torch.float32, kv_cache_dtype=kv_dtype)
        c = KVCaches(cfg, geo, torch.device("cpu"))
        bs = cfg.block_size
        key_rows = 1 if kv_dtype == "fp8" else bs   # FP8 key pages [Li, blocks, bs * 132]
        cases = [(c.arena, cfg.num_gpu_blocks + 1, bs), (c.host, cfg.num_host_blocks, bs),
                 (c.indexer, cfg.num_indexer_blocks + 1, key_rows),
                 (c.host_indexer, cfg.num_host_blocks, key_rows)]
        for t, blocks, rows_per_block in cases:
            lay = region_layout(t, blocks)
            assert lay.block_bytes * blocks * lay.num_layers == t.numel() * t.element_size()
            d = run_descriptors(lay, [1, 5], [2, 1])
            for layer in range(t.shape[0]):
                for j, (b, n) in enumerate([(1, 2), (5, 1)]):
                    addr, length, _ = (int(x) for x in d[layer * 2 + j])
                    assert addr == t[layer, b * rows_per_block].data_ptr()
                    assert length == n * lay.block_bytes
                    keys = t is c.indexer or t is c.host_indexer
                    assert lay.block_bytes == (geo.key_bytes if keys else geo.row_bytes) * bs
