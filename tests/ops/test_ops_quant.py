"""FP8 KV format: quantize/dequantize spec, Triton quantize-and-write (bit-exact), FP8 sparse
attention and FP8 indexer scoring (Triton under the interpreter vs the reference; GPU at
production shapes; FlashMLA's FP8 decode vs the Triton kernel)."""

import dataclasses

import pytest
import torch

from hisparse import ops
from hisparse.ops import quant as Q
from hisparse.ops.rotation import indexer_rotation


def _flashmla_style_quantize(x: torch.Tensor, d_nope: int) -> torch.Tensor:
    """FlashMLA tests/quant.py formula (log2/ceil), re-derived: the format's definition."""
    tile = min(128, d_nope)
    T = x.shape[0]
    out = []
    scales = []
    for i in range(d_nope // tile):
        part = x[:, i * tile:(i + 1) * tile].float()
        s = torch.pow(2, torch.clamp_min(part.abs().amax(-1) / 448.0, 1e-4).log2().ceil())
        scales.append(s)
        out.append((part / s[:, None]).to(torch.float8_e4m3fn).view(torch.uint8))
    rope = x[:, d_nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    sc = torch.stack(scales, 1).contiguous().view(torch.uint8)
    return torch.cat(out + [sc.reshape(T, -1), rope.reshape(T, -1)], dim=1)


def _rows(T, D, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g) * torch.logspace(-5, 4, T)[:, None]
    x[0] = 0.0                                  # all-zero row: scale clamps to 2^-13
    x[1, :7] = 448.0 * 2.0 ** 3                 # amax / 448 an exact power of two
    x[2, 3] = -1e-30                            # tiny values: e4m3 subnormals / zero
    return x.to(dtype)


def test_format_sizes():
    assert Q.mla_row_bytes(512, 64) == 656 and Q.index_key_bytes(128) == 132
    assert Q.mla_row_bytes(32, 16) == 32 + 4 + 32 and Q.index_key_bytes(32) == 36
    with pytest.raises(ValueError):
        Q.fp8_tile(384)                        # 3 tiles: not a power of two


@pytest.mark.parametrize("d_nope,d_rope", [(512, 64), (32, 16)])
def test_quantize_reference_matches_flashmla_formula_and_round_trips(d_nope, d_rope):
    x = _rows(24, d_nope + d_rope)
    q = Q.quantize_mla_rows_reference(x, d_nope)
    assert q.dtype == torch.uint8 and q.shape == (24, Q.mla_row_bytes(d_nope, d_rope))
    assert torch.equal(q, _flashmla_style_quantize(x, d_nope))
    deq = Q.dequantize_mla_rows_reference(q, d_nope, d_rope)
    tile = min(128, d_nope)
    xt = x.float()[:, :d_nope].reshape(24, -1, tile)
    err = (deq[:, :d_nope].reshape(24, -1, tile) - xt).abs()
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 of the value; absolute <= the tile amax/16
    assert (err <= xt.abs().amax(-1, keepdim=True) / 16 + 1e-30).all()
    assert torch.equal(deq[:, d_nope:], x.float()[:, d_nope:])       # rope exact (bf16)
    assert torch.equal(Q.dequantize_mla_rows_reference(q, d_nope, d_rope, torch.bfloat16).float(),
                       deq)


def test_index_key_round_trip():
    """An FP8 key stores the rotated key (ops.rotation): dequantized, it is ``indexer_rotation(k)``
    within e4m3's error, and rotating it back gives ``k`` within that error's norm (the rotation
    is orthogonal) plus the bf16 rounding of the rotated key."""
    k = _rows(16, 128, seed=3)
    b = Q.quantize_index_keys_reference(k)
    assert b.shape == (16, 132)
    back = Q.dequantize_index_keys_reference(b, 128)
    rk = indexer_rotation(k).float()
    assert ((back - rk).abs() <= rk.abs().amax(-1, keepdim=True) / 16 + 1e-30).all()
    err = (indexer_rotation(back) - k.float()).norm(dim=-1)
    assert (err <= (back - rk).norm(dim=-1) * 1.001 + k.float().norm(dim=-1) * 2 ** -8
            + 1e-30).all()


@pytest.mark.parametrize("D,bs", [(128, 64), (128, 4), (32, 8), (256, 4), (128, 1)])
def test_fp8_key_pages_layout(D, bs):
    """Page-split keys: per page the [bs, D] e4m3 values, then the [bs, n_tiles] fp32 scales;
    the byte offsets of the layout helper, its views, gather/scatter and pages() agree, and
    132 B per key (for D = 128) hold."""
    lay = Q.FP8KeyLayout(D, bs)
    nblk = 5
    keys = Q.quantize_index_keys_reference(_rows(nblk * bs, D, seed=D + bs))
    kb = Q.index_key_bytes(D)
    assert lay.key_bytes == kb and lay.page_bytes == bs * kb
    pages = lay.pages(keys)
    assert pages.shape == lay.shape(nblk) == (nblk, bs * kb)
    assert Q.FP8KeyLayout.of(pages, D) == lay
    flat = pages.reshape(-1)
    rows = torch.randperm(nblk * bs)
    vo, so = lay.value_offset(rows), lay.scale_offset(rows)
    for r, v, s in zip(rows.tolist(), vo.tolist(), so.tolist()):
        assert (v // (bs * kb), v % (bs * kb)) == (r // bs, (r % bs) * D)
        assert torch.equal(flat[v:v + D], keys[r, :D])
        assert torch.equal(flat[s:s + kb - D], keys[r, D:])
        if bs % 4 == 0:
            assert v % 16 == 0                           # 16-B aligned values
    values, scales = lay.planes(pages)
    assert values.shape == (nblk, bs, D) and scales.shape == (nblk, bs, kb - D)
    assert values.data_ptr() == pages.data_ptr() and scales.data_ptr() == pages.data_ptr() + bs * D
    assert torch.equal(lay.gather(pages, rows), keys[rows])
    # scatter into a poisoned cache (packed layers: layer 1 only), untouched bytes stay
    cache = torch.full((3, nblk + 1, bs * kb), 0xAB, dtype=torch.uint8)
    sub = rows[:max(1, len(rows) // 2)]
    lay.scatter(cache[1], sub, keys[sub])
    assert torch.equal(lay.gather(cache[1], sub), keys[sub])
    assert (cache[0] == 0xAB).all() and (cache[2] == 0xAB).all()
    assert (cache[1] != 0xAB).sum() <= sub.numel() * kb
    deq = Q.dequantize_index_keys_reference(lay.gather(pages, rows), D)
    assert torch.equal(deq, Q.dequantize_index_keys_reference(keys[rows], D))
    if bs == 1:                                          # block size 1 is the row format
        assert torch.equal(pages, keys)


def test_fp8_key_pages_are_checked():
    with pytest.raises(ValueError, match="uint8"):
        Q.FP8KeyLayout.of(torch.zeros(4, 132 * 4), 128)
    with pytest.raises(ValueError, match="block_size"):
        Q.FP8KeyLayout.of(torch.zeros(4, 130 * 4, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match="aligned"):
        Q.FP8KeyLayout.of(torch.zeros(4 * 528 + 1, dtype=torch.uint8)[1:].view(4, 528), 128)
    lay = Q.FP8KeyLayout(128, 4)
    with pytest.raises(ValueError, match="block_size"):
        lay.planes(torch.zeros(4, 132 * 8, dtype=torch.uint8))
    with pytest.raises(ValueError):
        ops.quantize_write_index_keys(torch.randn(2, 128),
                                      torch.zeros(2, 4, 528, dtype=torch.uint8),
                                      torch.tensor([0, 1]))


@pytest.mark.parametrize("d_nope,d_rope,dtype",
                         [(512, 64, torch.bfloat16), (32, 16, torch.float32)])
def test_triton_quantize_write_is_bit_exact(triton_cpu, d_nope, d_rope, dtype):
    x = _rows(9, d_nope + d_rope, seed=5, dtype=dtype)
    rb = Q.mla_row_bytes(d_nope, d_rope)
    dst = torch.zeros(3, 20, rb, dtype=torch.uint8)         # packed layers: write layer 1 only
    rows = torch.tensor([4, 0, 19, 7, 8, 9, 1, 2, 3])
    ops.quantize_write_mla_rows(x, dst[1], rows, d_nope)
    assert torch.equal(dst[1][rows], Q.quantize_mla_rows_reference(x, d_nope))
    assert not dst[0].any() and not dst[2].any()
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[rows] = False
    assert not dst[1][untouched].any()
    k = _rows(9, 128, seed=6, dtype=dtype)
    for bs in (1, 4):                      # row format (block size 1) and page-split keys
        lay = Q.FP8KeyLayout(128, bs)
        kd = torch.zeros(3, 20 // bs, lay.page_bytes, dtype=torch.uint8)
        ops.quantize_write_index_keys(k, kd[1], rows)
        assert torch.equal(lay.gather(kd[1], rows), Q.quantize_index_keys_reference(k))
        assert not kd[0].any() and not kd[2].any()
        written = torch.zeros_like(kd[1]).view(-1)
        for r in rows.tolist():
            v, sc = lay.value_offset(torch.tensor(r)), lay.scale_offset(torch.tensor(r))
            written[v:v + 128] = 1
            written[sc:sc + 4] = 1
        assert not kd[1].view(-1)[written == 0].any()


@pytest.mark.parametrize("D,bs", [(128, 8), (32, 4)])
def test_quantize_write_index_keys_reference_pages(no_force, D, bs):
    k = _rows(7, D, seed=9)
    lay = Q.FP8KeyLayout(D, bs)
    kd = torch.full((2, 6, lay.page_bytes), 0x5A, dtype=torch.uint8)
    rows = torch.tensor([3, 0, 6 * bs - 1, bs, bs + 1, 2 * bs + 2, 4 * bs + 3])
    ops.quantize_write_index_keys(k, kd[0], rows)
    assert torch.equal(lay.gather(kd[0], rows), Q.quantize_index_keys_reference(k))
    assert (kd[1] == 0x5A).all()
    assert (kd[0] != 0x5A).sum() <= 7 * lay.key_bytes


def _fp8_case(T, H, K, N, d_nope=512, d_rope=64, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(N, d_nope + d_rope, generator=g)
    rows = Q.quantize_mla_rows_reference(kv, d_nope)
    rows[N // 2:] = 0x7F                      # e4m3 NaN / garbage: never referenced
    q = torch.randn(T, H, d_nope + d_rope, generator=g).to(dtype)
    idx = torch.randint(0, N // 2, (T, K), generator=g).to(torch.int32)
    idx[torch.rand(T, K, generator=g) < 0.25] = -1
    idx[min(1, T - 1)] = -1                   # a token with no valid index
    return q.to(device), rows.to(device), idx.to(device)


def test_fp8_reference_is_attention_over_dequantized_rows():
    q, rows, idx = _fp8_case(3, 4, 40, 80, dtype=torch.float32)
    o, l = ops.sparse_mla_attention_fp8_reference(q, rows, idx, 0.05)
    deq = Q.dequantize_mla_rows_reference(rows[:40], 512, 64)
    ro, rl = ops.sparse_mla_attention_reference(q, deq, idx, 0.05)
    assert torch.allclose(o, ro, atol=1e-6) and torch.equal(torch.isneginf(l), torch.isneginf(rl))
    assert (o[1] == 0).all() and torch.isneginf(l[1]).all()
    # the dispatcher routes uint8 rows to the FP8 path
    o2, _ = ops.sparse_mla_attention(q, rows, idx, 0.05, backend="reference")
    assert torch.equal(o, o2)


@pytest.mark.parametrize("T,H,K,d_nope,d_rope,dtype", [
    (3, 4, 40, 32, 16, torch.float32), (2, 16, 64, 512, 64, torch.bfloat16),
    (2, 20, 40, 512, 64, torch.float32)])
def test_fp8_attention_triton_interpreter(triton_cpu, T, H, K, d_nope, d_rope, dtype):
    q, rows, idx = _fp8_case(T, H, K, 2 * K, d_nope, d_rope, dtype, seed=K)
    o, l = ops.sparse_mla_attention_fp8(q, rows, idx, 0.07, d_v=d_nope, backend="triton")
    ro, rl = ops.sparse_mla_attention_fp8_reference(q, rows, idx, 0.07, d_v=d_nope)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (o.float() - ro.float()).abs().max() < tol
    assert torch.equal(torch.isneginf(l), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert (l[fin] - rl[fin]).abs().max() < 1e-4


def _fp8_triton(q, rows, idx, **cfg):
    from hisparse.ops._attention_triton import attn_config, sparse_mla_attention_fp8_triton

    base = attn_config(q.shape[1], idx.shape[1], True, q.dtype == torch.float32 or not q.is_cuda)
    cfg = dataclasses.replace(base, **cfg) if cfg else None
    return sparse_mla_attention_fp8_triton(q, rows, idx, 576 ** -0.5, config=cfg)


def _check_batch_invariant(q, rows, idx, cuts):
    """Each token's output is the same bits alone, in any sub-batch and in the whole batch
    (the lossless contract: a spilled run batches differently), and ``num_stages`` (speed
    only; the interpreter ignores it) does not change them."""
    o, l = _fp8_triton(q, rows, idx)
    for a, b in cuts:
        oa, la = _fp8_triton(q[a:b].contiguous(), rows, idx[a:b].contiguous())
        assert torch.equal(oa, o[a:b]) and torch.equal(la, l[a:b]), (a, b)
    for stages in (1, 3) if q.is_cuda else ():
        op, lp = _fp8_triton(q, rows, idx, num_stages=stages)
        assert torch.equal(op, o) and torch.equal(lp, l), stages
    return o, l


def test_fp8_attention_batch_invariant_and_sliced_interpreter(triton_cpu, monkeypatch):
    """K = 90: two chunks, the last with a partial block; then launches over token slices
    (a partials budget of one token) give the same bits, into a poisoned output."""
    from hisparse.ops import _attention_triton as AT

    q, rows, idx = _fp8_case(4, 16, 90, 180, dtype=torch.bfloat16, seed=3)
    o, l = _check_batch_invariant(q, rows, idx, [(0, 1), (1, 4)])
    assert AT.attn_config(16, 90, True, True).splits(90) == 2
    kv = Q.dequantize_mla_rows_reference(rows, 512, 64, dtype=torch.bfloat16)
    ob, lb = AT.sparse_mla_attention_triton(q, kv, idx, 576 ** -0.5)       # the bf16 kernel
    monkeypatch.setattr(AT, "PARTIAL_BYTES", 1)
    for run, want in ((AT.sparse_mla_attention_fp8_triton, (o, l, rows)),
                      (AT.sparse_mla_attention_triton, (ob, lb, kv))):
        out = torch.full_like(want[0], float("nan"))
        lse = torch.full_like(want[1], float("nan"))
        run(q, want[2], idx, 576 ** -0.5, out=out, lse=lse)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), run.__name__


def _with_empty_chunks(idx: torch.Tensor, pad_tokens: int) -> torch.Tensor:
    """``idx`` with its last ``pad_tokens`` tokens all ``-1`` (padding), token 0's second
    chunk-sized stretch all ``-1`` and token 2's first past ``N`` (invalid too)."""
    from hisparse.ops._attention_triton import attn_config

    idx = idx.clone()
    kps = attn_config(16, idx.shape[1], True, not idx.is_cuda).k_per_split
    idx[-pad_tokens:] = -1
    idx[0, kps:2 * kps] = -1
    idx[2, :kps] = 1 << 30
    return idx


class _NanEmpty:
    """``torch`` as ``hisparse.ops._attention_triton`` sees it, with ``empty`` NaN-filled: the
    chunk partials start as garbage, which the merge must not read where nothing was stored."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kw):
        t = torch.empty(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t


def _check_skip_is_bit_neutral(q, rows, idx, monkeypatch):
    """Chunks with nothing to read skip their work: the same bits as running them, written
    into poisoned outputs from poisoned chunk partials, with one chunk (the kernel writes the
    result) and several."""
    from hisparse.ops import _attention_triton as AT

    monkeypatch.setattr(AT, "torch", _NanEmpty())
    run = AT.sparse_mla_attention_fp8_triton
    for K in (idx.shape[1], 16):
        i = idx[:, :K].contiguous()
        outs = []
        for skip in (True, False):
            out = torch.full(q.shape[:2] + (512,), float("nan"), dtype=q.dtype, device=q.device)
            lse = torch.full(q.shape[:2], float("nan"), device=q.device)
            outs.append(run(q, rows, i, 576 ** -0.5, out=out, lse=lse, skip_empty=skip))
        (o, l), (o_run, l_run) = outs
        assert torch.equal(o, o_run) and torch.equal(l, l_run), K
        assert not torch.isnan(o).any() and (o[-1] == 0).all() and torch.isneginf(l[-1]).all()
        ro, rl = ops.sparse_mla_attention_fp8_reference(q, rows, i, 576 ** -0.5)
        assert (o.float() - ro.float()).abs().max() < 2e-2, K
        assert torch.equal(torch.isneginf(l), torch.isneginf(rl)), K


def test_fp8_attention_skips_empty_chunks_bit_neutral_interpreter(triton_cpu, monkeypatch):
    q, rows, idx = _fp8_case(5, 16, 90, 180, dtype=torch.bfloat16, seed=11)
    _check_skip_is_bit_neutral(q, rows, _with_empty_chunks(idx, 2), monkeypatch)


def test_attn_config_depends_on_heads_and_indices_only():
    from hisparse.ops._attention_triton import MAX_SPLITS, AttnConfig, _check_config, attn_config

    for fp8 in (True, False):
        for H in (8, 16, 32, 64, 128):
            for K in (1, 60, 64, 300, 2000, 2048, 4096, 16384):
                c = attn_config(H, K, fp8, False)
                _check_config(c, fp8)
                assert 1 <= c.splits(K) <= MAX_SPLITS, (H, K, c)
                assert c.k_per_split <= -(-K // c.block_n) * c.block_n     # no empty chunk
    assert attn_config(16, 2048, True, False).splits(2048) == 32
    assert attn_config(16, 4096, True, False).splits(4096) == 32        # chunks grow
    for bad, fp8 in [(AttnConfig(16, 48, 4, 2, 96), True), (AttnConfig(16, 32, 4, 2, 48), True),
                     (AttnConfig(16, 32, 4, 2, 0), True), (AttnConfig(16, 32, 4, 2, 64, 256), True),
                     (AttnConfig(16, 32, 4, 2, 64, 384), False)]:
        with pytest.raises(ValueError, match="AttnConfig"):
            _check_config(bad, fp8)


@pytest.mark.parametrize("D,dtype,bs", [(32, torch.float32, 8), (128, torch.bfloat16, 8),
                                        (256, torch.float32, 4), (128, torch.float32, 16)])
def test_fp8_indexer_triton_interpreter(kernel_switches, triton_cpu, D, dtype, bs):
    """Page-split FP8 keys: Triton (FP8 queries; one e4m3 dot per key tile, scales after the
    dot; 2 tiles for D = 256: dequantized queries) == the reference over the same pages == the
    reference over dequantized keys and dequantized FP8 queries. Pages no table maps hold NaN
    bytes, the output starts poisoned."""
    kernel_switches(fp8_indexer=True)  # the FP8-query path (default)
    g = torch.Generator().manual_seed(D + bs)
    lay = Q.FP8KeyLayout(D, bs)
    rows = Q.quantize_index_keys_reference(torch.randn(12 * bs, D, generator=g))
    keys = lay.pages(rows)
    keys[7:] = 0x7F                                    # e4m3 NaN: pages 7.. are never mapped
    bt = torch.tensor([[3, 1, 5, -1], [0, 2, 4, 6]], dtype=torch.int32)
    q = torch.randn(4, 32, D, generator=g).to(dtype)
    w = torch.rand(4, 32, generator=g)
    req = torch.tensor([0, 1, -1, 1], dtype=torch.int32)
    pos = torch.tensor([3 * bs - 5, 4 * bs - 2, 5, bs + 1], dtype=torch.int32)
    out = torch.full((4, 8), -7, dtype=torch.int32)
    got = ops.indexer_topk(q, w, keys, bt, req, pos, bs, 8, out=out)
    assert got.data_ptr() == out.data_ptr() and not (got == -7).any()
    kernel_switches(force_triton=False)
    want = ops.indexer_topk_reference(q, w, keys, bt, req, pos, bs, 8)
    assert torch.equal(got, want)
    assert (got[2] == -1).all() and not ((got[0] >= 3 * bs) & (got[0] < 4 * bs)).any()
    deq = Q.dequantize_index_keys_reference(rows, D)
    qd = Q.dequantize_index_queries_reference(*Q.quantize_index_queries_reference(q))
    assert torch.equal(ops.indexer_topk_reference(qd, w, deq, bt, req, pos, bs, 8), want)


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_quantize_write_bit_exact_production():
    x = _rows(4096, 576, seed=1).cuda()
    dst = torch.zeros(2, 8192, 656, dtype=torch.uint8, device="cuda")
    rows = torch.randperm(8192, device="cuda")[:4096]
    ops.quantize_write_mla_rows(x, dst[1], rows, 512)
    assert torch.equal(dst[1][rows].cpu(), Q.quantize_mla_rows_reference(x.cpu(), 512))
    k = _rows(4096, 128, seed=2).cuda()
    lay = Q.FP8KeyLayout(128, 64)
    kd = torch.zeros(2, 8192 // 64, lay.page_bytes, dtype=torch.uint8, device="cuda")
    ops.quantize_write_index_keys(k, kd[1], rows)
    assert torch.equal(lay.gather(kd[1], rows).cpu(), Q.quantize_index_keys_reference(k.cpu()))
    assert not kd[0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(64, 16), (64, 64), (64, 128), (3, 16), (257, 64)])
def test_gpu_fp8_attention_triton_production(T, H):
    q, rows, idx = _fp8_case(T, H, 2048, 64 * 2048, device="cuda", seed=H)
    o, l = ops.sparse_mla_attention_fp8(q, rows, idx, 576 ** -0.5, backend="triton")
    ro, rl = ops.sparse_mla_attention_fp8_reference(q, rows, idx, 576 ** -0.5)
    assert not torch.isnan(o).any()
    assert (o.float() - ro.float()).abs().max().item() < 2e-2
    assert torch.equal(torch.isneginf(l), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert (l[fin] - rl[fin]).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 64, 128])
def test_gpu_fp8_attention_batch_invariant(H):
    """Production shapes: 1 to 96 tokens of one batch, top-k 2048 (the engine's buckets)."""
    q, rows, idx = _fp8_case(96, H, 2048, 64 * 2048, device="cuda", seed=H + 3)
    _check_batch_invariant(q, rows, idx, [(0, 1), (5, 13), (0, 48), (17, 83)])
    # "auto" (the engine's call) is the invariant Triton kernel at every head count, FlashMLA
    # installed or not
    auto, _ = ops.sparse_mla_attention_fp8(q, rows, idx, 576 ** -0.5)
    assert torch.equal(auto, _fp8_triton(q, rows, idx)[0])


@pytest.mark.gpu
def test_gpu_fp8_attention_skips_empty_chunks_bit_neutral(monkeypatch):
    """A 48-token bucket holding 33 requests: 15 padding tokens, chunks of -1 mid-list."""
    q, rows, idx = _fp8_case(48, 16, 2048, 64 * 2048, device="cuda", seed=21)
    _check_skip_is_bit_neutral(q, rows, _with_empty_chunks(idx, 15), monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not ops.flashmla_available(), reason="flash_mla not importable")
@pytest.mark.parametrize("T,H", [(64, 64), (64, 128), (64, 16)])
def test_gpu_flashmla_fp8_matches_triton(T, H):
    q, rows, idx = _fp8_case(T, H, 2048, 64 * 2048, device="cuda", seed=H + 7)
    o, l = ops.sparse_mla_attention_fp8(q, rows, idx, 576 ** -0.5, backend="flashmla")
    to, tl_ = ops.sparse_mla_attention_fp8(q, rows, idx, 576 ** -0.5, backend="triton")
    assert (o.float() - to.float()).abs().max().item() < 2e-2
    valid = (idx >= 0).any(1)
    assert (o[~valid] == 0).all()
    assert (l[valid] - tl_[valid]).abs().max().item() < 1e-2


@pytest.mark.gpu
def test_gpu_fp8_indexer_production(kernel_switches, selection_overlap):
    kernel_switches(fp8_indexer=True)  # the FP8-query path (default)
    bs, P, R = 64, 1024, 2
    D = 128
    rows = Q.quantize_index_keys_reference(torch.randn(R * P * bs, D)).cuda()
    keys = Q.FP8KeyLayout(D, bs).pages(rows)
    bt = torch.arange(R * P, dtype=torch.int32, device="cuda").view(R, P)
    q = torch.randn(8, 64, D, device="cuda").bfloat16()
    w = torch.rand(8, 64, device="cuda")
    req = torch.tensor([0] * 4 + [1] * 4, dtype=torch.int32, device="cuda")
    pos = torch.tensor([60000, 60001, 60002, 60003, 3000, 3001, 3002, 65535], dtype=torch.int32,
                       device="cuda")
    got = ops.indexer_topk(q, w, keys, bt, req, pos, bs, 2048)
    deq = Q.dequantize_index_keys_reference(rows, D, torch.bfloat16)
    qd = Q.dequantize_index_queries_reference(*Q.quantize_index_queries_reference(q),
                                              torch.bfloat16)
    want = ops.indexer_topk(qd, w, deq, bt, req, pos, bs, 2048)   # bf16 Triton path
    # same products (dequantized keys and FP8 queries are exact in bf16), summed by the FP8 MMA
    # on one side and fp32 FMAs on the other: the same sets up to near-ties
    agree = selection_overlap(got, want)
    assert agree > 0.98, agree
