"""MTP speculative decoding (issue 14 item 2): MTP loading, greedy outputs identical to
non-speculative decoding under forced spills, exact rejection sampling, KV rollback and prefix
publication, stats."""

from __future__ import annotations

import random

import pytest
import torch
from workload import prompts, tokens

from hisparse import LLM, SamplingParams
from hisparse.engine import spec
from hisparse.models.loader import load_model
from hisparse.models.random_checkpoint import make_random_checkpoint

TOPK = 16   # the engine fixtures' index_topk (tests/engine/conftest.py)

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("dsv32_mtp"), "deepseek_v32", seed=11,
                                  index_topk=TOPK, num_hidden_layers=3,
                                  num_nextn_predict_layers=1)


def tiny_pool(path, k=0, mode="hisparse", **kw):
    base = dict(device="cpu", dtype="float32", block_size=8, max_model_len=192, max_num_seqs=8,
                num_gpu_blocks=30, hot_buffer_size=(max(k, 1) + 1) * TOPK, host_pool_gib=0.02,
                max_num_batched_tokens=64)
    base.update(kw)
    return LLM(path, mode=mode, num_speculative_tokens=k, **base)


def oracle_hook(refs: dict, accept: float, seed: int = 0):
    """Drafts from the known greedy continuation, each right with probability ``accept``
    (wrong: the next vocabulary id): an injected acceptance rate."""
    rng = random.Random(seed)

    def hook(reqs, outs, drafts):
        new = []
        for req, out, dr in zip(reqs, outs, drafts):
            ref = refs[tuple(req.prompt_token_ids)]
            done = req.num_output_tokens + len(out)
            want = ref[done:done + len(dr)]
            new.append([t if rng.random() < accept else (t + 1) % 384 for t in want]
                       + dr[len(want):])
        return new

    return hook


def assert_pools_full(llm):
    s = llm.stats()
    cfg = llm.kv_config
    assert s["free_gpu_blocks"] == cfg.num_gpu_blocks
    assert s["free_host_blocks"] == cfg.num_host_blocks
    assert s["free_indexer_blocks"] == cfg.num_indexer_blocks


def test_mtp_layers_load_with_deepseek_names(mtp_path):
    from safetensors import safe_open
    model, cfg = load_model(mtp_path, torch.float32, num_mtp_layers=1)
    assert cfg.num_nextn_predict_layers == 1 and len(model.mtp) == 1
    L = cfg.num_layers
    with safe_open(f"{mtp_path}/model.safetensors", "pt") as f:
        for ckpt, ours in [(f"model.layers.{L}.eh_proj.weight", model.mtp[0].eh_proj.weight),
                           (f"model.layers.{L}.enorm.weight", model.mtp[0].enorm.weight),
                           (f"model.layers.{L}.shared_head.norm.weight",
                            model.mtp[0].shared_head_norm.weight),
                           (f"model.layers.{L}.self_attn.indexer.wk.weight",
                            model.mtp[0].layer.self_attn.indexer.wk.weight)]:
            assert torch.equal(f.get_tensor(ckpt), ours)
    assert model.mtp[0].layer.self_attn.layer_idx == L     # its own KV cache layer
    plain, _ = load_model(mtp_path, torch.float32)          # default: MTP skipped
    assert len(plain.mtp) == 0


def test_spec_argument_checks(dsv32_path, mtp_path):
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        tiny_pool(dsv32_path, k=1)
    with pytest.raises(ValueError, match=r"hot_buffer_size \(32\) must be >= .* = 48"):
        tiny_pool(mtp_path, k=2, hot_buffer_size=32)
    with pytest.raises(ValueError, match="num_speculative_tokens must be"):
        tiny_pool(mtp_path, k=-1)
    with pytest.raises(ValueError, match="block_size"):
        tiny_pool(mtp_path, k=4, block_size=4, hot_buffer_size=96)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_spec_identical_to_k0_under_spills(mtp_path, k):
    batch = prompts(6, 90, 150, seed=3)
    ref = tokens(tiny_pool(mtp_path, 0, hot_buffer_size=(k + 1) * TOPK).generate(batch, GREEDY))
    refs = {tuple(p["prompt_token_ids"]): r for p, r in zip(batch, ref)}
    # raw MTP drafts (random weights: almost never accepted) and injected acceptance
    for hook in (None, oracle_hook(refs, 0.7, seed=k)):
        llm = tiny_pool(mtp_path, k)
        llm.core.draft_hook = hook
        assert tokens(llm.generate(batch, GREEDY)) == ref
        s = llm.stats()
        assert s["spilled_pages"] > 0 and s["host_read_switches"] > 0 and s["hot_misses"] > 0
        assert s["spec_verify_steps"] > 0 and s["spec_draft_tokens"] > 0
        assert 0 < s["spec_union_size_mean"] <= s["spec_union_size_max"] <= (k + 1) * TOPK
        if hook is not None:
            assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
            assert s["spec_mean_accepted_length"] > 1.2
        llm.core.release()
        assert_pools_full(llm)


