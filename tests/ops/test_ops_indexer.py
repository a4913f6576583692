
import pytest
import torch

from hisparse.ops import indexer_topk, indexer_topk_reference

SENTINEL = -7


def make_case(T, Hi, D, R, P, bs, pos, req, seed, dtype=torch.float32, device="cpu", unmapped=()):
    g = torch.Generator().manual_seed(seed)
    nblk = R * P + 5
    q = torch.randn(T, Hi, D, generator=g).to(dtype)
    w = torch.rand(T, Hi, generator=g) * 2 - 0.5          # mixed-sign weights
    k = torch.randn(nblk * bs, D, generator=g).to(dtype)
    bt = torch.randperm(nblk, generator=g)[:R * P].view(R, P).to(torch.int32)
    for r, p in unmapped:
        bt[r, p] = -1
    dev = torch.device(device)
    return (q.to(dev), w.to(dev), k.to(dev), bt.to(dev),
            torch.tensor(req, dtype=torch.int32, device=dev),
            torch.tensor(pos, dtype=torch.int32, device=dev))


def dense_scores64(q, w, k, bt, r, pos, bs):
    """float64 score of every position 0..pos of request r (None where the page is unmapped)."""
    out = []
    for s in range(pos + 1):
        b = int(bt[r, s // bs])
        if b < 0:
            out.append(None)
            continue
        kv = k[b * bs + s % bs].double()
        dots = (q.double() @ kv).clamp(min=0)            # [Hi]
        out.append(float((w.double() * dots).sum()))
    return out


def check_row(got_row, scores, topk, tol):
    """got_row: list of positions (then -1). scores: float64 per position or None."""
    cand = [s for s, v in enumerate(scores) if v is not None]
    n = min(topk, len(cand))
    sel = got_row[:n]
    assert all(p >= 0 for p in sel), got_row
    assert all(p == -1 for p in got_row[n:])
    assert len(set(sel)) == n
    assert all(scores[p] is not None for p in sel)
    if n == len(cand):
        assert set(sel) == set(cand)
    else:
        rest = set(cand) - set(sel)
        assert min(scores[p] for p in sel) >= max(scores[p] for p in rest) - tol
    vals = [scores[p] for p in sel]
    for a, b, pa, pb in zip(vals, vals[1:], sel, sel[1:]):
        assert a >= b - tol
        if a == b:  # exact tie (e.g. all-zero ReLU): lower position first
            assert pa < pb


def test_reference_matches_dense_oracle():
    T, Hi, D, R, P, bs, topk = 7, 16, 32, 3, 10, 16, 40
    req = [0, 0, 1, -1, 2, 2, 2]
    pos = [100, 101, 30, 3, 150, 20, 159]
    case = make_case(T, Hi, D, R, P, bs, pos, req, seed=1, unmapped=[(2, 3)])
    q, w, k, bt, tr, tp = case
    got = indexer_topk_reference(*case, bs, topk)
    assert got.dtype == torch.int32 and got.shape == (T, topk)
    for t in range(T):
        if req[t] < 0:
            assert (got[t] == -1).all()
            continue
        sc = dense_scores64(q[t], w[t], k, bt, req[t], pos[t], bs)
        check_row(got[t].tolist(), sc, topk, tol=1e-4)
    # unmapped page 3 of request 2 is never selected
    assert not ((got[4:] >= 48) & (got[4:] < 64)).any()


def test_short_context_selects_everything_and_ties_by_position():
    # one head, q orthogonal-ish: many exact-zero ReLU scores -> ties broken by lower position
    T, Hi, D, bs, topk = 2, 1, 8, 4, 32
    k = torch.randn(64, D)
    q = torch.zeros(T, Hi, D)
    q[:, 0, 0] = 1.0
    k[:, 0] = -k[:, 0].abs()            # every dot <= 0 ...
    k[5, 0] = 2.0                       # ... except position 5 (block 1 maps rows 4..7)
    bt = torch.arange(16, dtype=torch.int32).view(1, 16)
    w = torch.ones(T, Hi)
    tr = torch.tensor([0, 0], dtype=torch.int32)
    tp = torch.tensor([20, 40], dtype=torch.int32)
    got = indexer_topk_reference(q, w, k, bt, tr, tp, bs, topk)
    assert got[0].tolist() == [5] + [p for p in range(21) if p != 5] + [-1] * (topk - 21)
    assert got[1].tolist() == [5] + [p for p in range(33) if p != 5][:topk - 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_interpreter_matches_reference(triton_cpu, dtype):
    T, Hi, D, R, P, bs, topk = 6, 8, 32, 3, 12, 16, 64
    req = [0, 0, 1, -1, 2, 2]
    pos = [150, 151, 20, 5, 100, 191]
    case = make_case(T, Hi, D, R, P, bs, pos, req, seed=2, dtype=dtype, unmapped=[(2, 1)])
    q, w, k, bt, tr, tp = case
    out = torch.full((T, topk), SENTINEL, dtype=torch.int32)
    got = indexer_topk(*case, bs, topk, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not (got == SENTINEL).any()
    ref = indexer_topk_reference(*case, bs, topk)
    for t in range(T):
        if req[t] < 0:
            assert (got[t] == -1).all()
            continue
        sc = dense_scores64(q[t].float(), w[t], k.float(), bt, req[t], pos[t], bs)
        check_row(got[t].tolist(), sc, topk, tol=1e-3)
    # exact agreement except possibly at numerical near-ties
    assert (got == ref).float().mean() > 0.95


@pytest.mark.parametrize("rows", [6, 4])
def test_triton_interpreter_ascending_first(triton_cpu, rows, monkeypatch):
    """``ascending_first=k`` of a ranked top k + band: the k ascending, the band still ranked,
    the same as the ranked call's parts. With a workspace counted over its key rows (poisoned:
    the count clears its bitmap), in passes of fewer rows than tokens at 4 rows; without one
    sorted."""
    from hisparse.ops import IndexerWorkspace
    from hisparse.ops.topk import column_order_reference

    T, Hi, D, R, P, bs, k, band = 6, 8, 32, 3, 12, 16, 24, 16
    case = make_case(T, Hi, D, R, P, bs, [150, 151, 20, 5, 100, 191], [0, 0, 1, -1, 2, 2],
                     seed=4)
    ranked = indexer_topk(*case, bs, k + band)
    ws = IndexerWorkspace(rows, P * bs, "cpu")
    ws.keys.fill_(-123456)
    ws.keys.view(-1)[::7] = 0x7FFFFFFF
    out = torch.full((T, k + band), SENTINEL, dtype=torch.int32)
    import hisparse.ops.indexer as indexer_mod
    scratch_rows = []    # the count's scratch: the workspace's key rows, every pass
    real = indexer_mod.column_order

    def spy(sel, out=None, bits=None, width=0):
        scratch_rows.append(None if bits is None else (bits.data_ptr(), bits.shape[0], width))
        return real(sel, out, bits, width)
    monkeypatch.setattr(indexer_mod, "column_order", spy)
    got = indexer_topk(*case, bs, k + band, out=out, workspace=ws, ascending_first=k)
    monkeypatch.undo()
    passes = -(-T // rows)
    assert scratch_rows == [(ws.keys.data_ptr(), min(rows, T - i * rows), P * bs)
                            for i in range(passes)]
    assert torch.equal(got[:, :k], column_order_reference(ranked[:, :k]))
    assert torch.equal(got[:, k:], ranked[:, k:])
    assert not torch.equal(got[:, :k], ranked[:, :k])
    assert torch.equal(indexer_topk(*case, bs, k + band, ascending_first=k), got)
    with pytest.raises(ValueError, match="ascending_first must be >= 0"):
        indexer_topk(*case, bs, k, ascending_first=-1)


def test_triton_interpreter_ties(triton_cpu):
    T, Hi, D, bs, topk = 1, 1, 16, 4, 16
    k = torch.randn(64, D)
    k[:, 0] = -k[:, 0].abs()
    k[9, 0] = 3.0
    q = torch.zeros(T, Hi, D)
    q[0, 0, 0] = 1.0
    bt = torch.arange(16, dtype=torch.int32).view(1, 16)
    got = indexer_topk(q, torch.ones(T, Hi), k, bt, torch.tensor([0], dtype=torch.int32),
                       torch.tensor([50], dtype=torch.int32), bs, topk)
    assert got[0].tolist() == [9] + [p for p in range(16) if p != 9][:15]


@pytest.mark.gpu
@pytest.mark.parametrize("keys", ["bf16", "fp8"])
@pytest.mark.parametrize("ctx", [3000, 8192, 32768])
def test_gpu_production_shape(ctx, keys, kernel_switches, selection_overlap):
    """Batch 64, 64 heads, D 128, top-k 2048 against the reference and a float64 oracle;
    ``fp8``: page-split FP8 keys (the oracle scores their dequantized, rotated values against
    the rotated, dequantized FP8 queries)."""
    kernel_switches(fp8_indexer=True)  # FP8 keys: the FP8-query path (default)
    T, Hi, D, bs, topk = 64, 64, 128, 64, 2048
    P = (ctx + bs - 1) // bs + 1
    R = T
    g = torch.Generator().manual_seed(3)
    pos = torch.randint(ctx // 2, ctx, (T,), generator=g).tolist()
    pos[0] = 100                       # short context: everything selected
    case = make_case(T, Hi, D, R, P, bs, pos, list(range(T)), seed=4, dtype=torch.bfloat16,
                     device="cuda")
    q, w, k, bt, tr, tp = case
    tr[5] = -1
    cache = k
    if keys == "fp8":
        from hisparse.ops.indexer import fp8_key_queries_reference
        from hisparse.ops.quant import (
            FP8KeyLayout,
            dequantize_index_keys_reference,
            quantize_index_keys_reference,
        )
        rows8 = quantize_index_keys_reference(k)
        cache = FP8KeyLayout(D, bs).pages(rows8)
        k = dequantize_index_keys_reference(rows8, D, torch.bfloat16)
        del rows8
        qo = fp8_key_queries_reference(q)       # rotated and FP8, as the keys
    else:
        qo = q
    out = torch.full((T, topk), SENTINEL, dtype=torch.int32, device="cuda")
    got = indexer_topk(q, w, cache, bt, tr, tp, bs, topk, out=out)
    ref = indexer_topk_reference(q, w, cache, bt, tr, tp, bs, topk)
    torch.cuda.synchronize()
    assert not (got == SENTINEL).any()
    assert (got[5] == -1).all()
    # scores in float64 for all positions of each token
    for t in [0, 1, 17, 63]:
        r = t
        S = pos[t] + 1
        s = torch.arange(S, device="cuda")
        rows = bt[r, s // bs].long() * bs + s % bs
        sc = (w[t].double()[:, None] * (qo[t].double() @ k[rows].double().T).clamp(min=0)).sum(0)
        sel = got[t][got[t] >= 0].long()
        assert sel.numel() == min(topk, S)
        assert len(set(sel.tolist())) == sel.numel()
        if S > topk:
            thr = sc[sel].min()
            mask = torch.ones(S, dtype=torch.bool, device="cuda")
            mask[sel] = False
            assert sc[mask].max() <= thr + 1e-3 * sc.abs().max()
    # rank order is not compared: with FP8 queries the kernel's FP8 MMA and the reference's
    # fp32 sums round near-ties differently (the oracle bound above holds for every token)
    overlap = selection_overlap(got, ref)
    assert overlap > (0.99 if keys == "bf16" else 0.97), overlap


@pytest.mark.parametrize("group", [1, 4])
def test_triton_interpreter_exact_with_ties_and_token_groups(triton_cpu, group):
    """Small-integer queries, keys and power-of-two weights: every score is exact in fp32, so
    the Triton path (int32 keys, radix top-k) must equal the reference bit for bit, with heavy
    ties (many equal and zero scores). Token groups mix requests, padding and lengths; every
    column past a token's length is never written (a poisoned workspace stays poisoned)."""
    from hisparse.ops import IndexerWorkspace

    g = torch.Generator().manual_seed(group)
    T, Hi, D, bs, P = 7, 4, 16, 8, 6
    q = torch.randint(-2, 3, (T, Hi, D), generator=g).float()
    w = torch.tensor([0.5, 1.0, -1.0, 2.0])[torch.randint(0, 4, (T, Hi), generator=g)]
    k = torch.randint(-2, 3, (4 * P * bs, D), generator=g).float()
    bt = torch.randperm(4 * P, generator=g)[:3 * P].view(3, P).to(torch.int32)
    bt[1, 2] = -1
    req = torch.tensor([0, 0, 1, 1, 1, -1, 2], dtype=torch.int32)
    pos = torch.tensor([47, 30, 45, 5, 20, 9, 40], dtype=torch.int32)
    ws = IndexerWorkspace(8, 64, "cpu")
    ws.keys.fill_(-5)
    topk = 12                               # below most lengths, above two
    out = torch.full((T, topk), SENTINEL, dtype=torch.int32)
    got = indexer_topk(q, w, k, bt, req, pos, bs, topk, out=out, workspace=ws, group=group)
    ref = indexer_topk_reference(q, w, k, bt, req, pos, bs, topk)
    assert torch.equal(got, ref)
    assert (ref[1] >= 0).all() and (ref[3] == -1).any()
    lens = torch.where(req >= 0, pos + 1, 0)
    past = torch.arange(64)[None, :] >= lens[:, None]
    assert (ws.keys[:T][past] == -5).all()
    assert torch.equal(ws.lengths[:T], lens)


def _small_ints(shape, g, keys, device="cpu"):
    """Small integers; for FP8 keys in the rotated basis (FP8 keys and the queries scored
    against them are rotated first, ``ops.rotation``): with D = 64 the rotation is exact both
    ways (``H @ H = 64 I``, scale 1/8), so the stored keys and quantized queries are the
    integers themselves."""
    x = torch.randint(-2, 3, shape, generator=g, device=device).float()
    if keys == "fp8":
        from hisparse.ops.rotation import indexer_rotation
        x = indexer_rotation(x)
    return x.to(torch.bfloat16)


def _integer_case(T, group, ctx, keys, seed, device="cuda", bs=64, Hi=64, D=None):
    """Production geometry (D 128; 64 for FP8 keys, see ``_small_ints``) with small-integer q
    and keys and power-of-two weights: every score is exact in fp32 (bf16 tensor-core dots
    included; FP8 keys and queries quantize them exactly), with heavy ties. Tokens come in runs
    of ``group`` per request (MTP verify)."""
    D = D or (64 if keys == "fp8" else 128)
    g = torch.Generator().manual_seed(seed)
    R = max(1, T // group)
    P = ctx // bs
    q = _small_ints((T, Hi, D), g, keys)
    w = torch.tensor([0.25, 0.5, -0.5, 1.0])[torch.randint(0, 4, (T, Hi), generator=g)]
    bt = torch.randperm(R * P, generator=g).view(R, P).to(torch.int32)
    bt[0, 3] = -1                                           # an unmapped page
    req = (torch.arange(T) // group).clamp(max=R - 1).to(torch.int32)
    base = torch.randint(ctx // 2, ctx - group, (R,), generator=g)
    base[0] = 100                                           # everything selected
    pos = (base[req.long()] + torch.arange(T) % group).to(torch.int32)
    req[T // 2] = -1                                        # padding
    k = _small_ints((R * P * bs, D), None, keys, device)     # large: made on the device
    if keys == "fp8":
        from hisparse.ops.quant import FP8KeyLayout, quantize_index_keys_reference
        k = FP8KeyLayout(D, bs).pages(quantize_index_keys_reference(k))
    return (q.to(device), w.to(device), k, bt.to(device), req.to(device), pos.to(device)), bs


@pytest.mark.gpu
@pytest.mark.parametrize("keys", ["bf16", "fp8"])
@pytest.mark.parametrize("ctx", [32768, 131072])
@pytest.mark.parametrize("T,group", [(8, 1), (64, 1), (64, 2)])
def test_gpu_exact_vs_reference(ctx, T, group, keys):
    """Bit-exact against the reference at 32k and 128k, top-k 2048, batch 8 and 64, token
    groups of 2 (the group hint changes only how keys are shared, never a selection)."""
    case, bs = _integer_case(T, group, ctx, keys, seed=ctx + T + group)
    topk = 2048
    out = torch.full((T, topk), SENTINEL, dtype=torch.int32, device="cuda")
    got = indexer_topk(*case, bs, topk, out=out, group=group)
    ref = indexer_topk_reference(*case, bs, topk)
    assert torch.equal(got, ref)


@pytest.mark.gpu
def test_gpu_cuda_graphs_ascending_buckets_then_grow_and_shrink():
    """indexer_topk captured per batch bucket in ascending order with one workspace (as the
    caches own it), replayed growing and shrinking on fresh queries and lengths: the eager
    selections (and the reference's: integer scores are exact)."""
    from hisparse.ops import IndexerWorkspace

    buckets, ctx, topk = [8, 16, 32, 64], 32768, 2048
    Tm = max(buckets)
    case, bs = _integer_case(Tm, 1, ctx, "fp8", seed=5)
    q, w, k, bt, req, pos = case
    W = bt.shape[1] * bs
    ws = IndexerWorkspace(Tm, W, "cuda")
    outs = {b: torch.empty((b, topk), dtype=torch.int32, device="cuda") for b in buckets}

    def call(b):
        indexer_topk(q[:b], w[:b], k, bt, req[:b], pos[:b], bs, topk, out=outs[b], workspace=ws)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for b in buckets:
            call(b)
    torch.cuda.current_stream().wait_stream(stream)
    graphs = {}
    for b in buckets:
        graphs[b] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[b]):
            call(b)
    g = torch.Generator().manual_seed(9)
    for i, b in enumerate([8, 32, 64, 16, 8, 64]):
        q.copy_(_small_ints(tuple(q.shape), g, "fp8"))
        pos.copy_(torch.randint(1, W, (Tm,), generator=g).to(torch.int32))
        pos[0] = 1000 + i                                   # below top-k: everything
        outs[b].fill_(SENTINEL)
        graphs[b].replay()
        eager = indexer_topk(q[:b], w[:b], k, bt, req[:b], pos[:b], bs, topk)
        assert torch.equal(outs[b], eager), (i, b)
        assert torch.equal(outs[b], indexer_topk_reference(q[:b], w[:b], k, bt, req[:b],
                                                           pos[:b], bs, topk)), (i, b)


def test_triton_interpreter_scoring_programs_stride(triton_cpu):
    """Several programs per token group striding over its blocks write the same keys and
    lengths as one program walking them all (and nothing past a token's length)."""
    from hisparse.ops._indexer_triton import indexer_keys

    g = torch.Generator().manual_seed(3)
    T, Hi, D, bs, P = 3, 4, 16, 8, 12
    q = torch.randn(T, Hi, D, generator=g)
    w = torch.rand(T, Hi, generator=g)
    k = torch.randn(P * bs, D, generator=g)
    bt = torch.arange(P, dtype=torch.int32).view(1, P)
    bt[0, 4] = -1
    req = torch.tensor([0, -1, 0], dtype=torch.int32)
    pos = torch.tensor([90, 50, 60], dtype=torch.int32)
    outs = []
    for cfg in [(16, 1, 4, 1), (16, 3, 4, 1)]:
        keys = torch.full((T, P * bs), SENTINEL, dtype=torch.int32)
        lens = torch.full((T,), SENTINEL, dtype=torch.int32)
        indexer_keys(q, w, k, bt, req, pos, bs, config=cfg, out=keys, lengths=lens)
        outs.append((keys, lens))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    keys, lens = outs[0]
    assert lens.tolist() == [91, 0, 61]
    assert (keys[0, :91] != SENTINEL).all() and (keys[0, 91:] == SENTINEL).all()
    assert (keys[1] == SENTINEL).all() and (keys[0, 32:40] == -(2**31)).all()
