"""``hisparse.ops.fp32_linear``: the linears transformers keeps in fp32 (the indexer's
``weights_proj``; fp32 or bf16-stored operands, fp32 products and sums) as fixed K-split
partials summed in split order (batch invariant), optionally left pending for the FP8 query
kernel (:class:`hisparse.ops.pending.PendingSum`).

CPU: the interpreter on fresh random data, outputs poisoned; GPU (``gpu``): a TP-8 rank's
``weights_proj`` (64 heads from hidden 7168) at 1-96 tokens.
"""

import pytest
import torch

from hisparse.ops import fp32_linear
from hisparse.ops.pending import PendingSum, pending_sum_reference


def _inputs(T, N, K, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, K, device=device, generator=g)
    x[:, :7] *= 64.0                    # a few large channels, as a normed hidden state has
    w = torch.randn(N, K, device=device, generator=g) * K ** -0.5
    return x, w


@pytest.mark.parametrize("T,N,K", [(17, 40, 1000), (3, 64, 512), (1, 8, 300)])
def test_matches_torch_and_is_batch_invariant(triton_cpu, poisoned_empty, T, N, K):
    """fp32 within rounding of torch's GEMM (K not a multiple of the split: a masked tail; N
    not a multiple of the program's block; T across a 16-row tile), and each row the same bits
    alone or in a slice of the batch (at its place in a 16-row tile: the interpreter's numpy
    dot may sum a row by its place; the GPU test moves rows)."""
    x, w = _inputs(T, N, K)
    got = fp32_linear(x, w)
    assert got.shape == (T, N) and got.dtype == torch.float32 and got.isfinite().all()
    want = x @ w.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for a, b in ((0, 1), (0, (T + 1) // 2), (16, T)):
        if a < b:
            assert torch.equal(fp32_linear(x[a:b], w), got[a:b]), (a, b)


def test_pending_partials_sum_to_the_same_bits(triton_cpu, poisoned_empty):
    """``pending=True``: a :class:`PendingSum` of one group whose materialized value, and the
    reference sum of its parts, are the summed call's bits."""
    x, w = _inputs(9, 24, 700, seed=1)
    p = fp32_linear(x, w, pending=True)
    assert isinstance(p, PendingSum) and p.shape == (9, 24) and p.count == p.group == 3
    want = fp32_linear(x, w)
    assert torch.equal(p.materialize(), want)
    assert torch.equal(pending_sum_reference(p), want)


def test_long_inputs_run_in_row_slices(triton_cpu, monkeypatch):
    """More rows than one call's partials cover: row slices, the same bits, never pending."""
    from hisparse.ops import _gemm_splitk_triton as S

    x, w = _inputs(40, 16, 300, seed=2)
    whole = fp32_linear(x, w)
    monkeypatch.setattr(S, "FP32_MAX_ROWS", 16)
    got = fp32_linear(x, w, pending=True)
    assert isinstance(got, torch.Tensor) and torch.equal(got, whole)


def test_bf16_operands_give_the_fp32_operands_bits(triton_cpu, poisoned_empty):
    """Both bf16 (a bf16-valued weight stored so: ``narrow_fp32_weights_``): fp32 output, the
    values of the same call over their fp32 forms (the interpreter computes both in IEEE fp32;
    on CUDA the bf16 operands take one bf16 MMA pass: ``test_gpu_bf16_weights_proj``)."""
    x, w = _inputs(21, 40, 700, seed=5)
    xb, wb = x.bfloat16(), w.bfloat16()
    got = fp32_linear(xb, wb)
    assert got.dtype == torch.float32
    assert torch.equal(got, fp32_linear(xb.float(), wb.float()))
    assert torch.equal(fp32_linear(xb, wb, pending=True).materialize(), got)


def test_torch_without_triton_and_bad_inputs():
    x, w = _inputs(4, 8, 64, seed=3)
    assert torch.equal(fp32_linear(x, w), torch.nn.functional.linear(x, w))
    xb, wb = x.bfloat16(), w.bfloat16()         # fp32 products and output without Triton too
    assert torch.equal(fp32_linear(xb, wb),
                       torch.nn.functional.linear(xb.float(), wb.float()))
    with pytest.raises(ValueError, match="fp32_linear: x .* both fp32 or both bf16"):
        fp32_linear(x.bfloat16(), w)
    with pytest.raises(ValueError, match="fp32_linear"):
        fp32_linear(x.half(), w.half())
    with pytest.raises(ValueError, match="fp32_linear"):
        fp32_linear(x[None], w)
    with pytest.raises(ValueError, match="fp32_linear"):
        fp32_linear(x, w[:, :32])          # K of the weight != K of x


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 24, 96])
def test_gpu_weights_proj_shape(T):
    """The rank's ``weights_proj``: close to cuBLAS's fp32 GEMM, rows batch invariant, the
    pending sum the summed bits, and a graph replay the eager bits."""
    x, w = _inputs(96, 64, 7168, device="cuda", seed=4)
    full = fp32_linear(x, w)
    got = fp32_linear(x[:T], w)
    assert torch.equal(got, full[:T])
    assert torch.equal(fp32_linear(x[5:5 + T], w), full[5:5 + T])   # other tile places
    want = torch.nn.functional.linear(x[:T].double(), w.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(fp32_linear(x[:T], w, pending=True).materialize(), got)
    xs = x[:T].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp32_linear(xs, w)
    xs.copy_(x[96 - T:])
    graph.replay()
    assert torch.equal(out, full[96 - T:])


@pytest.mark.gpu
def test_gpu_bf16_weights_proj():
    """The rank's ``weights_proj`` stored in bf16 (bf16 values) over a bf16 hidden: one bf16
    MMA pass, rows batch invariant, graph-safe, and within fp32 summation order of the 3xTF32
    call over the same values."""
    from hisparse.ops._gemm_splitk_triton import fp32_precision

    x, w = _inputs(96, 64, 7168, device="cuda", seed=6)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert fp32_precision(xb, wb) == "bf16"
    full = fp32_linear(xb, wb)
    for T in (1, 8, 24, 96):
        assert torch.equal(fp32_linear(xb[:T], wb), full[:T]), T
        assert torch.equal(fp32_linear(xb[96 - T:], wb), full[96 - T:]), T
    want = fp32_linear(xb.float(), wb.float())               # 3xTF32: exact products too
    torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(fp32_linear(xb, wb, pending=True).materialize(), full)
    xs = xb[:8].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp32_linear(xs, wb)
    xs.copy_(xb[88:])
    graph.replay()
    assert torch.equal(out, full[88:])
