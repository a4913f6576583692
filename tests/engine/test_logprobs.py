"""SamplingParams.logprobs: per output token, the sampled token's log-probability and the top-n,
from the model's raw distribution; checked against transformers' logits (the oracle) and under
forced spills."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hisparse import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

KW = dict(device="cpu", dtype="float32", block_size=8, max_model_len=256, max_num_seqs=4)


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(rng.randrange(20, 60))] for _ in range(n)]


def test_first_token_logprobs_equal_the_oracle(dsv32_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(dsv32_path,
                                                           dtype=torch.float32).eval()
    prompts = _prompts(3, 1)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=5)
    outs = LLM(dsv32_path, **KW).generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, o in zip(prompts, outs):
        comp = o.outputs[0]
        assert len(comp.logprobs) == len(comp.token_ids) == 3
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), -1)
        first = comp.logprobs[0]
        top = torch.topk(want, 5)
        assert list(first)[0] == comp.token_ids[0] == int(top.indices[0])   # greedy: the argmax
        assert set(first) == set(top.indices.tolist())
        for tok, lp in first.items():
            assert math.isclose(lp, float(want[tok]), abs_tol=2e-4), (tok, lp, float(want[tok]))


def test_sampled_token_is_first_and_logprobs_are_consistent_under_spills(dsv32_path):
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, 2)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True,
                             logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, top_k=5, max_tokens=12, ignore_eos=True,
                             logprobs=3)]
    ref = LLM(dsv32_path, **KW).generate(prompts, params)
    tiny = LLM(dsv32_path, **KW, num_gpu_blocks=12, hot_buffer_size=32, host_pool_gib=0.05,
               max_num_batched_tokens=32)
    got = tiny.generate(prompts, params)
    assert tiny.stats()["spilled_pages"] > 0
    for p, r, g in zip(params, ref, got):
        rc, gc_ = r.outputs[0], g.outputs[0]
        assert gc_.token_ids == rc.token_ids
        if p.logprobs is None:
            assert gc_.logprobs is None
            continue
        assert len(gc_.logprobs) == len(gc_.token_ids)
        for tok, entry, ref_entry in zip(gc_.token_ids, gc_.logprobs, rc.logprobs):
            assert list(entry)[0] == tok
            assert all(v <= 0 for v in entry.values())
            assert len(entry) in (p.logprobs, p.logprobs + 1)     # +1: sampled, not in top-n
            rest = list(entry.values())[1:]                        # the top-n after it
            assert rest == sorted(rest, reverse=True)
            assert entry.keys() == ref_entry.keys()
            assert all(math.isclose(entry[k], ref_entry[k], abs_tol=1e-4) for k in entry)
        if p.greedy and p.logprobs:
            assert all(e[t] == max(e.values()) for t, e in zip(gc_.token_ids, gc_.logprobs))


def test_logprobs_are_validated(dsv32_path):
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
