"""MTP speculative decoding on CUDA (Triton resolver, pinned host pool): greedy outputs with
k = 1..3 identical to k = 0 under forced spills, at injected acceptance. float32: a verify step
has other GEMM shapes than a one-token decode step, and in bf16 such rounding differences can
flip a near-tie argmax of random weights (that would not be a tiering or verification bug)."""

from __future__ import annotations

import random

import pytest
import torch

from hisparse import LLM, SamplingParams
from hisparse.models.random_checkpoint import make_random_checkpoint

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    pytest.importorskip("transformers")
    return make_random_checkpoint(tmp_path_factory.mktemp("mtp_gpu"), "deepseek_v32", seed=3,
                                  index_topk=64, num_hidden_layers=3,
                                  num_nextn_predict_layers=1)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_spec_lossless_on_gpu(mtp_path, k):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = random.Random(k)
    batch = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(rng.randrange(300, 500))]}
             for _ in range(8)]
    kw = dict(device="cuda", dtype="float32", block_size=16, max_model_len=640,
              max_num_seqs=8, num_gpu_blocks=120, hot_buffer_size=(k + 1) * 64,
              host_pool_gib=0.2, max_num_batched_tokens=512)
    ref = [o.outputs[0].token_ids for o in LLM(mtp_path, **kw).generate(batch, GREEDY)]
    refs = {tuple(p["prompt_token_ids"]): r for p, r in zip(batch, ref)}
    llm = LLM(mtp_path, num_speculative_tokens=k, **kw)
    pick = random.Random(0)

    def hook(reqs, outs, drafts):
        new = []
        for req, out, dr in zip(reqs, outs, drafts):
            r = refs[tuple(req.prompt_token_ids)]
            done = req.num_output_tokens + len(out)
            want = r[done:done + len(dr)]
            new.append([t if pick.random() < 0.7 else (t + 1) % 384 for t in want]
                       + dr[len(want):])
        return new

    llm.core.draft_hook = hook
    got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    assert got == ref
    s = llm.stats()
    assert s["hot_misses"] > 0 and s["spec_accepted_tokens"] > 0
