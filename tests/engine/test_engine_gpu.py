"""The engine on CUDA (Triton indexer, resolver with zero-copy host reads, attention, copies,
CUDA-graph decode): a tiny GPU pool must give the same greedy tokens as an unconstrained eager
run, in bf16."""

import random

import pytest
import torch

from hisparse import LLM, SamplingParams
from hisparse.models.random_checkpoint import PRODUCTION_GEOMETRY, make_random_checkpoint

pytestmark = pytest.mark.gpu


def checkpoint(tmp_path_factory, name, seed, **overrides):
    geo = dict(PRODUCTION_GEOMETRY, index_topk=64)
    return make_random_checkpoint(tmp_path_factory.mktemp(name), "deepseek_v32", seed=seed,
                                  hidden_size=256, num_attention_heads=16,
                                  num_key_value_heads=16, q_lora_rank=128, **geo, **overrides)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    # bf16 tensors, as DeepSeek's checkpoints: the router gates run the one bf16 pass
    return checkpoint(tmp_path_factory, "gpu_moe", 3, num_hidden_layers=2,
                      save_dtype="bfloat16")


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    return checkpoint(tmp_path_factory, "gpu_dense", 4, num_hidden_layers=3,
                      first_k_dense_replace=100)


def lossless_run(path, mode, num_prompts, gpu_blocks, seed, kv_cache_dtype="bf16"):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(rng.randrange(150, 400))]}
               for _ in range(num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    common = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=512,
                  max_num_seqs=num_prompts, max_num_batched_tokens=256,
                  kv_cache_dtype=kv_cache_dtype)
    eager = LLM(path, mode="gpu-only", enforce_eager=True, **common)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, sp)]
    llm = LLM(path, mode=mode, num_gpu_blocks=gpu_blocks, hot_buffer_size=128,
              host_pool_gib=0.5, **common)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    s = llm.stats()
    assert s["hot_misses"] > 0 and s["spilled_pages"] > 0
    assert got == want
    return llm


@pytest.mark.parametrize("mode", ["hisparse", "always-host"])
def test_lossless_on_gpu_bf16_moe_eager(moe_path, mode):
    llm = lossless_run(moe_path, mode, num_prompts=8, gpu_blocks=60, seed=0)
    assert llm.runner.graphs is not None  # the fused MoE has no host sync: captured
    from hisparse.models.dsa import DSADecoderLayer, DSAIndexer, DSARouter
    narrowed = [m.weight.dtype for m in llm.model.modules() if isinstance(m, DSARouter)]
    narrowed += [m.weights_proj.weight.dtype for m in llm.model.modules()
                 if isinstance(m, DSAIndexer)]
    assert narrowed and set(narrowed) == {torch.bfloat16}
    assert not any(m.attn_fp32 for m in llm.model.modules() if isinstance(m, DSADecoderLayer))


@pytest.mark.parametrize("mode", ["hisparse", "always-host"])
def test_cuda_graph_decode_is_lossless(dense_path, mode):
    llm = lossless_run(dense_path, mode, num_prompts=11, gpu_blocks=70, seed=1)
    assert llm.runner.graphs is not None and any(k[1] for k in llm.runner.graphs.graphs)


@pytest.mark.parametrize("mode", ["hisparse", "always-host"])
def test_fp8_kv_lossless_on_gpu(dense_path, moe_path, mode):
    """kv_cache_dtype="fp8" (656-B rows, 132-B keys): tiering on vs off, eager vs CUDA graphs,
    identical greedy tokens."""
    llm = lossless_run(dense_path, mode, num_prompts=11, gpu_blocks=70, seed=2,
                       kv_cache_dtype="fp8")
    assert llm.caches.arena.shape[-1] == 656
    assert llm.caches.indexer.shape[-1] == 132 * llm.kv_config.block_size    # FP8 key pages
    assert llm.runner.graphs is not None and any(k[1] for k in llm.runner.graphs.graphs)
    lossless_run(moe_path, mode, num_prompts=8, gpu_blocks=60, seed=3, kv_cache_dtype="fp8")


def test_gpu_held_requests_with_prefix_hits_lossless_on_gpu(dense_path):
    """FP8 KV, a host pool of about two requests, a cached system prompt: the requests past the
    pool run GPU-held from the cached pages (GPU copies shared, host-only ones restored by the
    CUDA copy), eager and CUDA graphs; greedy tokens equal an unconstrained eager run's."""
    rng = random.Random(7)
    system = [rng.randrange(2, 384) for _ in range(160)]                # 10 full pages
    prompts = [{"prompt_token_ids": system + [rng.randrange(2, 384)
                                              for _ in range(rng.randrange(20, 200))]}
               for _ in range(8)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    common = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=400,
                  max_num_seqs=8, max_num_batched_tokens=256, kv_cache_dtype="fp8")
    eager = LLM(dense_path, mode="gpu-only", enforce_eager=True, **common)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, sp)]
    # one max-length request (25 pages) and a little more: the system prompt and about two
    # requests' own pages (the CPU copy of this test ran 4 of the 8 GPU-held)
    host_gib = 464 * eager.caches.geo.bytes_per_token / (1 << 30)
    del eager
    llm = LLM(dense_path, mode="hisparse", num_gpu_blocks=160, hot_buffer_size=128,
              host_pool_gib=host_gib, **common)
    llm.generate([{"prompt_token_ids": system + [5]}], sp)             # publishes the prompt
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    s = llm.stats()
    assert s["gpu_held_admissions"] > 0 and s["prefix_hit_tokens"] == 8 * 160, s
    assert got == want
