"""The indexer rotation (hisparse.ops.rotation): its definition, what it preserves, why FP8 keys
use it, and the kernels that apply it (bit for bit the reference under the interpreter; GPU:
the real rank's shapes)."""

import pytest
import torch

from hisparse import ops
from hisparse.ops import glue
from hisparse.ops import quant as Q
from hisparse.ops.rotation import check_rotation_dim, indexer_rotation


def _sylvester(d: int) -> torch.Tensor:
    """``H[i, j] = (-1) ** popcount(i & j)`` in float64, from the bits (not the butterfly)."""
    i = torch.arange(d)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros(d, d, dtype=torch.long)
    for b in range(max(1, d.bit_length())):
        parity ^= (bits >> b) & 1
    return (1 - 2 * parity).double()


def _outlier_keys(n: int, d: int, seed: int, channels: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Activations with outlier *channels* (the same few dims large in every row, 20-40x the
    rest, as in real activations: the case the rotation is for)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    if channels is None:
        channels = torch.randperm(d, generator=g)[:4]
    x[:, channels] *= 20 + 20 * torch.rand(n, channels.numel(), generator=g)
    return x


def _quant_unrotated(x: torch.Tensor) -> torch.Tensor:
    """The FP8 key rule without the rotation (one power-of-two scale per 128 values),
    dequantized: the baseline."""
    s = Q.pow2_scale(x.abs().amax(-1, keepdim=True))
    return (x / s).to(torch.float8_e4m3fn).float() * s


@pytest.mark.parametrize("d", [1, 2, 32, 128, 256])
def test_rotation_is_the_scaled_sylvester_hadamard(d):
    """Fresh random data (with outliers): the butterfly equals ``x @ H * d ** -0.5`` in float64
    within fp32 rounding, H being built from its bit formula; it is its own inverse and keeps
    every dot product (``q . k`` before quantization) within fp32 tolerance; the dtype is
    kept."""
    x = _outlier_keys(12, d, seed=d) if d >= 4 else torch.randn(12, d)
    y = torch.randn(12, d)
    want = x.double() @ _sylvester(d) * d ** -0.5
    got = indexer_rotation(x)
    assert got.dtype == torch.float32
    mag = x.double().abs() @ _sylvester(d).abs() * d ** -0.5
    assert ((got.double() - want).abs() <= mag * 2 ** -20 + 1e-30).all()
    assert torch.allclose(indexer_rotation(got), x, rtol=1e-5, atol=1e-5 * x.abs().max())
    dots = (got.double() * indexer_rotation(y).double()).sum(-1)
    exact = (x.double() * y.double()).sum(-1)
    scale = (x.double().norm(dim=-1) * y.double().norm(dim=-1))
    assert ((dots - exact).abs() <= scale * 2 ** -16).all()
    assert indexer_rotation(x.bfloat16()).dtype == torch.bfloat16


def test_rotation_refuses_other_sizes_and_fp8_keys_need_it():
    for d in (0, 3, 48, 96):
        with pytest.raises(ValueError, match="power of two"):
            check_rotation_dim(d)
    with pytest.raises(ValueError, match="power of two"):
        Q.FP8KeyLayout(48, 4)
    with pytest.raises(ValueError, match="power of two"):
        indexer_rotation(torch.randn(2, 48))


def test_rotation_lowers_fp8_score_error_on_outlier_channels():
    """Why FP8 keys are rotated. e4m3 keeps a relative error per value, so on i.i.d. data the
    rotation is neutral; but when queries and keys share a few outlier channels, q . k is
    dominated by those channels' products and their rounding errors, which the rotation spreads
    over all 128 values: the score error against FP8 keys (queries rotated alike; unquantized,
    and FP8 as with ``HISPARSE_FP8_INDEXER=1``) is well below the unrotated format's there, and
    about equal on i.i.d. Gaussian data."""
    d = 128
    ch = torch.tensor([3, 40, 77, 100])

    def ratios(q, k):
        exact = q.double() @ k.double().T
        kr = Q.dequantize_index_keys_reference(Q.quantize_index_keys_reference(k), d).double()
        qr = Q.dequantize_index_queries_reference(*Q.quantize_index_queries_reference(q[None]))[0]
        bf = (indexer_rotation(q).double() @ kr.T - exact).abs().mean() / \
            (q.double() @ _quant_unrotated(k).double().T - exact).abs().mean()
        f8 = (qr.double() @ kr.T - exact).abs().mean() / \
            (_quant_unrotated(q).double() @ _quant_unrotated(k).double().T - exact).abs().mean()
        return float(bf), float(f8)

    bf, f8 = ratios(_outlier_keys(32, d, 1, ch), _outlier_keys(256, d, 2, ch))
    assert bf < 0.5 and f8 < 0.5, (bf, f8)            # measured ~0.18 and ~0.20
    g = torch.Generator().manual_seed(3)
    bf, f8 = ratios(torch.randn(32, d, generator=g), torch.randn(256, d, generator=g))
    assert 0.8 < bf < 1.25 and 0.8 < f8 < 1.25, (bf, f8)


@pytest.mark.parametrize("D,dtype", [(128, torch.bfloat16), (32, torch.float32),
                                     (256, torch.bfloat16)])
def test_kernels_rotate_bit_exact(triton_cpu, D, dtype):
    """Under the interpreter, on fresh outlier-heavy data: the query rotation kernel and the
    query quantization kernel equal the reference (rotation in ``dtype``) bit for bit, and the
    quantize-and-write of keys writes exactly ``quantize_index_keys_reference`` (the rotated
    key's bytes) into poisoned pages, nothing else."""
    from hisparse.ops._indexer_triton import quantize_queries, rotate_queries

    q = _outlier_keys(3 * 5, D, seed=D).view(3, 5, D).to(dtype)
    assert torch.equal(rotate_queries(q), indexer_rotation(q))
    codes, scales, _ = quantize_queries(q, torch.rand(3, 5))
    want_codes, want_scales = Q.quantize_index_queries_reference(q)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    k = _outlier_keys(10, D, seed=D + 1).to(dtype)
    lay = Q.FP8KeyLayout(D, 4)
    poison = torch.randint(0, 256, (4, lay.page_bytes), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(D))
    dst = poison.clone()
    rows = torch.tensor([0, 3, 5, 6, 7, 8, 9, 10, 11, 15])
    ops.quantize_write_index_keys(k, dst, rows)
    assert torch.equal(lay.gather(dst, rows), Q.quantize_index_keys_reference(k))
    others = torch.tensor([1, 2, 4, 12, 13, 14])
    assert torch.equal(lay.gather(dst, others), lay.gather(poison, others))


def test_fused_key_write_rotates(triton_cpu, monkeypatch):
    """The fused key write (LayerNorm + RoPE + rotation + FP8) against the unfused reference on
    keys with outlier channels: the same FP8 values up to the norm's reduction order (one bf16
    ulp before the rotation, so at most one e4m3 step after it), and not the unrotated key's."""
    T, d, rope, bs = 6, 128, 64, 4
    k = _outlier_keys(T, d, seed=7).bfloat16()
    lw = (torch.rand(d) + 0.5).bfloat16()
    lb = (torch.randn(d) * 0.1).bfloat16()
    pos = torch.arange(T).float() * 977
    f = pos[:, None] / (10000 ** (torch.arange(0, rope, 2).float() / rope))[None]
    cos, sin = f.cos().bfloat16(), f.sin().bfloat16()
    rows = torch.tensor([5, 0, 9, 2, 11, 6])
    lay = Q.FP8KeyLayout(d, bs)
    dst = torch.zeros(3, lay.page_bytes, dtype=torch.uint8)
    glue.write_index_keys(k, lw, lb, 1e-6, cos, sin, rope, False, dst, rows)
    got = Q.dequantize_index_keys_reference(lay.gather(dst, rows), d)
    new = glue.index_keys_reference(k, lw, lb, 1e-6, cos, sin, rope, False)
    want = Q.dequantize_index_keys_reference(Q.quantize_index_keys_reference(new), d)
    step = want.abs().amax(-1, keepdim=True) / 8              # an e4m3 step at the tile's top
    assert ((got - want).abs() <= step).all()
    assert (got == want).float().mean() > 0.9
    assert not torch.allclose(got, _quant_unrotated(new.float()), atol=0.5)


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64, 512])
def test_gpu_rotation_kernels_rank_shapes(T):
    """The compiled butterfly at the real rank's shapes (64 indexer heads of 128, page 64): the
    query kernels and the key write equal the reference bit for bit (computed on the CPU), so
    the FP8 rounding is the references' on the GPU too."""
    from hisparse.ops._indexer_triton import quantize_queries, rotate_queries

    q = _outlier_keys(T * 64, 128, seed=T).view(T, 64, 128).bfloat16()
    qc = q.cuda()
    assert torch.equal(rotate_queries(qc).cpu(), indexer_rotation(q))
    codes, scales, wq = quantize_queries(qc, torch.ones(T, 64, device="cuda"))
    want_codes, want_scales = Q.quantize_index_queries_reference(q)
    assert torch.equal(codes.cpu(), want_codes) and torch.equal(scales.cpu(), want_scales)
    assert torch.equal(wq.cpu(), want_scales[..., 0])
    k = _outlier_keys(T, 128, seed=T + 1).bfloat16()
    lay = Q.FP8KeyLayout(128, 64)
    dst = torch.randint(0, 256, (max(1, 2 * T // 64 + 1), lay.page_bytes), dtype=torch.uint8,
                        device="cuda")
    rows = torch.randperm(dst.shape[0] * 64)[:T].cuda()
    ops.quantize_write_index_keys(k.cuda(), dst, rows)
    assert torch.equal(lay.gather(dst, rows).cpu(), Q.quantize_index_keys_reference(k))
