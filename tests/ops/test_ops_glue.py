"""Fused glue kernels (hisparse.ops.glue) against their unfused references.

CPU: the Triton kernels under the interpreter at small shapes; GPU (marker ``gpu``): the real
rank's shapes (hidden 7168, q_lora 1536, kv_lora 512 + rope 64, index head 128, 128 / 64 heads).
The RoPE parts and the residual sums have no reduction: they must match bitwise; the norms'
reductions run in another order, so normalised values may differ by about one ulp of the model
dtype (bf16: rtol 2**-7).
"""

import pytest
import torch

from hisparse.ops import glue, switches
from hisparse.ops.quant import (
    FP8KeyLayout,
    dequantize_index_keys_reference,
    dequantize_mla_rows_reference,
    index_key_bytes,
    mla_row_bytes,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16_TOL = dict(rtol=2 ** -7, atol=1e-5)


def _rope_tables(T, rope, dtype, device="cpu"):
    pos = torch.randint(0, 40000, (T,), device=device).float()
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2, device=device).float() / rope))
    f = pos[:, None] * inv[None]
    return (f.cos() * 1.1).to(dtype), (f.sin() * 1.1).to(dtype)


def _run_both(fn):
    """``fn()`` through the Triton dispatch, then through the references."""
    fused = fn()
    with switches.override(fused_glue=False):
        ref = fn()
    return fused, ref


# ----------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D,res", [(48, True), (200, False), (256, True)])
def test_add_rms_norm_matches_reference(triton_cpu, dtype, D, res):
    T = 5
    x = torch.randn(T, D, dtype=dtype) * 3
    r = torch.randn(T, D, dtype=dtype) if res else None
    w = (torch.rand(D) + 0.5).to(dtype)
    (y, h), (y_ref, h_ref) = _run_both(lambda: glue.add_rms_norm(x, r, w, 1e-6))
    assert torch.equal(h, h_ref)          # the residual sum: one rounding, as torch's add
    torch.testing.assert_close(y, y_ref, **BF16_TOL)
    y2, h2, y32 = glue.add_rms_norm(x, r, w, 1e-6, fp32_copy=True)
    assert y32.dtype == torch.float32 and torch.equal(y32, y2.float()) and torch.equal(y2, y)


def test_add_rms_norm_batch_invariant(triton_cpu):
    x, r = torch.randn(7, 96, dtype=torch.bfloat16), torch.randn(7, 96, dtype=torch.bfloat16)
    w = torch.rand(96, dtype=torch.bfloat16)
    y, h = glue.add_rms_norm(x, r, w, 1e-6)
    y1, h1 = glue.add_rms_norm(x[3:4], r[3:4], w, 1e-6)
    assert torch.equal(y[3:4], y1) and torch.equal(h[3:4], h1)


# ----------------------------------------------------------------------------- MLA rows
def _mla_inputs(T, R, rope, dtype, device="cpu"):
    kv = torch.randn(T, R + rope, dtype=dtype, device=device) * 2
    w = (torch.rand(R, device=device) + 0.5).to(dtype)
    cos, sin = _rope_tables(T, rope, dtype, device)
    return kv, w, cos, sin


@pytest.mark.parametrize("R,rope", [(32, 16), (48, 8)])
def test_write_mla_rows_float(triton_cpu, R, rope):
    T, N = 6, 20
    kv, w, cos, sin = _mla_inputs(T, R, rope, torch.bfloat16)
    rows = torch.randperm(N)[:T]
    poison = torch.randn(N, R + rope, dtype=torch.bfloat16)

    def run():
        dst = poison.clone()
        glue.write_mla_rows(kv, w, 1e-6, cos, sin, dst, rows, R)
        return dst

    got, ref = _run_both(run)
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(got[untouched], poison[untouched])
    assert torch.equal(got[rows, R:], ref[rows, R:])              # RoPE: bitwise
    torch.testing.assert_close(got[rows, :R], ref[rows, :R], **BF16_TOL)
    assert not torch.equal(ref[rows], poison[rows])


