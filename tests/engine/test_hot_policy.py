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


# ------------------------------------------------------------- prefetch off the critical path
class _Setup:
    """A :class:`PagedContext` over small caches (every request in host-read mode, nothing
    resident) and the same state run through the fused reference resolver."""

    def __init__(self, device="cpu", R=3, L=2, topk=8, H=24, PF=4, seed=0):
        import torch

        from hisparse.config import KVCacheConfig
        from hisparse.worker.cache import CacheGeometry, KVCaches
        from hisparse.worker.model_runner import PagedContext

        self.torch = torch
        bs, P = 8, 12
        self.R, self.L, self.K, self.H, self.PF, self.P, self.bs = R, L, topk, H, PF, P, bs
        cfg = KVCacheConfig(block_size=bs, num_gpu_blocks=R * (H // bs) + 20,
                            num_host_blocks=R * P + 4, num_indexer_blocks=R * P,
                            max_model_len=P * bs, index_topk=topk, hot_buffer_size=H,
                            max_num_seqs=R, max_num_batched_tokens=16, hot_prefetch_rows=PF)
        geo = CacheGeometry(num_layers=L, row_dim=72, indexer_layers=(0,), index_head_dim=16,
                            dtype=torch.float32 if device == "cpu" else torch.bfloat16)
        dev = torch.device(device)
        self.c = c = KVCaches(cfg, geo, dev)
        c.set_hot_policy("score+prefetch")
        assert c.hot_prefetch == PF and c.hot_band == topk
        g = torch.Generator().manual_seed(seed)
        c.host.copy_(torch.randn(c.host.shape, generator=g).to(c.host.dtype))
        c.arena.zero_()
        HB = H // bs
        self.tables = {
            "resident": torch.full((R, P), -1, dtype=torch.int32, device=dev),
            "host": torch.randperm(R * P + 4, generator=g)[:R * P].view(R, P).to(
                torch.int32).to(dev),
            "hot": (torch.randperm(R * HB, generator=g).view(R, HB) + 3).to(torch.int32).to(dev),
            "indexer": torch.full((R, P), -1, dtype=torch.int32, device=dev),
        }
        self.ctx = PagedContext(c, topk, 8)
        # the reference's own copy of the mutable state
        self.ref = dict(keys=c.hot_keys.clone(), lru=c.hot_lru.clone(), flags=c.hot_flags.clone(),
                        arena=c.arena.clone(), counters=c.counters.clone())
        self.gen = g

    def step(self, slots, topk, band):
        """One forward's resolver calls (every layer) through the context (prefetch on the side
        stream / inline) and through the fused reference; returns the context's rows."""
        from hisparse.ops import resolve_rows_reference

        torch, c, ctx = self.torch, self.c, self.ctx
        dev = c.device
        slots = slots.to(dev)
        pos = torch.zeros(slots.shape[0], dtype=torch.long, device=dev)
        ctx.begin(True, self.tables, slots, pos)
        ctx.topk, ctx.band = topk.to(dev), band.to(dev)
        got = [ctx._rows(layer) for layer in range(self.L)]
        ctx.finish()
        ref = self.ref
        want = []
        for layer in range(self.L):
            want.append(resolve_rows_reference(
                topk.to(dev), slots, self.tables["resident"], self.tables["host"],
                self.tables["hot"], ref["keys"][layer], ref["lru"][layer], ref["arena"][layer],
                c.host[layer], self.bs, ref["counters"], band=band.to(dev), policy="score",
                prefetch=self.PF, hot_flags=ref["flags"][layer]))
        return got, want

    def assert_same(self, got, want):
        torch, c, ref = self.torch, self.c, self.ref
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b.cpu())
        assert torch.equal(c.hot_keys, ref["keys"]) and torch.equal(c.hot_lru, ref["lru"])
        assert torch.equal(c.hot_flags, ref["flags"])
        assert torch.equal(c.counters, ref["counters"])
        assert torch.equal(c.arena, ref["arena"])
        assert (c.workspace.prefetch_plans == -1).all()      # consumed by the copies

    def ranked(self, T, hi, NB, first=None):
        """Per token ``K`` selected + ``NB`` next-ranked positions, unique within the token;
        ``first [T, n]``: positions put at the top of the selection."""
        torch = self.torch
        rows = []
        for t in range(T):
            head = [] if first is None else first[t].tolist()
            rest = [p for p in torch.randperm(hi, generator=self.gen).tolist() if p not in head]
            rows.append(head + rest[:self.K + NB - len(head)])
        sel = torch.tensor(rows, dtype=torch.int32)
        return sel[:, :self.K].contiguous(), sel[:, self.K:].contiguous()


