"""KVCacheConfig validation: every error names the field and the limit."""

from __future__ import annotations

import pytest

from hisparse.config import ACTIVE_TAIL_PAGES, MODES, KVCacheConfig, Mode, cdiv, host_blocks_for_gib

BASE = dict(block_size=16, num_gpu_blocks=64, num_host_blocks=64, num_indexer_blocks=64,
            max_model_len=512, index_topk=32, max_num_seqs=4, max_num_batched_tokens=256)


def cfg(**kw):
    return KVCacheConfig(**{**BASE, **kw})


def test_defaults_and_derived_sizes():
    c = cfg()
    assert c.mode is Mode.HISPARSE and c.hot_buffer_size == 64
    assert c.max_pages_per_request == 32 and c.hot_blocks_per_request == 4
    assert c.chunk_pages == 256 // 16 + 1
    assert c.watermark == max(4, 64 // 10) and c.uses_host
    assert c.min_gpu_blocks == 4 + ACTIVE_TAIL_PAGES + 17
    assert c.num_staging_rows == c.max_model_len and cfg(mode="gpu-only").num_staging_rows == 0


@pytest.mark.parametrize("field", ["block_size", "num_gpu_blocks", "num_indexer_blocks",
                                   "max_model_len", "index_topk", "max_num_seqs",
                                   "max_num_batched_tokens", "hot_buffer_size"])
@pytest.mark.parametrize("value", [0, -3, 2.5, True, "8"])
def test_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a positive integer, got"):
        cfg(**{field: value})


def test_block_size_power_of_two():
    with pytest.raises(ValueError, match="block_size must be a power of two, got 24"):
        cfg(block_size=24)


def test_hot_buffer_at_least_index_topk():
    with pytest.raises(ValueError, match=r"hot_buffer_size must be >= index_topk \(32\), got 16"):
        cfg(hot_buffer_size=16)


def test_mode_parsing():
    assert cfg(mode="gpu-only").mode is Mode.GPU_ONLY
    assert cfg(mode=Mode.ALWAYS_HOST).mode == "always-host"
    assert MODES == ("gpu-only", "hisparse", "always-host")
    with pytest.raises(ValueError, match=r"mode must be one of \['gpu-only', 'hisparse', "
                                         r"'always-host'\], got 'on'"):
        cfg(mode="on")


def test_host_pool_must_hold_one_request_unless_gpu_only():
    with pytest.raises(ValueError, match=r"num_host_blocks must hold one max-length request "
                                         r"\(>= 32 blocks"):
        cfg(num_host_blocks=31)
    assert cfg(num_host_blocks=0, mode="gpu-only").num_host_blocks == 0


def test_gpu_minimum_counts_the_chunk_that_can_actually_be_scheduled():
    # A 2048-token chunk can never exceed max_model_len=128 tokens.
    c = cfg(block_size=8, max_model_len=128, max_num_batched_tokens=2048, index_topk=16,
            num_gpu_blocks=64, num_indexer_blocks=16, num_host_blocks=16)
    assert c.chunk_pages == 16                       # min(cdiv(128, 8) + 1, 16 pages)
    assert c.min_gpu_blocks == 4 + ACTIVE_TAIL_PAGES + 16
    with pytest.raises(ValueError, match=r"num_gpu_blocks must be >= 22 \(hot blocks 4 \+ "
                                         r"tail 2 \+ one prefill chunk 16; spilled prefill "
                                         r"history is read through 128 staging rows\), got 21"):
        cfg(block_size=8, max_model_len=128, max_num_batched_tokens=2048, index_topk=16,
            num_gpu_blocks=21, num_indexer_blocks=16, num_host_blocks=16)


def test_gpu_minimum_does_not_need_one_max_model_len_prompt():
    """Issue 14: prefill reads spilled history through the staging area, so the minimum is
    hot blocks + tail + one chunk, whatever max_model_len is (a 128k context on a small pool)."""
    big = cfg(block_size=64, max_model_len=131072, index_topk=2048, max_num_batched_tokens=2048,
              num_gpu_blocks=100, num_host_blocks=2048, num_indexer_blocks=2048)
    assert big.max_pages_per_request == 2048
    assert big.min_gpu_blocks == 64 + ACTIVE_TAIL_PAGES + 33 == 99
    assert big.num_staging_rows == 131072          # a whole history: one group per chunk
    with pytest.raises(ValueError, match=r"num_gpu_blocks must be >= 99 \(hot blocks 64"):
        cfg(block_size=64, max_model_len=131072, index_topk=2048, max_num_batched_tokens=2048,
            num_gpu_blocks=98, num_host_blocks=2048, num_indexer_blocks=2048)


def test_staging_rows_validation():
    assert cfg(staging_rows=32).num_staging_rows == 32
    assert cfg(max_model_len=64, num_indexer_blocks=64, num_host_blocks=64).num_staging_rows \
        == 64                                       # capped at max_model_len
    for bad in (31, 0, True, 40.0):
        with pytest.raises(ValueError, match=r"staging_rows must be None or an integer >= "
                                             r"index_topk \(32\)"):
            cfg(staging_rows=bad)


def test_gpu_only_minimum_is_one_full_request():
    assert cfg(mode="gpu-only", num_gpu_blocks=32).min_gpu_blocks == 32
    with pytest.raises(ValueError, match=r"num_gpu_blocks must be >= 32 \(one max-length "
                                         r"request in gpu-only mode"):
        cfg(mode="gpu-only", num_gpu_blocks=31)


def test_indexer_pool_must_hold_one_request():
    with pytest.raises(ValueError, match=r"num_indexer_blocks must hold one max-length request "
                                         r"\(>= 32\), got 31"):
        cfg(num_indexer_blocks=31)


def test_watermark():
    assert cfg(watermark_blocks=0).watermark == 0
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match=f"watermark_blocks must be None or an integer "
                                             f">= 0, got {bad}"):
            cfg(watermark_blocks=bad)


@pytest.mark.parametrize("gib", [0, -1, float("nan"), float("inf"), "1"])
def test_host_pool_gib(gib):
    with pytest.raises(ValueError, match="host_pool_gib must be a positive number"):
        host_blocks_for_gib(gib, 1024)


def test_host_blocks_for_gib_and_cdiv():
    assert host_blocks_for_gib(1, 1 << 20) == 1024
    assert cdiv(7, 2) == 4 and cdiv(8, 2) == 4


def test_default_staging_is_capped():
    from hisparse.config import MAX_DEFAULT_STAGING_ROWS

    huge = cfg(block_size=64, max_model_len=1 << 20, index_topk=2048, max_num_batched_tokens=2048,
               num_gpu_blocks=100, num_host_blocks=16384, num_indexer_blocks=16384)
    assert huge.num_staging_rows == MAX_DEFAULT_STAGING_ROWS < huge.max_model_len