def test_greedy_spec_with_fp8_kv_identical_to_k0_under_spills(mtp_path):
    """FP8 KV (the CUDA default for DSA models) with MTP: the MTP layer's rows and keys go
    through the same FP8 formats; greedy output equals k = 0 with the same KV format."""
    batch = prompts(4, 90, 150, seed=7)
    ref = tokens(tiny_pool(mtp_path, 0, hot_buffer_size=3 * TOPK, kv_cache_dtype="fp8")
                 .generate(batch, GREEDY))
    refs = {tuple(p["prompt_token_ids"]): r for p, r in zip(batch, ref)}
    llm = tiny_pool(mtp_path, 2, kv_cache_dtype="fp8")
    llm.core.draft_hook = oracle_hook(refs, 0.7, seed=2)
    assert tokens(llm.generate(batch, GREEDY)) == ref
    s = llm.stats()
    assert s["kv_cache_dtype"] == "fp8" and s["spilled_pages"] > 0 and s["hot_misses"] > 0
    assert s["spec_accepted_tokens"] > 0


def test_greedy_spec_always_host_and_full_acceptance(mtp_path):
    batch = prompts(4, 60, 120, seed=5)
    ref = tokens(tiny_pool(mtp_path, 0, mode="always-host", hot_buffer_size=48)
                 .generate(batch, GREEDY))
    refs = {tuple(p["prompt_token_ids"]): r for p, r in zip(batch, ref)}
    llm = tiny_pool(mtp_path, 2, mode="always-host")
    llm.core.draft_hook = oracle_hook(refs, 1.0)
    assert tokens(llm.generate(batch, GREEDY)) == ref
    s = llm.stats()
    assert s["spec_acceptance_rate"] == 1.0 and s["spec_mean_accepted_length"] == 3.0
    assert s["hot_misses"] > 0


def test_rejected_rows_never_published_as_prefix(mtp_path):
    """Continuations of spec outputs hit the prefix cache on pages written by verify steps
    (with rejected drafts rolled back): outputs equal an unconstrained non-speculative run."""
    batch = prompts(4, 40, 60, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = tokens(tiny_pool(mtp_path, 0, num_gpu_blocks=200).generate(batch, params))
    refs = {tuple(p["prompt_token_ids"]): r for p, r in zip(batch, ref)}
    llm = tiny_pool(mtp_path, 2, num_gpu_blocks=200)
    llm.core.draft_hook = oracle_hook(refs, 0.5, seed=1)
    assert tokens(llm.generate(batch, params)) == ref
    second = [{"prompt_token_ids": p["prompt_token_ids"] + r[:36]} for p, r in zip(batch, ref)]
    before = llm.stats()["prefix_hit_tokens"]
    llm.core.draft_hook = None               # raw MTP drafts (rejected: rollbacks)
    got = tokens(llm.generate(second, GREEDY))
    assert llm.stats()["prefix_hit_tokens"] - before >= 4 * 64
    want = tokens(LLM(mtp_path, mode="gpu-only", device="cpu", dtype="float32", block_size=8,
                      max_model_len=192, max_num_seqs=8).generate(second, GREEDY))
    assert got == want


def test_rollback_clamps_pending_writes():
    from hisparse.config import KVCacheConfig
    from hisparse.kv.coordinator import KVCoordinator
    cfg = KVCacheConfig(block_size=4, num_gpu_blocks=16, num_host_blocks=16,
                        num_indexer_blocks=16, max_model_len=32, index_topk=4,
                        max_num_seqs=2, max_num_batched_tokens=32)
    kv = KVCoordinator(cfg)
    ids = list(range(2, 9))                  # 7 prompt tokens
    h = kv.admit("a", ids, 32)
    assert kv.allocate_slots(h, 7)
    kv.build_plan(1)
    kv.apply_acks([1])
    ids.append(9)                            # the sampled token; 2 drafts
    h.num_pending_tokens = 0
    h.num_draft_tokens = 2
    assert kv.allocate_slots(h, 3)           # positions 7..9
    kv.build_plan(2)
    h.num_draft_tokens = 0
    ids.append(10)                           # first draft accepted, second rejected
    kv.rollback(h, 9)
    kv.apply_acks([2])
    # the mirror of positions 7..9 is acknowledged, but position 9 held a rejected draft
    assert h.num_computed == 9 and h.num_durable == 9 and h.num_published == 2
    with pytest.raises(ValueError, match="roll back"):
        kv.rollback(h, 10)


# ---------------------------------------------------------------------- exactness of sampling
def _chi2_ok(counts, probs, n, slack=35.0):
    """Pearson chi-square against ``probs`` (few cells: the 0.999 quantile with 7 degrees of
    freedom is ~24; ``slack`` keeps a flake below 1e-5)."""
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)
    assert all(c == 0 for c, p in zip(counts, probs) if p == 0)
    return stat < slack


