"""CUDA graphs of speculative (MTP) steps, host-side logic on CPU (issue 14: graphs for
T = k + 1 tokens per request): bucket choice, static buffers sized up front and never moved,
which plans the graphs serve, and, with every graph *emulated* (a replay re-runs the captured
body over the static buffers: :class:`~hisparse.worker.cuda_graph._Rerun`), a speculative run
whose every step is also executed by an eager runner over its own caches: verify logits, union
sizes, draft logits and hot-buffer state agree step by step, and the outputs equal k = 0.

:func:`compare_with_eager` is shared with the GPU test (``test_spec_gpu.py``), where the graphs
are real captures."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from workload import prompts, tokens

from hisparse import LLM, SamplingParams
from hisparse.kv.plan import ScheduledSeq
from hisparse.models.random_checkpoint import make_random_checkpoint
from hisparse.worker.cache import KVCaches
from hisparse.worker.cuda_graph import (
    BUCKETS,
    SpecGraphs,
    bucket_for,
    max_bucket,
    spec_graph_bytes,
)
from hisparse.worker.model_runner import ModelRunner, selection_union_sizes

TOPK = 16

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("dsv32_mtp_graphs"), "deepseek_v32",
                                  seed=11, index_topk=TOPK, num_hidden_layers=3,
                                  num_nextn_predict_layers=1)


def tiny_pool(path, k=0, **kw):
    base = dict(device="cpu", dtype="float32", block_size=8, max_model_len=192, max_num_seqs=6,
                num_gpu_blocks=30, hot_buffer_size=(max(k, 1) + 1) * TOPK, host_pool_gib=0.02,
                max_num_batched_tokens=64)
    base.update(kw)
    return LLM(path, mode="hisparse", num_speculative_tokens=k, **base)


def oracle_hook(refs: dict, accept: float, seed: int = 0, vocab: int = 384):
    """Drafts from the known greedy continuation, each right with probability ``accept``."""
    rng = random.Random(seed)

    def hook(reqs, outs, drafts):
        new = []
        for req, out, dr in zip(reqs, outs, drafts):
            ref = refs[tuple(req.prompt_token_ids)]
            done = req.num_output_tokens + len(out)
            want = ref[done:done + len(dr)]
            new.append([t if rng.random() < accept else (t + 1) % vocab for t in want]
                       + dr[len(want):])
        return new

    return hook


def compare_with_eager(llm, atol: float = 1e-4, rtol: float = 1e-4) -> dict:
    """Make every speculative step of ``llm`` also run on an eager runner over its own caches
    (same model, same plans), checking after each half: verify logits (close, same argmax),
    union sizes, draft logits (close, same argmax; the eager chain follows the drafts the
    checked runner drew), hot-buffer keys, LRU order and counters (equal). Returns counters:
    ``steps`` compared, ``graph_steps`` of them served by the graphs."""
    runner, core = llm.runner, llm.core
    mc, k = llm.model_config, core.num_speculative_tokens
    caches = KVCaches(llm.kv_config, llm.caches.geo, llm.device)
    c = llm.caches
    caches.set_hot_policy("score+prefetch" if c.hot_prefetch else c.hot_policy)
    eager = ModelRunner(llm.model, caches, mc.index_topk, mc.kv_lora_rank, enforce_eager=True,
                        num_speculative_tokens=k)
    assert eager.spec_graphs is None or not eager.spec_graphs.capture
    seen = {"steps": 0, "graph_steps": 0}
    real_forward, real_draft = runner.spec_forward, runner.spec_draft

    def same_hot_state():
        for name in ("hot_keys", "hot_lru", "hot_flags", "counters"):
            assert torch.equal(getattr(llm.caches, name), getattr(caches, name)), name

    def close(got, want):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        assert torch.equal(got.argmax(-1), want.argmax(-1))

    def spec_forward(plan, input_ids, num_logits):
        want, want_unions = eager.spec_forward(plan, input_ids, num_logits)
        want = want.clone()
        got, unions = real_forward(plan, input_ids, num_logits)
        close(got, want)
        assert unions == want_unions
        same_hot_state()
        seen["steps"] += 1
        seen["graph_steps"] += runner._spec[-1] is not None
        return got, unions

    def spec_draft(next_ids, draft_rows, num_drafts, sample_draft):
        drawn = []

        def record(logits, j):
            toks = sample_draft(logits, j)
            drawn.append((logits.clone(), toks.clone()))
            return toks

        acks = real_draft(next_ids, draft_rows, num_drafts, record)

        def replay(logits, j):
            close(drawn[j][0], logits)
            return drawn[j][1]

        eager.spec_draft(next_ids, draft_rows, num_drafts, replay)
        assert len(drawn) == (num_drafts if draft_rows else 0)
        same_hot_state()
        eager.drain()
        return acks

    runner.spec_forward, runner.spec_draft = spec_forward, spec_draft
    return seen


# ---------------------------------------------------------------------- host-side logic
def test_bucket_choice():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 33, 49, 500, 512)] == \
        [1, 2, 4, 8, 8, 16, 40, 56, 512, 512]
    for bad in (0, BUCKETS[-1] + 1):
        with pytest.raises(ValueError, match="no batch bucket"):
            bucket_for(bad)
    assert [max_bucket(n) for n in (1, 3, 8, 100, 129, 512, 4096)] == \
        [1, 4, 8, 112, 192, 512, 512]


def test_union_sizes_count_distinct_selections():
    topk = torch.tensor([[3, 5, -1], [5, 7, 3], [9, -1, -1], [-1, -1, -1], [1, 2, 3]],
                        dtype=torch.int32)
    assert selection_union_sizes(topk, [(0, 2), (2, 4), (4, 5), (0, 5)]) == [3, 1, 3, 6]
    assert selection_union_sizes(topk, []) == []


def test_cpu_keeps_eager_and_step_state_fits_the_largest_spec_bucket(mtp_path):
    llm = tiny_pool(mtp_path, 2, enforce_eager=False)
    runner = llm.runner
    assert runner.graphs is None and runner.spec_graphs is None      # CPU: unchanged
    assert runner.inputs.max_tokens >= max_bucket(6) * 3
    graphs = SpecGraphs(runner, 2, capture=False)
    assert graphs.max_batch == 8 and graphs.logits.shape[0] == 24
    assert graphs.kinds == ("verify", "draft", "chain")
    assert SpecGraphs(runner, 1, capture=False).kinds == ("verify", "draft")
    with pytest.raises(ValueError, match="the largest bucket needs 8 x 9 = 72"):
        SpecGraphs(runner, 8, capture=False)
    # the engine sizes its KV pools from free memory minus this estimate: it must cover at
    # least every static buffer the graphs allocate
    static = sum(t.numel() * t.element_size() for t in vars(graphs).values()
                 if isinstance(t, torch.Tensor))
    mc = llm.model_config
    assert spec_graph_bytes(6, 2, mc.vocab_size, mc.hidden_size) >= static

    def seq(n, **kw):
        args = dict(req_id="r", slot=0, start_pos=40, num_tokens=n, host_read=False,
                    sample=True)
        args.update(kw)
        return ScheduledSeq(**args)

    plan = SimpleNamespace
    assert graphs.supports(plan(seqs=[seq(3), seq(1), seq(2, host_read=True)]))
    assert not graphs.supports(plan(seqs=[]))
    assert not graphs.supports(plan(seqs=[seq(4)]))                  # more than k + 1
    assert not graphs.supports(plan(seqs=[seq(3, prefill=True)]))
    assert not graphs.supports(plan(seqs=[seq(3, sample=False)]))
    assert not graphs.supports(plan(seqs=[seq(1, staged=True)]))
    assert not graphs.supports(plan(seqs=[seq(1)] * 9))              # past the largest bucket


@pytest.mark.parametrize("capture_first", [True, False])
def test_emulated_spec_graphs_match_eager_step_by_step(mtp_path, capture_first):
    """k = 2 under forced spills with injected acceptance (verify groups of 1..3 tokens):
    every decode step replays the verify, draft and chain graphs (captured up front in
    ascending order, or lazily in the middle of steps), each agreeing with an eager runner;
    static buffers never move; outputs equal k = 0."""
    batch = prompts(6, 90, 150, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (20, 5, 12, 24, 9, 16)]                        # the batch shrinks
    ref = tokens(tiny_pool(mtp_path, 0, hot_buffer_size=48).generate(batch, params))
    refs = {tuple(p["prompt_token_ids"]): r for p, r in zip(batch, ref)}
    llm = tiny_pool(mtp_path, 2)
    graphs = llm.runner.spec_graphs = SpecGraphs(llm.runner, 2, capture=False)
    ptrs = graphs.data_ptrs() + llm.caches.workspace.data_ptrs()
    if capture_first:
        graphs.capture_all()
        assert len(graphs.graphs) == 4 * 2 * 3 and not graphs.replays
    llm.core.draft_hook = oracle_hook(refs, 0.7, seed=capture_first)
    seen = compare_with_eager(llm)
    replayed = []
    real = graphs._replay

    def replay(kind, batch_, host_read):
        replayed.append((kind, batch_, host_read))
        real(kind, batch_, host_read)

    graphs._replay = replay
    assert tokens(llm.generate(batch, params)) == ref
    s = llm.stats()
    assert s["spilled_pages"] > 0 and s["hot_misses"] > 0 and s["spec_accepted_tokens"] > 0
    assert seen["graph_steps"] >= 8 and seen["steps"] > seen["graph_steps"]   # prefill: eager
    assert graphs.replays["verify"] == graphs.replays["draft"] == seen["graph_steps"]
    assert graphs.replays["chain"] == seen["graph_steps"]                   # k - 1 = 1 per step
    buckets = [b for kind, b, _ in replayed if kind == "verify"]
    # a smaller bucket replays after a larger one was captured (DESIGN section 7's trigger)
    assert len(set(buckets)) >= 2 and buckets[-1] < max(buckets)
    assert any(h for _, _, h in replayed)
    assert graphs.data_ptrs() + llm.caches.workspace.data_ptrs() == ptrs
    assert int(llm.caches.counters[2]) == 0
