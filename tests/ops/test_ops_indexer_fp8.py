"""FP8-key indexer scoring with FP8 queries (hisparse.ops.indexer module docstring): the query
quantization kernel, the e4m3 x e4m3 scoring kernel and the reference that is their spec.

Tolerances: with the same query quantization the kernel and the float64 oracle multiply the
same e4m3 values (every product of two e4m3 values is exact in fp32) and both scale by powers
of two, so they differ only by fp32 rounding of the sums: the 128-term dot and the sum over
heads, at most ``(D + Hi) * 2**-24`` times the sum of the absolute terms on CPU (the
interpreter's numpy dot); Hopper's FP8 MMA keeps fewer accumulator bits (DeepSeek-V3 report:
about 14, so ~2**-12 over the 4 k-steps of D = 128), bounded by ``2**-10`` there. Selections
are then checked tie-robustly (every selected score at least every unselected one, within the
same bound), and bit for bit on small-integer data, where every score is exact."""

import pytest
import torch

from hisparse.ops import IndexerWorkspace, indexer_topk, indexer_topk_reference
from hisparse.ops import quant as Q
from hisparse.ops.rotation import indexer_rotation

SENTINEL = -7
INT32_MIN = -(2 ** 31)


@pytest.fixture(autouse=True)
def _fp8_queries(kernel_switches):
    """These tests are the FP8-query path's (the default; pinned against a stray ``=0``)."""
    kernel_switches(fp8_indexer=True)