def test_rejection_sampling_keeps_the_target_distribution():
    torch.manual_seed(0)
    V = 6
    p = torch.softmax(torch.randn(3, V) * 1.5, dim=-1)
    p[0, 5] = 0.0
    p[0] /= p[0].sum()
    q = torch.softmax(torch.randn(2, V) * 1.5, dim=-1)
    params = SamplingParams(temperature=1.0)
    n = 20000
    first = [0] * V
    second = [0] * V
    n_second = 0
    lengths = 0
    d = torch.multinomial(q, n, replacement=True)          # [2, n] drafts from q
    for i in range(n):
        drafts = [int(d[0, i]), int(d[1, i])]
        # the target at position 1 is conditional on the first token: use p[1] only when the
        # first draft was kept (the test's p rows play the conditionals)
        out = spec.verify(p, q, drafts, params, out_index=i)
        lengths += len(out)
        first[out[0]] += 1
        if len(out) > 1:
            assert out[0] == drafts[0]
            second[out[1]] += 1
            n_second += 1
    assert _chi2_ok(first, p[0].tolist(), n)
    assert _chi2_ok(second, p[1].tolist(), n_second)
    assert 1.0 < lengths / n < 3.0


def test_greedy_verify_accepts_the_argmax_prefix():
    p = torch.eye(5)[[2, 4, 1, 3]]
    params = SamplingParams(temperature=0.0)
    assert spec.verify(p, None, [2, 4, 1], params, 0) == [2, 4, 1, 3]
    assert spec.verify(p, None, [2, 0, 1], params, 0) == [2, 4]
    assert spec.verify(p, None, [3, 4, 1], params, 0) == [2]
    assert spec.verify(p[:1], None, [], params, 0) == [2]
    assert spec.verify(p * float("nan"), None, [2], params, 0) == [-1]


def test_seeded_sampling_distribution_matches_non_speculative(tmp_path_factory):
    """Tiny vocabulary: many seeded requests, k = 2 vs k = 0; each output position's token
    histogram agrees (two-sample chi-square), and a seed reproduces its tokens in any batch."""
    path = make_random_checkpoint(tmp_path_factory.mktemp("tinyvocab"), "deepseek_v32",
                                  seed=5, index_topk=TOPK, num_hidden_layers=2, vocab_size=8,
                                  num_nextn_predict_layers=1, init_std=0.5)
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 7, 2, 3]}
    n = 400

    def run(k, seeds):
        llm = LLM(path, device="cpu", dtype="float32", block_size=8, max_model_len=64,
                  max_num_seqs=64, max_num_batched_tokens=1024, mode="gpu-only",
                  num_speculative_tokens=k)
        outs = llm.generate([prompt] * len(seeds), [
            SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True)
            for s in seeds])
        return tokens(outs), llm.stats()

    spec_out, s = run(2, range(n))
    plain, _ = run(0, range(10_000, 10_000 + n))
    assert s["spec_draft_tokens"] > 0 and s["spec_accepted_tokens"] > 0
    for pos in range(3):
        a = [0] * 8
        b = [0] * 8
        for o in spec_out:
            a[o[pos]] += 1
        for o in plain:
            b[o[pos]] += 1
        stat = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b) if x + y)
        assert stat < 35.0, (pos, a, b)          # 7 dof: p(stat > 35) ~ 1e-5
    again, _ = run(2, [3, 7, 11])
    assert again == [spec_out[3], spec_out[7], spec_out[11]]


