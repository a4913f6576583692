"""The indexer's fused launches (docs/notes/launch_census.md items 1 and 4) against today's
unfused path, bit for bit (``torch.equal``: the lossless contract):

- queries: :class:`hisparse.ops.indexer.IndexerQueries` (``wq_b``'s output and
  ``weights_proj``'s, before their RoPE and weight scale) scored against FP8 keys run the RoPE
  and the scale inside the query quantization kernel; today's path runs ``glue.rope_heads``
  (its kernel) and ``w.float() * weight_scale`` first;
- the top-k's histogram scratch: zeroed by the scoring kernel instead of a fill launch.

CPU: the interpreter at small shapes, fresh random data shaped like a rank's (``q_raw`` a
strided view of the stacked ``[q_b | wq_b]`` output, per-head magnitudes spread, real RoPE
tables, fp32 weights), outputs and scratch poisoned. GPU (``gpu`` marker): a TP-8 rank of
DeepSeek-V3.2 (64 indexer heads of 128, rope 64, q_lora 1536, hidden 7168, top-k 2048).
"""

import pytest
import torch

from hisparse.ops import IndexerQueries, IndexerWorkspace, glue, indexer_topk, switches
from hisparse.ops import quant as Q
from hisparse.ops.pending import PendingSum
from hisparse.ops.topk import TopkScratch, column_order_reference, topk_select

SENTINEL = -7


@pytest.fixture(autouse=True)
def _fp8_queries(kernel_switches):
    kernel_switches(fp8_indexer=True)


def _rope_tables(T, rope, dtype, device="cpu", max_pos=40000):
    pos = torch.randint(0, max_pos, (T,), device=device).float()
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2, device=device).float() / rope))
    f = pos[:, None] * inv[None]
    return (f.cos() * 1.1).to(dtype), (f.sin() * 1.1).to(dtype)


def _queries(T, Hi, D, rope, interleaved, dtype, device="cpu", lead=96):
    """An :class:`IndexerQueries` like a rank's: ``q`` a view of the stacked projection's
    output (row stride ``lead + Hi * D``), heads of spread magnitude (one all-zero), fp32
    ``weights_proj`` outputs of mixed sign."""
    stacked = torch.randn(T, lead + Hi * D, device=device)
    stacked[:, lead:] *= 2.0 ** torch.randint(-6, 7, (T, Hi), device=device).repeat_interleave(D, 1)
    stacked = stacked.to(dtype)
    q = stacked[:, lead:].view(T, Hi, D)
    q[0, 1] = 0.0
    cos, sin = _rope_tables(T, rope, dtype, device)
    w = torch.randn(T, Hi, device=device) * 0.05
    return IndexerQueries(q, cos, sin, rope, interleaved, w, Hi ** -0.5 * D ** -0.5)


def _pages(D, bs, nblk, device="cpu"):
    k = torch.randn(nblk * bs, D, device=device) * 2.0 ** torch.randint(-3, 4, (nblk * bs, 1),
                                                                       device=device)
    return Q.FP8KeyLayout(D, bs).pages(Q.quantize_index_keys_reference(k))


def _unfused(lazy: IndexerQueries):
    """Today's inputs: the roped queries (``glue.rope_heads``, its kernel) and scaled weights
    (pending ones summed by their own reduction)."""
    w = lazy.w.materialize() if isinstance(lazy.w, PendingSum) else lazy.w
    return glue.rope_heads(lazy.q, lazy.cos, lazy.sin, lazy.rope_dim, lazy.interleaved), \
        w.float() * lazy.weight_scale


def _poisoned_workspace(rows, W, device="cpu"):
    ws = IndexerWorkspace(rows, W, device)
    ws.keys.fill_(SENTINEL)
    ws.lengths.fill_(SENTINEL)
    ws.topk.hist.random_(-2 ** 20, 2 ** 20)     # the top-k must not read any of this
    return ws


