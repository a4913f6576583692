"""Hot-buffer policies in the engine (issue 15): lossless under every policy with forced spills,
and the stats count prefetched, prefetch-hit and demand-miss rows."""

from __future__ import annotations

import random

import pytest

from hisparse import LLM, SamplingParams

pytest.importorskip("transformers")


def _prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(rng.randrange(lo, hi))]}
            for _ in range(n)]


def _run(path, batch, params, **kw):
    base = dict(device="cpu", dtype="float32", block_size=8, max_model_len=192, max_num_seqs=8)
    base.update(kw)
    llm = LLM(path, **base)
    return [o.outputs[0].token_ids for o in llm.generate(batch, params)], llm.stats()


@pytest.mark.parametrize("arch", ["dsv32_path", "glm_path"])
def test_lossless_under_every_hot_policy(arch, request):
    path = request.getfixturevalue(arch)
    batch = _prompts(8, 20, 120, seed=31)
    params = [SamplingParams(temperature=0.0, max_tokens=random.Random(i).randrange(4, 24),
                             ignore_eos=True) for i in range(len(batch))]
    want, _ = _run(path, batch, params, mode="gpu-only")
    for policy in ("lru", "score", "score+prefetch"):
        got, s = _run(path, batch, params, mode="hisparse", num_gpu_blocks=30,
                      hot_buffer_size=32, host_pool_gib=0.02, max_num_batched_tokens=64,
                      hot_policy=policy)
        assert got == want, policy
        assert s["spilled_pages"] > 0 and s["host_read_switches"] > 0
        assert s["hot_demand_misses"] > 0 and s["hot_misses"] == s["hot_demand_misses"]
        if policy == "score+prefetch":
            assert s["hot_prefetched"] > 0
            assert 0 <= s["hot_prefetch_hits"] <= s["hot_prefetched"]
        else:
            assert s["hot_prefetched"] == 0 and s["hot_prefetch_hits"] == 0


def test_hot_policy_is_validated(dsv32_path):
    with pytest.raises(ValueError, match="hot_policy"):
        LLM(dsv32_path, device="cpu", hot_policy="belady")