def test_write_mla_rows_fp8(triton_cpu):
    T, N, R, rope = 5, 12, 256, 32
    kv, w, cos, sin = _mla_inputs(T, R, rope, torch.bfloat16)
    rows = torch.randperm(N)[:T]
    poison = torch.randint(0, 256, (N, mla_row_bytes(R, rope)), dtype=torch.uint8)

    def run():
        dst = poison.clone()
        glue.write_mla_rows(kv, w, 1e-6, cos, sin, dst, rows, R)
        return dst

    got, ref = _run_both(run)
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(got[untouched], poison[untouched])
    g = dequantize_mla_rows_reference(got[rows], R, rope)
    r = dequantize_mla_rows_reference(ref[rows], R, rope)
    assert torch.equal(g[:, R:], r[:, R:])
    # one bf16 ulp in a normalised value may move its e4m3 code by one step (2**-3 relative)
    torch.testing.assert_close(g[:, :R], r[:, :R], rtol=2 ** -3, atol=2 ** -9)
    exact = mla_rows = glue.mla_rows_reference(kv, w, 1e-6, cos, sin, R).float()
    torch.testing.assert_close(g[:, :R], exact[:, :R], rtol=2 ** -3, atol=2 ** -6)
    assert mla_rows.shape == (T, R + rope)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("T,H", [(1, 3), (4, 2)])
def test_write_mla_rows_makes_the_query_in_the_same_launch(triton_cpu, poisoned_empty, fp8, T,
                                                           H):
    """``write_mla_rows(..., q_abs, q_pe)``: the rows are bitwise those of the call without the
    query and the query bitwise :func:`glue.mla_q_latent`'s own kernel's (and the reference's:
    no reduction), every element written (NaN-poisoned output); fresh data each run."""
    N, R, rope, nope = 10, 256 if fp8 else 32, 16, 8
    kv, w, cos, sin = _mla_inputs(T, R, rope, torch.bfloat16)
    q = torch.randn(T, H, nope + rope, dtype=torch.bfloat16)
    q_abs = torch.randn(H, T, R, dtype=torch.bfloat16).transpose(0, 1)  # einsum's layout
    rows = torch.randperm(N)[:T]
    width = mla_row_bytes(R, rope) if fp8 else R + rope
    poison = (torch.randint(0, 256, (N, width), dtype=torch.uint8) if fp8
              else torch.randn(N, width, dtype=torch.bfloat16))
    alone, fused = poison.clone(), poison.clone()
    assert glue.write_mla_rows(kv, w, 1e-6, cos, sin, alone, rows, R) is None
    got = glue.write_mla_rows(kv, w, 1e-6, cos, sin, fused, rows, R, q_abs, q[..., nope:])
    assert got.shape == (T, H, R + rope) and not got.isnan().any()
    assert torch.equal(fused.view(torch.uint8), alone.view(torch.uint8))
    assert torch.equal(got, glue.mla_q_latent(q_abs, q[..., nope:], cos, sin))
    assert torch.equal(got, glue.mla_q_latent_reference(q_abs, q[..., nope:], cos, sin))
    with switches.override(fused_glue=False):           # the unfused path: the references
        ref = glue.write_mla_rows(kv, w, 1e-6, cos, sin, poison.clone(), rows, R, q_abs,
                                  q[..., nope:])
    assert torch.equal(ref, got)
    empty = glue.write_mla_rows(kv[:0], w, 1e-6, cos[:0], sin[:0], alone, rows[:0], R,
                                q_abs[:0], q[:0, :, nope:])
    assert empty.shape == (0, H, R + rope)


# ----------------------------------------------------------------------------- indexer keys
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_write_index_keys(triton_cpu, interleaved, fp8):
    T, d, rope, bs, blocks = 6, 128, 32, 4, 3
    k = torch.randn(T, d, dtype=torch.bfloat16) * 2 + 0.3
    lw = (torch.rand(d) + 0.5).to(torch.bfloat16)
    lb = (torch.randn(d) * 0.1).to(torch.bfloat16)
    cos, sin = _rope_tables(T, rope, torch.bfloat16)
    rows = torch.randperm(blocks * bs)[:T]
    if fp8:
        poison = torch.randint(0, 256, (blocks, bs * index_key_bytes(d)), dtype=torch.uint8)
    else:
        poison = torch.randn(blocks * bs, d, dtype=torch.bfloat16)

    def run():
        dst = poison.clone()
        glue.write_index_keys(k, lw, lb, 1e-6, cos, sin, rope, interleaved, dst, rows)
        return dst

    got, ref = _run_both(run)
    if fp8:
        lay = FP8KeyLayout.of(got, d)
        g = dequantize_index_keys_reference(lay.gather(got, rows), d)
        r = dequantize_index_keys_reference(lay.gather(ref, rows), d)
        others = torch.tensor([i for i in range(blocks * bs) if i not in rows.tolist()])
        assert torch.equal(lay.gather(got, others), lay.gather(poison, others))
        torch.testing.assert_close(g, r, rtol=2 ** -3, atol=2 ** -7)
    else:
        untouched = torch.ones(blocks * bs, dtype=torch.bool)
        untouched[rows] = False
        assert torch.equal(got[untouched], poison[untouched])
        torch.testing.assert_close(got[rows], ref[rows], rtol=2 ** -6, atol=2 ** -7)