def test_side_stream_prefetch_equals_fused_reference_and_hits_next_step():
    """The worker's split (resolver plans, prefetch copied after it, inline on CPU) gives the
    fused reference's rows, hot state, counters and arena bytes at every step; rows prefetched
    at step t, selected at t + 1, are served as hits holding their host rows."""
    import torch

    s = _Setup()
    c = s.c
    hi = s.P * s.bs
    slots = torch.tensor([0, 2, 1], dtype=torch.int32)
    prev_band = None
    promoted_hits = 0
    for step in range(8):
        promote = prev_band is not None and step % 2 == 1
        # odd steps select the previous step's best band rows (what prefetch bets on)
        topk, band = s.ranked(3, hi, s.K, first=prev_band[:, :s.PF] if promote else None)
        keys_before, flags_before = c.hot_keys.clone(), c.hot_flags.clone()
        before = c.counters.clone()
        got, want = s.step(slots, topk, band)
        s.assert_same(got, want)
        d = (c.counters - before).tolist()
        # prefetch hits = selected rows that were hot with the prefetched mark
        exp = 0
        for layer in range(s.L):
            for i, r in enumerate(slots.tolist()):
                keys = keys_before[layer, r].tolist()
                for p in topk[i].tolist():
                    if p in keys and int(flags_before[layer, r, keys.index(p)]) & 1:
                        exp += 1
                        promoted_hits += int(promote and p in prev_band[i, :s.PF].tolist())
        assert d[4] == exp
        for layer in range(s.L):            # every served row holds its host row
            rows = got[layer].flatten().long()
            assert (rows >= 0).all()
            tok = torch.arange(3).repeat_interleave(s.K)
            pos = topk.flatten().long()
            hrow = s.tables["host"][slots[tok].long(), pos // s.bs].long() * s.bs + pos % s.bs
            assert torch.equal(c.arena[layer][rows], c.host[layer][hrow])
        prev_band = band
    assert int(c.counters[3]) > 0 and promoted_hits > 0


def test_prefetch_rows_option_bounds_prefetch(dsv32_path):
    batch = _prompts(6, 20, 120, seed=32)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(mode="hisparse", num_gpu_blocks=30, hot_buffer_size=32, host_pool_gib=0.02,
              max_num_batched_tokens=64, hot_policy="score+prefetch")
    want, _ = _run(dsv32_path, batch, params, mode="gpu-only")
    got1, s1 = _run(dsv32_path, batch, params, hot_prefetch_rows=1, **kw)
    got0, s0 = _run(dsv32_path, batch, params, hot_prefetch_rows=0, **kw)
    assert got1 == want and got0 == want
    assert s0["hot_prefetched"] == 0 and s1["hot_prefetched"] > 0
    with pytest.raises(ValueError, match="hot_prefetch_rows"):
        LLM(dsv32_path, device="cpu", hot_prefetch_rows=-1)


# ------------------------------------------------------------------------------- GPU (H200)
@pytest.mark.gpu
def test_gpu_side_stream_prefetch_equals_fused_reference():
    """The context's split on CUDA (Triton resolver writes the plan, the copy runs on the
    prefetch side stream, joined at the end of the forward) equals the fused reference."""
    import torch

    s = _Setup(device="cuda", R=4, L=3, topk=32, H=64, PF=6, seed=3)
    assert s.ctx.prefetcher.stream is not None
    hi = s.P * s.bs
    slots = torch.tensor([1, 3, 0, 2], dtype=torch.int32)
    prev_band = None
    for step in range(6):
        promote = prev_band is not None and step % 2 == 1
        topk, band = s.ranked(4, hi, s.K, first=prev_band[:, :s.PF] if promote else None)
        got, want = s.step(slots, topk, band)
        torch.cuda.synchronize()
        s.assert_same(got, want)
        prev_band = band
    assert int(s.c.counters[3]) > 0 and int(s.c.counters[4]) > 0


@pytest.fixture(scope="module")
def gpu_dense_path(tmp_path_factory):
    from hisparse.models.random_checkpoint import PRODUCTION_GEOMETRY, make_random_checkpoint

    geo = dict(PRODUCTION_GEOMETRY, index_topk=64)
    return make_random_checkpoint(tmp_path_factory.mktemp("gpu_prefetch"), "deepseek_v32",
                                  seed=4, hidden_size=256, num_attention_heads=16,
                                  num_key_value_heads=16, q_lora_rank=128, num_hidden_layers=3,
                                  first_k_dense_replace=100, **geo)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["hisparse", "always-host"])