# ----------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("Hi,D,rope,interleaved,dtype", [
    (16, 128, 64, False, torch.bfloat16),       # a rank's head, one head tile
    (20, 128, 64, True, torch.bfloat16),        # GLM's interleaved RoPE, a masked head tile
    (8, 64, 16, False, torch.float32),
    (4, 32, 32, True, torch.bfloat16),          # RoPE over the whole head
])
def test_queries_kernel_folds_rope_and_weight_scale(triton_cpu, poisoned_empty, Hi, D, rope,
                                                    interleaved, dtype):
    """One launch from ``wq_b``'s output to e4m3 queries, scales and weights == today's
    rope_heads kernel + weight scale + query kernel, and == the references, bit for bit."""
    from hisparse.ops._indexer_triton import quantize_queries

    T = 5
    lazy = _queries(T, Hi, D, rope, interleaved, dtype)
    codes, scales, wq = quantize_queries(lazy.q, lazy.w, rope=lazy.rope,
                                         weight_scale=lazy.weight_scale)
    q, w = _unfused(lazy)
    want_codes, want_scales, want_wq = quantize_queries(q, w)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert torch.equal(wq, want_wq)
    ref_q = glue.rope_heads_reference(lazy.q, lazy.cos, lazy.sin, rope, interleaved)
    ref_codes, ref_scales = Q.quantize_index_queries_reference(ref_q)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    assert torch.equal(wq, (lazy.w * lazy.weight_scale) * ref_scales[..., 0])


@pytest.mark.parametrize("T", [5, 18])
def test_queries_kernel_sums_pending_weights(triton_cpu, poisoned_empty, T):
    """``weights_proj``'s fp32 split-K partials left pending (:func:`hisparse.ops.fp32_linear`)
    and summed by the query kernel == the summed weights, bit for bit; an
    :class:`IndexerQueries` keeps them pending over all its rows and materializes a part."""
    from hisparse.ops import fp32_linear
    from hisparse.ops._indexer_triton import quantize_queries

    Hi, D, rope = 16, 128, 64
    base = _queries(T, Hi, D, rope, False, torch.bfloat16)
    x = torch.randn(T, 600)
    proj = torch.randn(Hi, 600) * 0.04
    pending = fp32_linear(x, proj, pending=True)
    assert isinstance(pending, PendingSum) and pending.count == 3
    lazy = IndexerQueries(base.q, base.cos, base.sin, rope, False, pending, base.weight_scale)
    summed = fp32_linear(x, proj)
    got = quantize_queries(lazy.q, lazy.w, rope=lazy.rope, weight_scale=lazy.weight_scale)
    want = quantize_queries(lazy.q, summed, rope=lazy.rope, weight_scale=lazy.weight_scale)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert lazy[0:T] is lazy and lazy[:] is lazy
    part = lazy[1:4]
    assert isinstance(part.w, torch.Tensor) and torch.equal(part.w, summed[1:4])
    q, w = lazy.materialize()
    assert torch.equal(w, summed * lazy.weight_scale)
    with pytest.raises(ValueError, match="pending weights"):
        quantize_queries(lazy.q[:2], pending, rope=lazy[:2].rope, weight_scale=1.0)
    with pytest.raises(ValueError, match="pending weights"):   # a bias the kernel would skip
        quantize_queries(lazy.q, pending.with_bias(torch.ones(Hi)), rope=lazy.rope,
                         weight_scale=1.0)


def test_queries_kernel_refuses_a_fold_over_several_tiles(triton_cpu):
    from hisparse.ops._indexer_triton import quantize_queries

    lazy = _queries(2, 4, 256, 64, False, torch.bfloat16)
    with pytest.raises(ValueError, match="one scale tile"):
        quantize_queries(lazy.q, lazy.w, rope=lazy.rope, weight_scale=lazy.weight_scale)


# ----------------------------------------------------------------------------- indexer_topk
@pytest.mark.parametrize("group,interleaved,pending", [(1, False, False), (2, True, False),
                                                       (1, False, True)])
