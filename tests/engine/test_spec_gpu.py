"""MTP speculative decoding on CUDA (Triton resolver, pinned host pool, CUDA graphs of the
verify and draft forwards): greedy outputs with k = 1..3 identical to k = 0 under forced
spills, at injected acceptance; graph steps checked against an eager runner step by step.
float32: a verify step has other GEMM shapes than a one-token decode step, and in bf16 such
rounding differences can flip a near-tie argmax of random weights (that would not be a tiering
or verification bug)."""

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


@pytest.fixture(scope="module")
def k0_outputs(mtp_path):
    """Eager k = 0 greedy outputs of :func:`graph_batch` (the reference of every graph run)."""
    batch = graph_batch()
    kw = graph_kw(2)
    with LLM(mtp_path, enforce_eager=True, **kw) as llm:
        return batch, [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]


def graph_batch():
    rng = random.Random(11)
    return [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(rng.randrange(300, 500))]}
            for _ in range(8)]


def graph_kw(k):
    return dict(device="cuda", dtype="float32", block_size=16, max_model_len=640,
                max_num_seqs=8, num_gpu_blocks=120, hot_buffer_size=(k + 1) * 64,
                host_pool_gib=0.2, max_num_batched_tokens=512, mode="hisparse")


def injected(refs, k):
    rng = random.Random(100 + k)

    def hook(reqs, outs, drafts):
        new = []
        for req, out, dr in zip(reqs, outs, drafts):
            r = refs[tuple(req.prompt_token_ids)]
            done = req.num_output_tokens + len(out)
            want = r[done:done + len(dr)]
            new.append([t if rng.random() < 0.7 else (t + 1) % 384 for t in want]
                       + dr[len(want):])
        return new

    return hook


@pytest.mark.parametrize("k", [1, 2])
def test_spec_cuda_graphs_lossless_and_replayed(mtp_path, k0_outputs, k):
    """Issue 14: ``LLM(num_speculative_tokens=k)`` on CUDA replays the verify (k + 1 tokens
    per request) and MTP draft graphs; under forced spills (hisparse mode, a small GPU pool)
    greedy outputs equal eager k = 0 and eager k, each graph step agrees with an eager runner
    over its own caches (logits, union sizes, draft logits, hot-buffer state), and the static
    buffers never move. k = 2 captures every bucket up front (ascending), k = 1 lazily."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_spec_graphs import compare_with_eager

    batch, ref = k0_outputs
    refs = {tuple(p["prompt_token_ids"]): r for p, r in zip(batch, ref)}
    eager = LLM(mtp_path, num_speculative_tokens=k, enforce_eager=True, **graph_kw(k))
    assert not eager.runner.spec_graphs.capture       # bucketed eager: same layout
    eager.core.draft_hook = injected(refs, k)
    assert [o.outputs[0].token_ids for o in eager.generate(batch, GREEDY)] == ref
    eager.shutdown()

    llm = LLM(mtp_path, num_speculative_tokens=k, **graph_kw(k))
    graphs = llm.runner.spec_graphs
    assert graphs is not None and llm.runner.graphs is None
    ptrs = graphs.data_ptrs() + llm.caches.workspace.data_ptrs()
    if k == 2:
        llm.capture_cuda_graphs()
        assert len(graphs.graphs) == 4 * 2 * 3 and not graphs.replays
        assert graphs.data_ptrs() + llm.caches.workspace.data_ptrs() == ptrs
    llm.core.draft_hook = injected(refs, k)
    seen = compare_with_eager(llm, atol=2e-3, rtol=2e-3)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    assert got == ref
    s = llm.stats()
    assert s["hot_misses"] > 0 and s["spilled_pages"] > 0 and s["spec_accepted_tokens"] > 0
    assert seen["graph_steps"] >= 5
    assert graphs.replays["verify"] == graphs.replays["draft"] == seen["graph_steps"]
    assert graphs.replays["chain"] == (k - 1) * seen["graph_steps"]
    assert any(key[2] for key in graphs.graphs)                         # host-read variant
    assert graphs.data_ptrs() + llm.caches.workspace.data_ptrs() == ptrs
    assert int(llm.caches.counters[2]) == 0
    llm.shutdown()
