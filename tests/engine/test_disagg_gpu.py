"""Disaggregation on CUDA (issue 23): both roles in one process on one GPU, NIXL over UCX
moving the prefill's pinned host-pool rows into the decode's pinned host pool, restored from
there into its GPU arena and indexer cache; FP8 and bf16 KV; CUDA-graph decode; greedy outputs
equal a colocated run."""

import random

import pytest

from hisparse import LLM, SamplingParams
from hisparse.models.random_checkpoint import PRODUCTION_GEOMETRY, make_random_checkpoint

pytestmark = pytest.mark.gpu
pytest.importorskip("nixl_cu13")


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    geo = dict(PRODUCTION_GEOMETRY, index_topk=64)
    return make_random_checkpoint(tmp_path_factory.mktemp("gpu_pd"), "deepseek_v32", seed=4,
                                  hidden_size=256, num_attention_heads=16,
                                  num_key_value_heads=16, q_lora_rank=128,
                                  num_hidden_layers=3, first_k_dense_replace=100, **geo)


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("decode_gpu_blocks", [400, 60])
def test_prefill_to_decode_on_gpu(dense_path, kv_cache_dtype, decode_gpu_blocks):
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(rng.randrange(150, 400))]}
               for _ in range(8)]
    common = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=512,
                  max_num_seqs=8, max_num_batched_tokens=256, kv_cache_dtype=kv_cache_dtype,
                  hot_buffer_size=128, host_pool_gib=0.5)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids
            for o in LLM(dense_path, num_gpu_blocks=400, **common).generate(prompts, greedy)]
    p = LLM(dense_path, num_gpu_blocks=400, kv_role="prefill", **common)
    d = LLM(dense_path, num_gpu_blocks=decode_gpu_blocks, kv_role="decode", **common)
    pre = p.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1,
                                             kv_transfer_params={"do_remote_decode": True}))
    outs = d.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                               kv_transfer_params=o.kv_transfer_params)
                                for o in pre])
    assert [o.outputs[0].token_ids for o in outs] == want
    m = d.disagg.metrics
    assert m.requests == len(prompts) and m.failures == 0
    assert (m.rows_host > 0) == (decode_gpu_blocks == 60)
    assert {lay.mem for lay in d.disagg.agent.layouts.values()} == {"DRAM"}   # pinned host
    assert m.rows_gpu > 0 and d.runner.h2d_bytes > 0          # restored from the host pool
    s = d.stats()
    assert s["free_gpu_blocks"] == decode_gpu_blocks
    assert s["free_host_blocks"] == d.kv_config.num_host_blocks