def test_indexer_topk_fused_equals_unfused(triton_cpu, group, interleaved, pending):
    """``indexer_topk`` of an :class:`IndexerQueries` (fused queries, the scoring kernel
    zeroing the top-k's poisoned histograms; 7 tokens over a 4-row workspace: two passes;
    ``pending``: ``weights_proj``'s split-K partials as the weights) == today's: the
    materialized queries, unfused glue (``hist.zero_()``), same keys, lengths and selection
    (hot band included)."""
    T, Hi, D, rope, bs, P, R, topk = 7, 16, 128, 64, 16, 6, 3, 20
    lazy = _queries(T, Hi, D, rope, interleaved, torch.bfloat16)
    if pending:
        from hisparse.ops import fp32_linear
        w = fp32_linear(torch.randn(T, 300), torch.randn(Hi, 300) * 0.05, pending=True)
        lazy = IndexerQueries(lazy.q, lazy.cos, lazy.sin, rope, interleaved, w,
                              lazy.weight_scale)
    pages = _pages(D, bs, R * P + 2)
    bt = torch.randperm(R * P + 2)[:R * P].view(R, P).to(torch.int32)
    bt[1, 2] = -1
    req = torch.tensor([0, 0, 1, 1, -1, 2, 2], dtype=torch.int32)
    pos = torch.tensor([90, 95, 60, 61, 9, 20, 5], dtype=torch.int32)
    W = P * bs
    ws = _poisoned_workspace(4, W)
    got = indexer_topk(lazy, None, pages, bt, req, pos, bs, topk, workspace=ws, group=group)
    q, w = _unfused(lazy)
    ws_ref = _poisoned_workspace(4, W)
    with switches.override(fused_glue=False):
        want = indexer_topk(q, w, pages, bt, req, pos, bs, topk, workspace=ws_ref, group=group)
    assert torch.equal(got, want)
    assert torch.equal(ws.keys, ws_ref.keys) and torch.equal(ws.lengths, ws_ref.lengths)
    assert (got[4] == -1).all() and (got[6, 6:] == -1).all() and (got[0] >= 0).all()
    # without a workspace (each call allocates its own scratch): the same
    assert torch.equal(indexer_topk(lazy, None, pages, bt, req, pos, bs, topk, group=group), want)


def test_indexer_topk_short_rows_switch(triton_cpu, kernel_switches):
    """``HISPARSE_TOPK_SHORT``: the engine's column-order selection with its rows taken by the
    one-program kernel (every row here is short) equals the default launch's, into poisoned
    workspaces (two passes of 4 rows)."""
    T, Hi, D, rope, bs, P, R, topk = 7, 16, 128, 64, 16, 6, 3, 20
    lazy = _queries(T, Hi, D, rope, False, torch.bfloat16)
    pages = _pages(D, bs, R * P + 2)
    bt = torch.randperm(R * P + 2)[:R * P].view(R, P).to(torch.int32)
    req = torch.tensor([0, 0, 1, 1, -1, 2, 2], dtype=torch.int32)
    pos = torch.tensor([90, 95, 60, 61, 9, 20, 5], dtype=torch.int32)
    want = indexer_topk(lazy, None, pages, bt, req, pos, bs, topk,
                        workspace=_poisoned_workspace(4, P * bs), ranked=False)
    kernel_switches(topk_short="4096")
    ws = _poisoned_workspace(4, P * bs)
    ws.topk.long_lengths.fill_(-5)
    got = indexer_topk(lazy, None, pages, bt, req, pos, bs, topk, workspace=ws, ranked=False)
    assert torch.equal(got, want)
    assert (ws.topk.long_lengths[:3] == 0).all()     # the last pass's rows: all short


@pytest.mark.parametrize("case", ["bf16_keys", "fp8_indexer_off", "two_tiles", "reference"])
def test_indexer_topk_lazy_queries_elsewhere_materialize(triton_cpu, kernel_switches, case):
    """Where the query kernel cannot take them (float keys, ``HISPARSE_FP8_INDEXER=0``, heads
    of two scale tiles, the PyTorch reference) :class:`IndexerQueries` run today's ops first:
    the same selection as the materialized tensors."""
    T, Hi, bs, P, topk = 4, 8, 16, 4, 12
    D = 256 if case == "two_tiles" else 64
    lazy = _queries(T, Hi, D, 32, False, torch.bfloat16)
    if case == "bf16_keys":
        k_cache = torch.randn(P * bs + bs, D).to(torch.bfloat16)
    else:
        k_cache = _pages(D, bs, P + 1)
    if case == "fp8_indexer_off":
        kernel_switches(fp8_indexer=False)
    if case == "reference":
        kernel_switches(force_triton=False)
    bt = torch.arange(P, dtype=torch.int32)[None]
    req = torch.zeros(T, dtype=torch.int32)
    pos = torch.tensor([63, 40, 17, 2], dtype=torch.int32)
    q, w = _unfused(lazy)
    want = indexer_topk(q, w, k_cache, bt, req, pos, bs, topk)
    assert torch.equal(indexer_topk(lazy, None, k_cache, bt, req, pos, bs, topk), want)