def test_mixed_greedy_and_sampled_batch_under_spills(mtp_path):
    """Greedy and seeded-sampled requests share verify steps (raw MTP drafts with their draft
    distributions): greedy outputs stay identical to k = 0, sampled ones are reproducible, and
    every pool returns to full."""
    batch = prompts(6, 90, 150, seed=9)
    sampled = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=16, seed=7,
                             ignore_eos=True)
    params = [GREEDY if i % 2 == 0 else sampled for i in range(len(batch))]
    ref = tokens(tiny_pool(mtp_path, 0, hot_buffer_size=48).generate(batch, params))
    runs = []
    for _ in range(2):
        llm = tiny_pool(mtp_path, 2)
        runs.append(tokens(llm.generate(batch, params)))
        s = llm.stats()
        assert s["hot_misses"] > 0 and s["spec_draft_tokens"] > 0
        llm.core.release()
        assert_pools_full(llm)
    assert runs[0] == runs[1]
    assert all(len(t) == 16 for t in runs[0])
    assert [t for i, t in enumerate(runs[0]) if i % 2 == 0] == \
        [t for i, t in enumerate(ref) if i % 2 == 0]


def test_tight_token_budget_drops_drafts_instead_of_splitting(mtp_path, monkeypatch):
    """A verify step is never split by the token budget: a request whose k + 1 tokens do not fit
    decodes one token (drafts dropped); outputs stay identical to k = 0."""
    import hisparse.engine.scheduler as sched_mod
    batch = prompts(4, 12, 20, seed=12)
    kw = dict(num_gpu_blocks=200, max_num_batched_tokens=6)
    ref = tokens(tiny_pool(mtp_path, 0, hot_buffer_size=64, **kw).generate(batch, GREEDY))
    refs = {tuple(p["prompt_token_ids"]): r for p, r in zip(batch, ref)}
    dropped = []
    real = sched_mod.drop_drafts

    def counting(req):
        dropped.append(len(req.spec_draft))
        real(req)

    monkeypatch.setattr(sched_mod, "drop_drafts", counting)
    llm = tiny_pool(mtp_path, 3, **kw)
    llm.core.draft_hook = oracle_hook(refs, 0.8, seed=4)
    assert tokens(llm.generate(batch, GREEDY)) == ref
    assert llm.stats()["spec_accepted_tokens"] > 0
    assert any(n > 0 for n in dropped)


class _LayerShift:
    """A dense reference context seen by a layer whose index is ``offset`` higher."""

    def __init__(self, ctx, offset):
        self.ctx, self.offset = ctx, offset

    def attend(self, layer_idx, *args):
        return self.ctx.attend(layer_idx - self.offset, *args)


@pytest.mark.parametrize("mode,blocks", [("gpu-only", 200), ("hisparse", 30)])
def test_mtp_drafts_match_a_dense_reference(mtp_path, mode, blocks):
    """Every first draft equals the argmax of the MTP layer run densely over the final
    sequence (main model hidden at q + token q + 1): the MTP layer's own KV (written by verify
    steps, rolled back, mirrored, read through hot buffers under spills) is right."""
    from hisparse.models.context import DenseReferenceContext
    batch = prompts(3, 30, 60, seed=14) if mode == "gpu-only" else prompts(5, 90, 150, seed=14)
    seen = []

    def hook(reqs, outs, drafts):
        for req, out, dr in zip(reqs, outs, drafts):
            seen.append((tuple(req.prompt_token_ids), len(req.token_ids) + len(out), dr[0]))
        return drafts

    llm = tiny_pool(mtp_path, 1, mode=mode, num_gpu_blocks=blocks)
    llm.core.draft_hook = hook
    outs = llm.generate(batch, GREEDY)
    if mode == "hisparse":
        assert llm.stats()["hot_misses"] > 0
    model, cfg = llm.model, llm.model_config
    L = cfg.num_layers
    checked = 0
    for o in outs:
        seq = o.prompt_token_ids + o.outputs[0].token_ids
        ids = torch.tensor(seq)
        with torch.no_grad():
            ctx = DenseReferenceContext.from_config(cfg)
            h = model(ids, ctx.begin(["s"], [len(seq)]), ctx)
            mctx = DenseReferenceContext(1, cfg.index_topk, cfg.kv_lora_rank, [True])
            pos = mctx.begin(["s"], [len(seq) - 1])
            hm = model.mtp_forward(ids[1:], h[:-1], pos, _LayerShift(mctx, L))
            want = model.mtp_logits(hm).argmax(dim=-1).tolist()    # [q] predicts seq[q + 2]
        for prompt, n, d in seen:
            if prompt == tuple(o.prompt_token_ids) and n <= len(seq):
                assert d == want[n - 2], (n, d, want[n - 2])
                checked += 1
    assert checked >= 3 * 10
