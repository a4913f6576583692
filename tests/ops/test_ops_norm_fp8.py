"""The RMSNorm that also quantizes its output for the FP8 linear after it (``add_rms_norm(...,
fp8_rows=(block_k, pow2_scale))``, :class:`~hisparse.ops.block_fp8.FP8Rows`), and the split-K
linear that reads such rows instead of quantizing its input again.

The contract is bitwise: the norm's rows are what the linears' own quantizer
(:func:`~hisparse.ops._gemm_triton.quantize_fp8_act_triton`, the same ``_quant_rows``) makes of
the norm's bf16 output, and a linear fed them returns the bits it returns without them. CPU: the
kernels under the interpreter at small shapes (both sides through the interpreter's FP8 cast);
GPU (marker ``gpu``): the rank's shapes, and a whole FP8 model with the fusion on and off.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.ops import glue
from hisparse.ops.block_fp8 import FP8Rows, quantize_fp8_act
from hisparse.ops.gemm import fp8_block_linear, quantize_fp8_weight, takes_fp8_rows
from hisparse.ops.moe_layer import pending_combine


def _quantized(y: torch.Tensor, bk: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from hisparse.ops._gemm_triton import quantize_fp8_act_triton

    return quantize_fp8_act_triton(y, bk, pow2)


def _assert_rows_of(rows: FP8Rows, y: torch.Tensor, bk: int, pow2: bool) -> None:
    q, s = _quantized(y, bk, pow2)
    assert (rows.block_k, rows.pow2_scale) == (bk, pow2)
    assert rows.fits(y, bk, pow2)
    assert torch.isfinite(rows.scale).all() and not rows.q.float().isnan().any()
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rows.scale, s)


# ----------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("D,bk", [(200, 128), (96, 16), (64, 64), (48, 32)])
@pytest.mark.parametrize("res", [False, True])
@pytest.mark.parametrize("pow2", [False, True])
def test_norm_rows_are_the_linears_quantization(triton_cpu, poisoned_empty, D, bk, res, pow2):
    """Every tile written (NaN-poisoned outputs), a partial last tile included (200 = 128 + 72),
    the normed output and the residual sum unchanged by the extra output."""
    T = 5
    x = torch.randn(T, D, dtype=torch.bfloat16) * 3
    r = torch.randn(T, D, dtype=torch.bfloat16) if res else None
    w = (torch.rand(D) + 0.5).to(torch.bfloat16)
    y, h, rows = glue.add_rms_norm(x, r, w, 1e-6, fp8_rows=(bk, pow2))
    y0, h0 = glue.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(y, y0) and torch.equal(h, h0)
    _assert_rows_of(rows, y, bk, pow2)
    # beside the fp32 copy: both extra outputs, in that order
    y2, _, y32, rows2 = glue.add_rms_norm(x, r, w, 1e-6, fp32_copy=True, fp8_rows=(bk, pow2))
    assert torch.equal(y32, y.float()) and torch.equal(rows2.q.view(torch.uint8),
                                                        rows.q.view(torch.uint8))


def test_norm_of_a_pending_sum_quantizes_its_rows(triton_cpu, poisoned_empty):
    T, K, D, bk = 3, 4, 160, 32
    slots = torch.randn(T * K, D, dtype=torch.float32)
    r = torch.randn(T, D, dtype=torch.bfloat16)
    w = (torch.rand(D) + 0.5).to(torch.bfloat16)
    y, h, rows = glue.add_rms_norm(pending_combine(slots, T, torch.bfloat16), r, w, 1e-6,
                                   fp8_rows=(bk, False))
    y0, h0 = glue.add_rms_norm(pending_combine(slots, T, torch.bfloat16), r, w, 1e-6)
    assert torch.equal(y, y0) and torch.equal(h, h0)
    _assert_rows_of(rows, y, bk, False)
    y2, _, y32, rows2 = glue.add_rms_norm(pending_combine(slots, T, torch.bfloat16), r, w, 1e-6,
                                          fp32_copy=True, fp8_rows=(bk, True))
    assert torch.equal(y2, y) and torch.equal(y32, y.float())
    _assert_rows_of(rows2, y, bk, True)


def test_unfused_norm_returns_no_rows(triton_cpu, kernel_switches):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.rand(64, dtype=torch.bfloat16)
    kernel_switches(fused_glue=False)
    y, h, rows = glue.add_rms_norm(x, None, w, 1e-6, fp8_rows=(32, False))
    assert rows is None and torch.equal(h, x)


@pytest.mark.parametrize("fused", [True, False])
def test_norm_refuses_a_bad_block(triton_cpu, kernel_switches, fused):
    kernel_switches(fused_glue=fused)
    x, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.rand(64, dtype=torch.bfloat16)
    for bad in [(24, False), (0, False), (-16, False), (8, False), (32, 1)]:
        with pytest.raises(ValueError, match="fp8_rows must be"):
            glue.add_rms_norm(x, None, w, 1e-6, fp8_rows=bad)
    with pytest.raises(ValueError, match="fp8_rows must be"):
        glue.add_rms_norm(x[:0], None, w, 1e-6, fp8_rows=(24, False))


def _fp8_weight(N: int, K: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_weight(torch.randn(N, K) * 0.05, (bk, bk))


@pytest.mark.parametrize("M,N,K,bk", [(3, 48, 96, 16), (9, 40, 160, 32)])
def test_splitk_reads_rows_bitwise(triton_cpu, kernel_switches, M, N, K, bk):
    """Rows handed in give the bits of the kernel quantizing first (``quant="kernel"``: the
    interpreter's cast on both sides); rows in another format are not read."""
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk

    kernel_switches(fp8_gemm="triton")
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w, ws = _fp8_weight(N, K, bk)
    rows = FP8Rows(*_quantized(x, bk, False), bk, False)
    want = fp8_block_linear_splitk(x, w, ws, (bk, bk), torch.bfloat16, quant="kernel")
    got = fp8_block_linear_splitk(x, w, ws, (bk, bk), torch.bfloat16, x_fp8=rows)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert torch.equal(fp8_block_linear(x, w, ws, (bk, bk), x_fp8=rows), want)
    # other scales (pow2), another block, other rows' shape: x quantized as without them
    plain = fp8_block_linear(x, w, ws, (bk, bk))
    for other in (FP8Rows(rows.q, rows.scale, bk, True),
                  FP8Rows(*_quantized(x, bk // 2, False), bk // 2, False),
                  FP8Rows(rows.q[:1], rows.scale[:1], bk, False)):
        assert torch.equal(fp8_block_linear(x, w, ws, (bk, bk), x_fp8=other), plain)


def test_fp8_rows_fit():
    x = torch.randn(4, 80)
    q, s = quantize_fp8_act(x, 32)
    rows = FP8Rows(q.contiguous(), s, 32, False)
    assert rows.fits(x, 32, False)
    assert not rows.fits(x, 32, True) and not rows.fits(x, 16, False)
    assert not rows.fits(x[:3], 32, False) and not rows.fits(x.view(4, 2, 40), 32, False)
    assert not FP8Rows(q.t().contiguous().t(), s, 32, False).fits(x, 32, False)


def test_splitk_refuses_rows_mode_without_rows(triton_cpu):
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk

    w, ws = _fp8_weight(32, 64, 16)
    with pytest.raises(ValueError, match="x_fp8"):
        fp8_block_linear_splitk(torch.randn(2, 64), w, ws, (16, 16), torch.float32,
                                quant="rows")


def test_takes_fp8_rows_where_the_linear_would_quantize_first(kernel_switches):
    """CUDA only (the interpreter's cast is not torch's), the split-K backend, up to the
    batch-invariant rows, and only where that launch quantizes in a kernel of its own."""
    from hisparse.ops._gemm_splitk_triton import quantizes_first

    shape = (2240, 7168)              # the stacked [q_a | wk | kv_a] of a V3.2 rank
    assert not takes_fp8_rows(96, torch.device("cpu"), shape)
    kernel_switches(force_triton=True)
    assert not takes_fp8_rows(96, torch.device("cpu"), shape)
    if torch.cuda.is_available():
        from hisparse.ops._gemm_triton import BATCH_INVARIANT_MAX_M

        cuda = torch.device("cuda")
        for m in (1, 8, 32, 48, 96, BATCH_INVARIANT_MAX_M):
            assert takes_fp8_rows(m, cuda, shape) == quantizes_first(m, *shape)
        assert takes_fp8_rows(96, cuda, shape) and not takes_fp8_rows(1, cuda, shape)
        assert not takes_fp8_rows(0, cuda, shape)
        assert not takes_fp8_rows(BATCH_INVARIANT_MAX_M + 1, cuda, shape)
        kernel_switches(fp8_gemm="scaled_mm")
        assert not takes_fp8_rows(96, cuda, shape)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 33, 96, 512])
@pytest.mark.parametrize("D", [7168, 1536])
def test_gpu_norm_rows_at_rank_shapes(poisoned_empty, T, D):
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16) * 3
    r = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = (torch.rand(D, device="cuda") + 0.5).to(torch.bfloat16)
    for pow2 in (False, True):
        y, h, rows = glue.add_rms_norm(x, r, w, 1e-6, fp8_rows=(128, pow2))
        y0, h0 = glue.add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(y, y0) and torch.equal(h, h0)
        _assert_rows_of(rows, y, 128, pow2)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 96, 512])
def test_gpu_linear_reads_rows_bitwise(M):
    x = torch.randn(M, 7168, device="cuda", dtype=torch.bfloat16)
    w, ws = quantize_fp8_weight(torch.randn(2240, 7168, device="cuda") * 0.02)
    rows = FP8Rows(*_quantized(x, 128, False), 128, False)
    want = fp8_block_linear(x, w, ws)
    got = fp8_block_linear(x, w, ws, x_fp8=rows)
    assert torch.isfinite(got).all() and torch.equal(got, want)