# ----------------------------------------------------------------------------- queries
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_heads_bitwise(triton_cpu, interleaved):
    T, Hn, D, rope = 3, 4, 48, 16
    q = torch.randn(T, Hn, 2 * D, dtype=torch.bfloat16)[..., :D]       # a strided view
    cos, sin = _rope_tables(T, rope, torch.bfloat16)
    got, ref = _run_both(
                         lambda: glue.rope_heads(q, cos, sin, rope, interleaved))
    assert got.is_contiguous() and torch.equal(got, ref)


def test_mla_q_latent_bitwise(triton_cpu):
    T, H, R, nope, rope = 3, 4, 32, 16, 16
    q = torch.randn(T, H, nope + rope, dtype=torch.bfloat16)
    q_abs = torch.randn(H, T, R, dtype=torch.bfloat16).transpose(0, 1)  # einsum's layout
    cos, sin = _rope_tables(T, rope, torch.bfloat16)
    got, ref = _run_both(
                         lambda: glue.mla_q_latent(q_abs, q[..., nope:], cos, sin))
    assert got.shape == (T, H, R + rope) and torch.equal(got, ref)


def test_resident_rows_bitwise(triton_cpu):
    T, K, R, P, bs = 5, 12, 3, 4, 8
    table = torch.randint(0, 50, (R, P), dtype=torch.int32)
    table[1, 2] = -1                                        # a page without a block
    slots = torch.tensor([0, 2, 1, -1, 1], dtype=torch.int32)    # one padding token
    topk = torch.randint(0, P * bs, (T, K), dtype=torch.int32)
    topk[0, 3:] = -1
    topk[4, :] = 2 * bs + torch.arange(K, dtype=torch.int32) % bs   # all on the missing page
    got, ref = _run_both(lambda: glue.resident_rows(topk, table, slots, bs))
    assert got.dtype == torch.int32 and torch.equal(got, ref)
    assert (ref[4] == -1).all() and (ref[0, 3:] == -1).all() and (ref[1] >= 0).all()


def test_fused_glue_off_runs_the_references(triton_cpu, kernel_switches):
    """HISPARSE_FUSED_GLUE=0 is the unfused path (kernel-count baselines): bitwise the spec."""
    kernel_switches(fused_glue=False)
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.rand(64, dtype=torch.bfloat16)
    y, _ = glue.add_rms_norm(x, None, w, 1e-6)
    assert torch.equal(y, glue.rms_norm_reference(x, w, 1e-6))


def test_shape_errors():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        glue.add_rms_norm(x, None, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="cos/sin"):
        glue.rope_heads(x.view(3, 1, 8), torch.ones(3, 3), torch.ones(3, 3), 8, False)