def test_indexer_queries_materialize_is_todays_model_code(triton_cpu):
    """``materialize`` == what ``DSAIndexer.forward`` computed before (RoPE kernel, weights
    ``.float() * scale``); rows slice every part together."""
    lazy = _queries(6, 4, 64, 32, True, torch.bfloat16)
    q, w = lazy.materialize()
    assert torch.equal(q, glue.rope_heads(lazy.q, lazy.cos, lazy.sin, 32, True))
    assert w.dtype == torch.float32 and torch.equal(w, lazy.w.float() * lazy.weight_scale)
    part = lazy[2:5]
    q2, w2 = part.materialize()
    assert part.shape == (3, 4, 64) and torch.equal(q2, q[2:5]) and torch.equal(w2, w[2:5])


# ----------------------------------------------------------------------------- hist zeroing
@pytest.mark.parametrize("fp8", [True, False])
def test_scoring_kernel_zeroes_the_topk_histograms(triton_cpu, fp8):
    """``indexer_keys(hist=...)``: rows ``< T`` of the scratch zeroed, the others untouched,
    the keys those of a call without it; the top-k then skips its fill
    (``hist_zeroed``) and selects what it selects after its own."""
    from hisparse.ops._indexer_triton import indexer_keys

    T, Hi, D, bs, P, topk = 5, 8, 64, 16, 4, 10
    lazy = _queries(T, Hi, D, 32, False, torch.bfloat16)
    q, w = _unfused(lazy)
    k_cache = _pages(D, bs, P) if fp8 else torch.randn(P * bs, D).to(torch.bfloat16)
    bt = torch.arange(P, dtype=torch.int32)[None]
    req = torch.tensor([0, 0, -1, 0, 0], dtype=torch.int32)
    pos = torch.tensor([63, 50, 7, 3, 30], dtype=torch.int32)
    scratch = TopkScratch(T + 3, "cpu")
    scratch.hist.random_(-2 ** 20, 2 ** 20)
    tail = scratch.hist[T:].clone()
    keys, lens = indexer_keys(q, w, k_cache, bt, req, pos, bs, hist=scratch.hist[:T], group=2)
    assert (scratch.hist[:T] == 0).all() and torch.equal(scratch.hist[T:], tail)
    keys0, lens0 = indexer_keys(q, w, k_cache, bt, req, pos, bs, group=2)
    assert torch.equal(lens, lens0)
    for t in range(T):
        assert torch.equal(keys[t, :lens[t]], keys0[t, :lens0[t]])
    got = topk_select(keys, lens, topk, scratch=scratch, hist_zeroed=True)
    assert torch.equal(got, topk_select(keys, lens, topk))


def test_indexer_keys_refuses_a_misshapen_hist(triton_cpu):
    from hisparse.ops._indexer_triton import indexer_keys

    lazy = _queries(3, 4, 64, 32, False, torch.bfloat16)
    q, w = _unfused(lazy)
    pages = _pages(64, 16, 2)
    bt = torch.arange(2, dtype=torch.int32)[None]
    req, pos = torch.zeros(3, dtype=torch.int32), torch.tensor([5, 6, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="hist"):
        indexer_keys(q, w, pages, bt, req, pos, 16, hist=TopkScratch(2, "cpu").hist)


# ----------------------------------------------------------------------------- GPU, rank shapes
RANK = dict(Hi=64, D=128, rope=64, q_lora=1536, hidden=7168, topk=2048, heads=16, qk_head=192)


def _rank_queries(T, device="cuda"):
    """A rank's indexer inputs from its real producers: ``q_raw`` the ``wq_b`` part of the
    stacked ``[q_b | wq_b]`` GEMM output (bf16, row stride 11264), ``w`` the fp32
    ``weights_proj`` GEMM of the normed hidden (cuBLAS), YaRN-like RoPE tables."""
    r = RANK
    lead = r["heads"] * r["qk_head"]
    q_resid = torch.randn(T, r["q_lora"], device=device).to(torch.bfloat16)
    w_q = (torch.randn(lead + r["Hi"] * r["D"], r["q_lora"], device=device) * 0.03
           ).to(torch.bfloat16)
    stacked = q_resid @ w_q.T
    q = stacked[:, lead:].view(T, r["Hi"], r["D"])
    x32 = torch.randn(T, r["hidden"], device=device).to(torch.bfloat16).float()
    w = torch.nn.functional.linear(x32, torch.randn(r["Hi"], r["hidden"], device=device) * 0.01)
    cos, sin = _rope_tables(T, r["rope"], torch.bfloat16, device, max_pos=32768)
    return IndexerQueries(q, cos, sin, r["rope"], False, w, r["Hi"] ** -0.5 * r["D"] ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 33, 96])