def _scores_from_keys(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of ``topk.orderable_keys``: int32 keys -> fp32 scores."""
    bits = torch.where(keys < 0, keys ^ 0x7FFFFFFF, keys)
    return bits.view(torch.float32)


def _case(T, Hi, D, bs, P, R, seed, device="cpu", integer=False, qdtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    nblk = R * P + 3
    if integer:     # small integers in the rotated basis (FP8 keys and queries are rotated):
        # for D = 4 ** m the rotation is exact both ways (H @ H = D * I, D ** -0.5 a power of 2)
        assert D in (16, 64, 256)
        q = indexer_rotation(torch.randint(-2, 3, (T, Hi, D), generator=g).float())
        k = indexer_rotation(torch.randint(-2, 3, (nblk * bs, D), generator=g).float())
        w = torch.tensor([0.25, 0.5, -0.5, 1.0])[torch.randint(0, 4, (T, Hi), generator=g)]
    else:   # per-head and per-key magnitudes spread over 2**-4 .. 2**4: real scale tiles
        q = torch.randn(T, Hi, D, generator=g) * 2.0 ** torch.randint(-4, 5, (T, Hi, 1),
                                                                     generator=g)
        k = torch.randn(nblk * bs, D, generator=g) * 2.0 ** torch.randint(-4, 5, (nblk * bs, 1),
                                                                         generator=g)
        w = torch.rand(T, Hi, generator=g) * 2 - 0.5          # mixed-sign weights
    rows8 = Q.quantize_index_keys_reference(k)
    pages = Q.FP8KeyLayout(D, bs).pages(rows8)
    bt = torch.randperm(nblk, generator=g)[:R * P].view(R, P).to(torch.int32)
    dev = torch.device(device)
    return (q.to(qdtype).to(dev), w.to(dev), pages.to(dev), bt.to(dev),
            Q.dequantize_index_keys_reference(rows8, D).double().to(dev))


def _oracle(q, w, kd, bt, r, n, bs):
    """float64 scores ``[n]`` of request ``r``'s first ``n`` positions from the dequantized FP8
    queries and keys, the bound on fp32 rounding's scale (sum of absolute terms) and the
    mapped mask."""
    s = torch.arange(n, device=q.device)
    blk = bt[r, s // bs].long()
    mapped = blk >= 0
    k = kd[(blk.clamp(min=0) * bs + s % bs)]                       # [n, D]
    qd = Q.dequantize_index_queries_reference(*Q.quantize_index_queries_reference(q[None]))[0]
    dots = qd.double() @ k.T                                       # [Hi, n]
    score = (w.double()[:, None] * dots.clamp(min=0)).sum(0)
    mag = (w.double().abs()[:, None] * (qd.double().abs() @ k.abs().T)).sum(0)
    return score, mag, mapped


def _check_selection(sel, score, mag, mapped, topk, rtol):
    """Tie-robust: the right count, distinct, mapped, and no unselected candidate scores above
    a selected one by more than the rounding bound."""
    sel = sel[sel >= 0].long()
    cand = mapped.nonzero().squeeze(1)
    assert sel.numel() == min(topk, cand.numel())
    assert sel.unique().numel() == sel.numel() and mapped[sel].all()
    if sel.numel() < cand.numel():
        rest = torch.ones_like(mapped)
        rest[sel] = False
        rest &= mapped
        tol = rtol * mag.max()
        assert score[rest].max() <= score[sel].min() + tol


@pytest.mark.parametrize("Hi,D,dtype", [(64, 128, torch.bfloat16), (20, 128, torch.float32),
                                        (8, 256, torch.bfloat16), (4, 32, torch.float32)])
def test_quantize_queries_bit_exact(triton_cpu, Hi, D, dtype):
    """The query quantization kernel == quant.quantize_index_queries_reference bit for bit
    (codes and scales; the folded weights are ``w * scale`` exactly), all-zero heads included;
    buffers start poisoned."""
    from hisparse.ops._indexer_triton import quantize_queries

    g = torch.Generator().manual_seed(Hi + D)
    T = 3
    q = (torch.randn(T, Hi, D, generator=g) * 2.0 ** torch.randint(-12, 12, (T, Hi, 1),
                                                                   generator=g)).to(dtype)
    q[1, 0] = 0.0
    w = torch.rand(T, Hi, generator=g)
    codes, scales, wq = quantize_queries(q, w)
    want_codes, want_scales = Q.quantize_index_queries_reference(q)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    if D // Q.fp8_tile(D) == 1:
        assert torch.equal(wq, w * want_scales[..., 0])
    else:
        assert wq is None


# (1, 64): one program's head tile 4x wider, the kernel paths of the others (token groups of 1
# run in the integer-data test below): the newest Triton only (.ci/triton_matrix.sh; ~5 s)
@pytest.mark.parametrize("group,Hi", [
    pytest.param(1, 64, marks=pytest.mark.newest_triton_only), (2, 16), (4, 8)])
def test_fp8_scoring_matches_oracle(triton_cpu, group, Hi):
    """Fresh random data with spread magnitudes: every written score within fp32 rounding of
    the float64 oracle over the dequantized FP8 queries and keys; unmapped pages INT32_MIN,
    nothing written past a token's length (a poisoned buffer stays poisoned); the selection is
    right up to near-ties and agrees with the reference's."""
    from hisparse.ops._indexer_triton import indexer_keys

    T, D, bs, P, R, topk = 7, 128, 16, 6, 3, 24
    q, w, pages, bt, kd = _case(T, Hi, D, bs, P, R, seed=group)
    bt[1, 2] = -1
    req = torch.tensor([0, 0, 1, 1, -1, 2, 2], dtype=torch.int32)
    pos = torch.tensor([90, 95, 60, 61, 9, 20, 5], dtype=torch.int32)
    W = P * bs
    keys = torch.full((T, W), SENTINEL, dtype=torch.int32)
    lens = torch.full((T,), SENTINEL, dtype=torch.int32)
    indexer_keys(q, w, pages, bt, req, pos, bs, out=keys, lengths=lens, group=group)
    assert torch.equal(lens, torch.where(req >= 0, pos + 1, 0))
    got = indexer_topk(q, w, pages, bt, req, pos, bs, topk, group=group)
    ref = indexer_topk_reference(q, w, pages, bt, req, pos, bs, topk)
    rtol = (D + Hi) * 2.0 ** -24
    for t in range(T):
        n = int(lens[t])
        assert (keys[t, n:] == SENTINEL).all()
        if n == 0:
            assert (got[t] == -1).all() and (ref[t] == -1).all()
            continue
        score, mag, mapped = _oracle(q[t], w[t], kd, bt, int(req[t]), n, bs)
        assert (keys[t, :n][~mapped] == INT32_MIN).all()
        s = _scores_from_keys(keys[t, :n])[mapped].double()
        assert ((s - score[mapped]).abs() <= rtol * mag[mapped] + 1e-30).all(), t
        _check_selection(got[t], score, mag, mapped, topk, rtol)
        _check_selection(ref[t], score, mag, mapped, topk, rtol)
    assert (got == ref).float().mean() > 0.9


@pytest.mark.parametrize("group", [1, 4])
def test_fp8_scoring_exact_on_integer_data(triton_cpu, group):
    """Queries and keys whose rotations are small integers (so their rotation and FP8
    quantization are exact) and power-of-two weights: every score is exact in fp32, so the
    kernel + radix select equal the reference bit for bit, with heavy ties, mixed requests,
    padding and lengths below and above top-k, through a poisoned workspace."""
    T, Hi, D, bs, P, R, topk = 7, 16, 64, 8, 6, 3, 12
    q, w, pages, bt, _ = _case(T, Hi, D, bs, P, R, seed=10 + group, integer=True,
                               qdtype=torch.float32)
    bt[1, 2] = -1
    req = torch.tensor([0, 0, 1, 1, 1, -1, 2], dtype=torch.int32)
    pos = torch.tensor([47, 30, 45, 5, 20, 9, 40], dtype=torch.int32)
    ws = IndexerWorkspace(8, P * bs, "cpu")
    ws.keys.fill_(SENTINEL)
    out = torch.full((T, topk), SENTINEL, dtype=torch.int32)
    got = indexer_topk(q, w, pages, bt, req, pos, bs, topk, out=out, workspace=ws, group=group)
    ref = indexer_topk_reference(q, w, pages, bt, req, pos, bs, topk)
    assert torch.equal(got, ref)
    assert (ref[3] == -1).any() and (ref[0] >= 0).all()
    past = torch.arange(P * bs)[None, :] >= torch.where(req >= 0, pos + 1, 0)[:, None]
    assert (ws.keys[:T][past] == SENTINEL).all()


def test_env_switch_selects_the_unquantized_query_path(triton_cpu, kernel_switches):
    """With ``HISPARSE_FP8_INDEXER=0`` kernel and reference both score the rotated, unquantized
    queries (the reference then equals itself over the dequantized keys and the rotated
    queries); unset (the default) or ``=1``, the FP8 queries (different scores on random data).
    A head size whose query tile is not a power of two (48) keeps the unquantized path too."""
    from hisparse.ops._indexer_triton import indexer_keys

    T, Hi, D, bs, P, R, topk = 3, 16, 64, 8, 4, 2, 8
    q, w, pages, bt, kd = _case(T, Hi, D, bs, P, R, seed=5, qdtype=torch.float32)
    req = torch.tensor([0, 1, 1], dtype=torch.int32)
    pos = torch.tensor([30, 20, 31], dtype=torch.int32)
    keys_f8q, _ = indexer_keys(q, w, pages, bt, req, pos, bs)
    kernel_switches(fp8_indexer=False)
    got = indexer_topk(q, w, pages, bt, req, pos, bs, topk)
    ref = indexer_topk_reference(q, w, pages, bt, req, pos, bs, topk)
    assert torch.equal(got, ref)
    assert torch.equal(ref, indexer_topk_reference(indexer_rotation(q), w, kd.float(), bt, req,
                                                   pos, bs, topk))
    keys_old, _ = indexer_keys(q, w, pages, bt, req, pos, bs, fp8_query=False)
    assert not torch.equal(keys_old[0, :31], keys_f8q[0, :31])
    from hisparse.ops.indexer import fp8_query_enabled

    assert not fp8_query_enabled(128)
    kernel_switches(fp8_indexer=True)
    assert fp8_query_enabled(128) and fp8_query_enabled(64) and not fp8_query_enabled(48)
    got_default = indexer_topk(q, w, pages, bt, req, pos, bs, topk)
    assert torch.equal(got_default, indexer_topk_reference(q, w, pages, bt, req, pos, bs, topk))
    assert not torch.equal(got_default, ref)


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("T,ctx", [(8, 32768), (48, 32768), (8, 131072)])
def test_gpu_fp8_scoring_production(T, ctx, selection_overlap):
    """The real rank's shape (64 heads, D 128, page 64, top-k 2048): scores within the FP8
    MMA's rounding of the float64 oracle, selections right up to near-ties and mostly equal to
    the reference's, and batch invariance: a token's keys are the same bits scored alone."""
    from hisparse.ops._indexer_triton import indexer_keys

    Hi, D, bs, topk = 64, 128, 64, 2048
    P = ctx // bs
    q, w, pages, bt, kd = _case(T, Hi, D, bs, P, T, seed=T + ctx, device="cuda")
    req = torch.arange(T, dtype=torch.int32, device="cuda")
    g = torch.Generator().manual_seed(ctx)
    pos = torch.randint(ctx // 2, ctx, (T,), generator=g).to(torch.int32).cuda()
    pos[0] = 1000                                              # below top-k: everything
    bt[1, 3] = -1
    keys, lens = indexer_keys(q, w, pages, bt, req, pos, bs)
    got = indexer_topk(q, w, pages, bt, req, pos, bs, topk)
    ref = indexer_topk_reference(q, w, pages, bt, req, pos, bs, topk)
    rtol = 2.0 ** -10          # Hopper FP8 MMA accumulation (module docstring)
    for t in sorted({0, 1, T // 2, T - 1}):
        n = int(lens[t])
        score, mag, mapped = _oracle(q[t], w[t], kd, bt, t, n, bs)
        s = _scores_from_keys(keys[t, :n])[mapped].double()
        assert ((s - score[mapped]).abs() <= rtol * mag[mapped] + 1e-30).all(), t
        _check_selection(got[t], score, mag, mapped, topk, rtol)
        alone, _ = indexer_keys(q[t:t + 1], w[t:t + 1], pages, bt, req[t:t + 1], pos[t:t + 1],
                                bs)
        assert torch.equal(alone[0, :n], keys[t, :n]), t
    # the reference scores in fp32, the kernel's FP8 MMA accumulates less precisely (rtol):
    # the checks above bound every difference; this one catches wholesale disagreement
    overlap = selection_overlap(got, ref)
    assert overlap > 0.97, overlap