# ----------------------------------------------------------------------------- GPU, rank shapes
@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 64, 512])
def test_gpu_rank_shapes(T):
    dev, bf = "cuda", torch.bfloat16
    for D in (7168, 1536, 512):
        x, r = torch.randn(T, D, device=dev, dtype=bf), torch.randn(T, D, device=dev, dtype=bf)
        w = (torch.rand(D, device=dev) + 0.5).to(bf)
        (y, h), (y_ref, h_ref) = _run_both(
            lambda x=x, r=r, w=w: glue.add_rms_norm(x, r, w, 1e-6))
        assert torch.equal(h, h_ref)
        torch.testing.assert_close(y, y_ref, **BF16_TOL)
        y1, _ = glue.add_rms_norm(x[:1], r[:1], w, 1e-6)
        assert torch.equal(y[:1], y1)     # batch invariant
    R, rope, N = 512, 64, 4096
    kv, w, cos, sin = _mla_inputs(T, R, rope, bf, dev)
    rows = torch.randperm(N, device=dev)[:T]
    for dst0 in (torch.randn(N, R + rope, device=dev, dtype=bf),
                 torch.randint(0, 256, (N, 656), device=dev, dtype=torch.uint8)):
        def run(dst0=dst0):
            dst = dst0.clone()
            glue.write_mla_rows(kv, w, 1e-6, cos, sin, dst, rows, R)
            return dst
        got, ref = _run_both(run)
        if dst0.dtype == torch.uint8:
            got, ref = (dequantize_mla_rows_reference(t[rows], R, rope) for t in (got, ref))
            torch.testing.assert_close(got, ref, rtol=2 ** -3, atol=2 ** -9)
        else:
            assert torch.equal(got[rows, R:], ref[rows, R:])
            torch.testing.assert_close(got[rows], ref[rows], **BF16_TOL)
    d, bs = 128, 64
    k = torch.randn(T, d, device=dev, dtype=bf)
    lw, lb = torch.rand(d, device=dev, dtype=bf) + 0.5, torch.randn(d, device=dev, dtype=bf) * .1
    keys0 = torch.randint(0, 256, (N // bs, bs * 132), device=dev, dtype=torch.uint8)

    def keys():
        dst = keys0.clone()
        glue.write_index_keys(k, lw, lb, 1e-6, cos, sin, rope, False, dst, rows)
        return dst
    got, ref = _run_both(keys)
    lay = FP8KeyLayout.of(got, d)
    torch.testing.assert_close(dequantize_index_keys_reference(lay.gather(got, rows), d),
                               dequantize_index_keys_reference(lay.gather(ref, rows), d),
                               rtol=2 ** -3, atol=2 ** -7)
    q = torch.randn(T, 64, 128, device=dev, dtype=bf)
    got, ref = _run_both(lambda: glue.rope_heads(q, cos, sin, rope, False))
    assert torch.equal(got, ref)
    qb = torch.randn(T, 128, 192, device=dev, dtype=bf)
    q_abs = torch.randn(128, T, R, device=dev, dtype=bf).transpose(0, 1)
    got, ref = _run_both(lambda: glue.mla_q_latent(q_abs, qb[..., 128:], cos, sin))
    assert torch.equal(got, ref)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_rows_and_query_in_one_launch(fp8):
    """The TP-8 rank's attention (16 heads, kv_lora 512 + rope 64, bf16), T = 1..96: the rows
    written with the query (one launch) are bitwise the rows written alone and the query
    bitwise :func:`glue.mla_q_latent`'s own kernel's, q_abs in the einsum's layout and q_pe a
    view of q_b's output as the model passes them."""
    dev, bf, H, R, rope, N = "cuda", torch.bfloat16, 16, 512, 64, 4096
    for T in range(1, 97):
        kv, w, cos, sin = _mla_inputs(T, R, rope, bf, dev)
        qb = torch.randn(T, H, 192, device=dev, dtype=bf)
        q_abs = torch.randn(H, T, R, device=dev, dtype=bf).transpose(0, 1)
        rows = torch.randperm(N, device=dev)[:T]
        dst0 = (torch.randint(0, 256, (N, 656), device=dev, dtype=torch.uint8) if fp8
                else torch.randn(N, R + rope, device=dev, dtype=bf))
        alone, fused = dst0.clone(), dst0.clone()
        glue.write_mla_rows(kv, w, 1e-6, cos, sin, alone, rows, R)
        torch.empty(T, H, R + rope, device=dev, dtype=bf).fill_(float("nan"))
        got = glue.write_mla_rows(kv, w, 1e-6, cos, sin, fused, rows, R, q_abs, qb[..., 128:])
        assert torch.equal(fused.view(torch.uint8), alone.view(torch.uint8)), T
        assert torch.equal(got, glue.mla_q_latent(q_abs, qb[..., 128:], cos, sin)), T
        assert torch.equal(got, glue.mla_q_latent_reference(q_abs, qb[..., 128:], cos, sin)), T