def test_gpu_queries_kernel_folds_rope_and_weight_scale(T):
    from hisparse.ops._indexer_triton import quantize_queries

    lazy = _rank_queries(T)
    got = quantize_queries(lazy.q, lazy.w, rope=lazy.rope, weight_scale=lazy.weight_scale)
    want = quantize_queries(*_unfused(lazy))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("T,group", [(1, 1), (8, 1), (33, 1), (96, 1), (32, 4)])
def test_gpu_indexer_topk_fused_equals_unfused(T, group):
    """A rank's decode / MTP-verify / prefill-chunk batch over ~32k positions of FP8 keys:
    the fused path (one query launch, no fill) == today's, selection, keys and lengths, with
    the scratch poisoned; and under CUDA-graph replay with new queries."""
    dev = "cuda"
    D, bs, topk = RANK["D"], 64, RANK["topk"]
    P = 512                                     # 32k positions per request
    R = 4
    lazy = _rank_queries(T)
    pages = _pages(D, bs, R * P, dev)
    bt = torch.randperm(R * P, device=dev)[:R * P].view(R, P).to(torch.int32)
    req = (torch.arange(T, device=dev) * R // T).to(torch.int32)
    pos = torch.randint(0, P * bs, (T,), device=dev).to(torch.int32)
    pos[0] = 100                                # a short row: every position selected
    ws = _poisoned_workspace(96, P * bs, dev)
    got = indexer_topk(lazy, None, pages, bt, req, pos, bs, topk + 64, workspace=ws, group=group)
    q, w = _unfused(lazy)
    ws_ref = _poisoned_workspace(96, P * bs, dev)
    with switches.override(fused_glue=False):
        want = indexer_topk(q, w, pages, bt, req, pos, bs, topk + 64, workspace=ws_ref,
                            group=group)
    torch.cuda.synchronize()
    assert int(ws.topk.stalls.item()) == 0
    assert torch.equal(got, want)
    assert torch.equal(ws.lengths[:T], ws_ref.lengths[:T])
    for t in range(T):
        n = int(ws.lengths[t])
        assert torch.equal(ws.keys[t, :n], ws_ref.keys[t, :n])
    # captured once, replayed over other queries: the same as today's eager path on them
    out = torch.empty_like(got)
    indexer_topk(lazy, None, pages, bt, req, pos, bs, topk + 64, out=out, workspace=ws,
                 group=group)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        indexer_topk(lazy, None, pages, bt, req, pos, bs, topk + 64, out=out, workspace=ws,
                     group=group)
    fresh = _rank_queries(T)
    lazy.q.copy_(fresh.q)
    lazy.w.copy_(fresh.w)
    ws.topk.hist.random_(-2 ** 20, 2 ** 20)
    g.replay()
    q, w = _unfused(lazy)
    with switches.override(fused_glue=False):
        want = indexer_topk(q, w, pages, bt, req, pos, bs, topk + 64, workspace=ws_ref,
                            group=group)
    torch.cuda.synchronize()
    assert torch.equal(out, want)


# ----------------------------------------------------------------------------- the callers
def test_paged_context_selects_the_same_from_lazy_queries(triton_cpu):
    """``PagedContext.select_topk`` (the engine's indexer layer) takes an
    :class:`IndexerQueries` with no weights: the same ranks and band as today's tensors."""
    from types import SimpleNamespace

    from hisparse.worker.model_runner import PagedContext

    T, Hi, D, bs, P, k, band = 4, 8, 128, 16, 4, 8, 4
    lazy = _queries(T, Hi, D, 64, False, torch.bfloat16)
    pages = _pages(D, bs, 2 * P)
    caches = SimpleNamespace(hot_band=band, workspace=SimpleNamespace(indexer=None))
    fake = SimpleNamespace(index_topk=k, caches=caches, block_size=bs, index_group=1,
                           tables={"indexer": torch.arange(2 * P, dtype=torch.int32).view(2, P)},
                           token_slot=torch.tensor([0, 1, 1, -1], dtype=torch.int32),
                           positions_i32=torch.tensor([40, 63, 9, 0], dtype=torch.int32),
                           host_read=True)
    # HISPARSE_TOPK_ORDER=ranked: the k in score order
    with switches.override(topk_order="ranked"):
        caches.workspace.indexer = _poisoned_workspace(T, P * bs)
        got = PagedContext.select_topk(fake, 0, lazy, None, pages).clone()
        got_band = fake.band.clone()
        q, w = _unfused(lazy)
        caches.workspace.indexer = _poisoned_workspace(T, P * bs)
        with switches.override(fused_glue=False):
            want = PagedContext.select_topk(fake, 0, q, w, pages)
        assert torch.equal(got, want) and torch.equal(got_band, fake.band)
        # a forward without host reads selects no band, the same ranks (the attention sums
        # in the k's order: both kinds of forward must agree)
        fake.host_read = False
        caches.workspace.indexer = _poisoned_workspace(T, P * bs)
        plain = PagedContext.select_topk(fake, 0, lazy, None, pages)
        assert fake.band is None and torch.equal(plain, got)
    # HISPARSE_TOPK_ORDER=positions (the default): the k ascending in both kinds of forward (a
    # host-read one ranks k + band and counts its k into position order; one without host
    # reads does not rank), the same band
    with switches.override(topk_order="positions"):
        fake.host_read = True
        caches.workspace.indexer = _poisoned_workspace(T, P * bs)
        pos_read = PagedContext.select_topk(fake, 0, lazy, None, pages).clone()
        assert torch.equal(fake.band, got_band)
        fake.host_read = False
        caches.workspace.indexer = _poisoned_workspace(T, P * bs)
        pos_plain = PagedContext.select_topk(fake, 0, lazy, None, pages)
    assert fake.band is None and torch.equal(pos_read, pos_plain)
    assert torch.equal(pos_read, column_order_reference(got)) and not torch.equal(pos_read, got)


def test_dense_reference_context_takes_lazy_queries(triton_cpu):
    """The reference context materializes an :class:`IndexerQueries`: same output and
    selection as the tensors."""
    from hisparse.models.context import DenseReferenceContext, materialize_queries

    T, Hi, D, R, H = 6, 4, 64, 32, 2
    lazy = _queries(T, Hi, D, 32, False, torch.bfloat16)
    q_latent = torch.randn(T, H, R + 16).to(torch.bfloat16)
    kv = torch.randn(T, R + 16).to(torch.bfloat16)
    ik = torch.randn(T, D).to(torch.bfloat16)
    outs = []
    for iq, iw in ((lazy, None), materialize_queries(lazy, None)):
        ctx = DenseReferenceContext(1, 3, R)
        ctx.begin(["a"], [T])
        outs.append((ctx.attend(0, q_latent, kv, iq, iw, ik, 0.1), ctx.selections[0]["a"]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_indexer_hands_on_lazy_queries_only_with_the_glue_fused(triton_cpu, kernel_switches,
                                                                  arch):
    """``DSAIndexer.forward``: with the glue fused an :class:`IndexerQueries` (no weights)
    whose materialized values are the tensors it returns with ``HISPARSE_FUSED_GLUE=0`` (the
    RoPE kernel equals its reference bit for bit; the fp32 ``weights_proj`` runs as
    :func:`hisparse.ops.fp32_linear`'s fixed K split, torch's GEMM unfused: the same within
    fp32 rounding); tensors as before otherwise."""
    from hisparse.models.config import DSAConfig
    from hisparse.models.dsa import DSAIndexer
    from hisparse.models.random_checkpoint import make_hf_config

    cfg = DSAConfig.from_hf(make_hf_config(arch).to_dict())
    ix = DSAIndexer(cfg).to(torch.bfloat16)
    ix.weights_proj.float()
    T = 3
    x = torch.randn(T, cfg.hidden_size).to(torch.bfloat16)
    q_resid = torch.randn(T, cfg.q_lora_rank).to(torch.bfloat16)
    cos, sin = _rope_tables(T, cfg.qk_rope_head_dim, torch.bfloat16)
    with torch.no_grad():
        lazy, w_none, _ = ix(x, q_resid, cos, sin, x.float())
        q2, w2 = lazy.materialize()         # the kernels
        kernel_switches(fused_glue=False)
        q, w, _ = ix(x, q_resid, cos, sin, x.float())
    assert isinstance(lazy, IndexerQueries) and w_none is None
    assert isinstance(q, torch.Tensor) and w.dtype == torch.float32
    assert torch.equal(q2, q)
    from hisparse.ops import fp32_linear
    split = fp32_linear(x.float(), ix.weights_proj.weight)
    assert torch.equal(w2, split * ix.weight_scale)
    assert not torch.equal(split, torch.zeros_like(split))
    torch.testing.assert_close(w2, w, rtol=1e-5, atol=1e-6 * w.abs().max().item())
