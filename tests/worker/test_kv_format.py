"""The cache-format seam (:mod:`hisparse.worker.kv_format`): for each format, tensors written
through it read back as the format defines them (bf16: the values; fp8: quantize ->
dequantize), and its attention over the written rows is the spec's attention over those
definitions, in the format's output dtype."""

import pytest
import torch

from hisparse import ops
from hisparse.config import KVCacheConfig
from hisparse.worker.cache import CacheGeometry, KVCaches
from hisparse.worker.kv_format import BF16Format, FP8Format, kv_format


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("bf16", torch.float32),
                                                  ("fp8", torch.bfloat16)])
def test_written_rows_and_keys_read_back_and_attend_as_the_format_defines(kv_cache_dtype, dtype):
    bs, T, K, H = 4, 6, 5, 2
    cfg = KVCacheConfig(block_size=bs, num_gpu_blocks=8, num_host_blocks=8, num_indexer_blocks=8,
                        max_model_len=32, index_topk=K, hot_buffer_size=8, max_num_seqs=2,
                        max_num_batched_tokens=8)
    geo = CacheGeometry(num_layers=2, row_dim=576, indexer_layers=(0,), index_head_dim=128,
                        dtype=dtype, kv_cache_dtype=kv_cache_dtype, rope_dim=64)
    c = KVCaches(cfg, geo, torch.device("cpu"))
    fmt = kv_format(geo, geo.kv_lora_rank, c.device)
    assert type(fmt) is (FP8Format if geo.fp8 else BF16Format)
    g = torch.Generator().manual_seed(7)
    c.arena.copy_(torch.randint(0, 256, c.arena.shape, generator=g).to(c.arena.dtype))  # poison
    c.indexer.copy_(torch.randint(0, 256, c.indexer.shape, generator=g).to(c.indexer.dtype))
    rows = torch.randperm(8 * bs, generator=g)[:T]                 # int64 flat rows
    new = torch.randn(T, 576, generator=g).to(dtype)
    keys = torch.randn(T, 128, generator=g).to(dtype)
    arena, idx = c.arena_layer(1), c.indexer_layer(0)
    other = c.arena_layer(0).clone()
    fmt.write_rows(new, arena, rows)
    fmt.write_keys(keys, idx, rows)
    if geo.fp8:
        want_rows = ops.dequantize_mla_rows_reference(ops.quantize_mla_rows_reference(new, 512),
                                                      512, 64, dtype)
        got_rows = ops.dequantize_mla_rows_reference(arena[rows], 512, 64, dtype)
        want_keys = ops.quantize_index_keys_reference(keys)
        got_keys = ops.FP8KeyLayout.of(idx, 128).gather(idx, rows)
    else:
        want_rows, got_rows, want_keys, got_keys = new, arena[rows], keys, idx[rows]
    assert torch.equal(got_rows, want_rows) and torch.equal(got_keys, want_keys)
    assert torch.equal(c.arena_layer(0), other)          # one layer's view only
    assert fmt.sched_meta() is None                       # nothing to share on CPU
    # attention over the written rows, by flat row id (-1: none), = the spec over the definitions
    local = torch.randint(0, T, (T, K), generator=g)
    local[torch.rand(T, K, generator=g) < 0.3] = -1
    flat = torch.where(local >= 0, rows[local.clamp(min=0)], -1).to(torch.int32)
    q = torch.randn(T, H, 576, generator=g)                        # fp32: the format casts it
    out = fmt.attention(q, arena, flat, 0.05)
    want, _ = ops.sparse_mla_attention_reference(q.to(dtype), want_rows, local.to(torch.int32),
                                                 0.05, d_v=512)
    assert out.dtype == dtype and out.shape == (T, H, 512)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_the_query_comes_back_from_the_rows_write(fused, kernel_switches):
    """``PagedContext``'s rows write hands back the absorbed query: a ``NewQuery`` next to
    ``NewRows`` through the rows' call (one launch on Triton), else materialized on its own;
    the same rows and query either way (references here, ``HISPARSE_FUSED_GLUE`` either way)."""
    from hisparse.models.context import NewQuery, NewRows
    from hisparse.ops import glue
    from hisparse.worker.model_runner import _write_rows

    kernel_switches(fused_glue=fused)
    T, H, R, rope = 3, 2, 32, 16
    kv = torch.randn(T, R + rope)
    cos, sin = torch.randn(T, rope // 2), torch.randn(T, rope // 2)
    new = NewRows(kv, torch.rand(R) + 0.5, 1e-6, cos, sin, R)
    query = NewQuery(torch.randn(H, T, R).transpose(0, 1), torch.randn(T, H, rope), cos, sin)
    assert query.shape == (T, H, R + rope) and query.dtype == torch.float32
    rows = torch.tensor([4, 0, 2])
    want_q = glue.mla_q_latent_reference(query.q_abs, query.q_pe, cos, sin)
    for kv_new in (new, new.materialize()):
        dst = torch.full((6, R + rope), float("nan"))
        q = _write_rows(kv_new, query, dst, rows, lambda t, d, r: d.index_copy_(0, r, t))
        assert torch.equal(q, want_q) and torch.equal(dst[rows], new.materialize())
    q = torch.randn(T, H, R + rope)
    assert _write_rows(new, q, dst, rows, None) is q
