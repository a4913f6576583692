"""Issue 14 item 1: prompts far larger than the GPU pool prefill through the staging area and
decode losslessly (identical greedy tokens vs an unconstrained engine)."""

from __future__ import annotations

import random

import pytest

from hisparse import LLM, SamplingParams


def _prompts(lens, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(n)]} for n in lens]


@pytest.mark.parametrize("mode,staging_rows", [("hisparse", None), ("always-host", None),
                                               ("hisparse", 32)])
def test_prompts_5x_the_gpu_pool_are_lossless(dsv32_path, mode, staging_rows):
    """Default staging (a whole history: one group per chunk and layer) and a staging area of
    two tokens' top-k (each chunk split into token groups whose unions fit)."""
    batch = _prompts((500, 430))                     # GPU pool: 12 blocks x 8 = 96 tokens
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = LLM(dsv32_path, mode="gpu-only", device="cpu", dtype="float32", block_size=8,
              max_model_len=640, max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in ref.generate(batch, sp)]
    llm = LLM(dsv32_path, mode=mode, device="cpu", dtype="float32", block_size=8,
              max_model_len=640, max_num_seqs=4, num_gpu_blocks=12, hot_buffer_size=32,
              host_pool_gib=0.05, max_num_batched_tokens=32, staging_rows=staging_rows)
    assert llm.kv_config.min_gpu_blocks <= 12 < 640 // 8
    assert [o.outputs[0].token_ids for o in llm.generate(batch, sp)] == want
    s = llm.stats()
    assert s["staged_rows"] > 0 and s["staged_bytes"] == s["staged_rows"] * llm.runner.row_bytes
    assert s["staged_chunks"] > 0 and s["spilled_pages"] > 0
    assert s["free_gpu_blocks"] == 12 and s["free_host_blocks"] == llm.kv_config.num_host_blocks


@pytest.mark.parametrize("k", [1, 2])
def test_staged_prefill_with_speculative_decoding_is_lossless(tmp_path_factory, k):
    """Speculative steps (verify forward, MTP layer, chained drafts) of staged chunks read the
    spilled history through the staging area too: greedy tokens equal k = 0 and gpu-only."""
    from hisparse.models.random_checkpoint import make_random_checkpoint

    path = make_random_checkpoint(tmp_path_factory.mktemp("dsv32_mtp_staged"), "deepseek_v32",
                                  seed=11, index_topk=16, num_hidden_layers=3,
                                  num_nextn_predict_layers=1)
    batch = _prompts((300, 260), seed=1)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = LLM(path, mode="gpu-only", device="cpu", dtype="float32", block_size=8,
              max_model_len=384, max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in ref.generate(batch, sp)]
    llm = LLM(path, mode="hisparse", device="cpu", dtype="float32", block_size=8,
              max_model_len=384, max_num_seqs=4, num_gpu_blocks=14,
              hot_buffer_size=(k + 1) * 16, host_pool_gib=0.05, max_num_batched_tokens=32,
              num_speculative_tokens=k)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, sp)] == want
    s = llm.stats()
    assert s["staged_rows"] > 0 and s["staged_chunks"] > 0 and s["spec_verify_steps"] > 0