def test_gpu_prefetch_with_cuda_graphs_equals_eager_and_gpu_only(gpu_dense_path, mode,
                                                               monkeypatch):
    """score+prefetch on the H200: decode steps captured as CUDA graphs (the prefetch copies
    forked onto the side stream and joined inside each graph) give the tokens of an eager run
    and of an unconstrained gpu-only run, and the same hot counters as the eager run (the
    resolver's state evolves identically); prefetched rows are hit.

    A mirror's ack is an event query, so when a page becomes spillable depends on the GPU's
    timing (under a loaded GPU the two runs spilled at different steps: same tokens, other
    counters). The runner waits for every mirror at each poll here, so both runs see the same
    schedule and the counters compare the resolver alone."""
    from hisparse.worker.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "_poll_acks", ModelRunner.drain)
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(rng.randrange(150, 400))]}
               for _ in range(11)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=512,
                  max_num_seqs=11, max_num_batched_tokens=256)
    base = LLM(gpu_dense_path, mode="gpu-only", enforce_eager=True, **common)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, sp)]
    runs = {}
    for eager in (True, False):
        llm = LLM(gpu_dense_path, mode=mode, num_gpu_blocks=70, hot_buffer_size=128,
                  host_pool_gib=0.5, hot_policy="score+prefetch", hot_prefetch_rows=8,
                  enforce_eager=eager, **common)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        assert got == want, f"enforce_eager={eager}"
        s = llm.stats()
        assert s["spilled_pages"] > 0 and s["hot_demand_misses"] > 0
        assert s["hot_prefetched"] > 0 and 0 < s["hot_prefetch_hits"] <= s["hot_prefetched"]
        if not eager:
            g = llm.runner.graphs
            assert g is not None and any(k[1] for k in g.graphs)   # host-read graphs replayed
            assert llm.caches.workspace.prefetch_plans is not None
            assert bool((llm.caches.workspace.prefetch_plans == -1).all())
        runs[eager] = {k: s[k] for k in ("hot_hits", "hot_demand_misses", "hot_prefetched",
                                         "hot_prefetch_hits")}
    assert runs[True] == runs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_gpu_delayed_prefetch_copies_are_joined(gpu_dense_path, monkeypatch, eager):
    """Every prefetch copy is held back ~5 ms on its side stream (a spin kernel before it) and
    nothing synchronizes between steps: the tokens still equal gpu-only's only if every step
    waits for the previous step's copies before its resolver reads or reuses those slots (a
    missing join would let attention read slots whose rows have not landed)."""
    import torch

    from hisparse import ops
    from hisparse.worker import model_runner

    real = ops.prefetch_copy

    def late_copy(plan, arena, host):
        torch.cuda._sleep(10_000_000)          # ~5 ms of spinning on the current (side) stream
        real(plan, arena, host)

    monkeypatch.setattr(model_runner.ops, "prefetch_copy", late_copy)
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384) for _ in range(rng.randrange(150, 400))]}
               for _ in range(6)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    common = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=512,
                  max_num_seqs=6, max_num_batched_tokens=256)
    want = [o.outputs[0].token_ids for o in LLM(gpu_dense_path, mode="gpu-only",
                                                enforce_eager=True, **common).generate(prompts, sp)]
    llm = LLM(gpu_dense_path, mode="always-host", num_gpu_blocks=70, hot_buffer_size=128,
              host_pool_gib=0.5, hot_policy="score+prefetch", hot_prefetch_rows=8,
              enforce_eager=eager, **common)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
    s = llm.stats()
    assert s["hot_prefetched"] > 0 and s["hot_prefetch_hits"] > 0
