"""The engine on CUDA (Triton indexer, resolver with zero-copy host reads, attention, copies):
a tiny GPU pool must give the same greedy tokens as an unconstrained run, in bf16."""

import random

import pytest
import torch

from hisparse import LLM, SamplingParams
from hisparse.models.random_checkpoint import PRODUCTION_GEOMETRY, make_random_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    geo = dict(PRODUCTION_GEOMETRY, index_topk=64)
    return make_random_checkpoint(tmp_path_factory.mktemp("gpu"), "deepseek_v32", seed=3,
                                  num_hidden_layers=2, hidden_size=256, num_attention_heads=16,
                                  num_key_value_heads=16, q_lora_rank=128, **geo)


@pytest.mark.parametrize("mode", [True, "always-host"])
def test_lossless_on_gpu_bf16(path, mode):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(rng.randrange(150, 400))]}
               for _ in range(8)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=512,
                  max_num_seqs=8, max_num_batched_tokens=256)
    want = [o.outputs[0].token_ids for o in LLM(path, hisparse=False, **common).generate(prompts, sp)]
    llm = LLM(path, hisparse=mode, num_gpu_blocks=60, hot_buffer_size=128, host_pool_gib=0.5,
              **common)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    s = llm.stats()
    assert s["hot_misses"] > 0 and s["spilled_pages"] > 0
    assert got == want


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    geo = dict(PRODUCTION_GEOMETRY, index_topk=64)
    return make_random_checkpoint(tmp_path_factory.mktemp("gpu_dense"), "deepseek_v32", seed=4,
                                  num_hidden_layers=3, hidden_size=256, num_attention_heads=16,
                                  num_key_value_heads=16, q_lora_rank=128,
                                  first_k_dense_replace=100, **geo)


@pytest.mark.parametrize("mode", [True, "always-host"])
def test_cuda_graph_decode_is_lossless(dense_path, mode):
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(rng.randrange(150, 400))]}
               for _ in range(11)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    common = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=512,
                  max_num_seqs=11, max_num_batched_tokens=256)
    eager = LLM(dense_path, hisparse=False, enforce_eager=True, **common)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, sp)]
    llm = LLM(dense_path, hisparse=mode, num_gpu_blocks=70, hot_buffer_size=128,
              host_pool_gib=0.5, **common)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    s = llm.stats()
    assert llm.runner.graphs is not None and any(k[1] for k in llm.runner.graphs.graphs)
    assert s["hot_misses"] > 0 and s["spilled_pages"] > 0
    assert got == want
