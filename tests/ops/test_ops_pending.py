"""Sums handed to the next norm (:mod:`hisparse.ops.pending`): the split-K GEMM's partials and
the MoE combine's slot rows, summed by :func:`hisparse.ops.glue.add_rms_norm`'s kernel, give
bitwise what their own reduction launch followed by the norm gave (the unfused path,
``HISPARSE_FUSED_SUMS=0``), and that launch is not made.

CPU: the interpreter at small shapes (fresh random data, poisoned outputs and partial buffers);
GPU (marker ``gpu``): one TP-8 rank's shapes (hidden 7168, ``o_proj`` K = 16 heads x 128, MoE
top-8 + the shared expert, 1..96 tokens), and the whole model's forward."""

from __future__ import annotations

import pytest
import torch

from hisparse.ops import glue, switches
from hisparse.ops.gemm import quantize_fp8_weight
from hisparse.ops.moe_layer import (
    RoutingConfig,
    SharedExpert,
    combine,
    moe_layer,
    pending_combine,
)
from hisparse.ops.pending import PendingSum, fuses_sums, pending_sum_reference

# the MoE layer's experts: the routed ones and the shared one (the last), FP8 on the GPU
RANK = RoutingConfig(top_k=8, n_group=8, topk_group=4, norm_topk_prob=True,
                     routed_scaling_factor=2.5)
SMALL = RoutingConfig(top_k=3, n_group=4, topk_group=2, norm_topk_prob=True,
                      routed_scaling_factor=2.5)


def _moe(E, I, D, seed, device="cpu", block=None):
    g = torch.Generator(device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    gu = torch.randn(E + 1, 2 * I, D, **kw) * D ** -0.5
    dn = torch.randn(E + 1, D, I, **kw) * I ** -0.5
    rw = (torch.randn(E, D, **kw) * D ** -0.5).bfloat16().float()
    rb = torch.randn(E, **kw) * 0.05
    if block is None:
        gu, dn = gu.bfloat16(), dn.bfloat16()
        return (rw, rb, gu[:-1], dn[:-1]), dict(shared=SharedExpert(gu[-1, :I], gu[-1, I:],
                                                                    dn[-1]))
    g_q, g_s = quantize_fp8_weight(gu[:, :I], block)
    u_q, u_s = quantize_fp8_weight(gu[:, I:], block)
    d_q, d_s = quantize_fp8_weight(dn, block)
    del gu, dn
    gu_q, gu_s = torch.cat([g_q, u_q], 1), torch.cat([g_s, u_s], 1)
    nbi = gu_s.shape[1] // 2
    sh = SharedExpert(gu_q[-1, :I], gu_q[-1, I:], d_q[-1], gu_s[-1, :nbi], gu_s[-1, nbi:],
                      d_s[-1])
    return (rw, rb, gu_q[:-1], d_q[:-1]), dict(gate_up_scale=gu_s[:-1], down_scale=d_s[:-1],
                                               block=block, shared=sh)


def _weights(N, K, block, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, generator=g, device=device) * 0.05
    rows = torch.rand(N, 1, generator=g, device=device) * 4 + 0.25
    return quantize_fp8_weight(w * rows, block)


def _cfg(bt, bn=64, level="chunk", quant="gemm"):
    from hisparse.ops._gemm_splitk_triton import SplitKConfig

    return SplitKConfig(bt, bn, 4, 2, level, quant)


def _spread(rows: int, cols: int, block: int) -> torch.Tensor:
    """Scales ``2**-6 .. 2**8`` per ``block`` columns of each row: partial sums of very
    different sizes that cancel, so another order of the fp32 additions shows in bf16 too."""
    e = torch.randint(-6, 9, (rows, -(-cols // block)))
    return torch.exp2(e.float()).repeat_interleave(block, 1)[:, :cols]


def _counted(p: PendingSum) -> tuple[PendingSum, list[int]]:
    """``p`` whose reduction counts its launches."""
    calls = []

    def reduce():
        calls.append(1)
        return p.reduce()

    return PendingSum(p.base, p.rows, p.cols, p.row_stride, p.part_stride, p.count, p.group,
                      p.dtype, reduce, p.bias), calls


def _norm_both(p: PendingSum, residual, w, fp32_copy=False):
    """The fused norm of ``p``, and the unfused path (its reduction, then the norm kernel)."""
    fused, calls = _counted(p)
    got = glue.add_rms_norm(fused, residual, w, 1e-6, fp32_copy)
    assert calls == [], "the fused norm launched the producer's reduction"
    with switches.override(fused_sums=False):
        unfused, calls = _counted(p)
        want = glue.add_rms_norm(unfused, residual, w, 1e-6, fp32_copy)
    assert calls == [1]
    return got, want


def _assert_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert not a.isnan().any()
        assert torch.equal(a, b), (a - b).abs().max()


# ----------------------------------------------------------------------------- split-K
# (M, N, K, block, (chunks, groups), config): chunk sums in one group and in several (a short
# last group), group sums, a partial last weight tile, many rows
SPLITK = [(5, 48, 96, (16, 16), (3, 1), _cfg(16)),
          (7, 72, 160, (32, 32), (5, 2), _cfg(16)),
          (3, 100, 480, (32, 32), (5, 3), _cfg(16, level="group")),
          (19, 64, 128, (32, 32), None, None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N,K,block,counts,cfg", SPLITK)
def test_norm_of_splitk_partials_is_bitwise_the_unfused(triton_cpu, poisoned_empty, dtype, M, N,
                                                        K, block, counts, cfg):
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk, splitk_plan

    w, s = _weights(N, K, block, seed=M + N)
    plan = splitk_plan(N, K, block[1], *(counts or (None, None)))
    x = torch.randn(M, K) * _spread(M, K, block[1])
    if plan.chunks >= 3:
        # chunk 1 = -chunk 0 exactly (the same weights and scales, the negated activations)
        # and the rest 2**-12 as large: (c0 + c1) + c2 is c2, another order rounds c2 away
        ck, cb = plan.chunk * block[1], plan.chunk
        w, s = w.clone(), s.clone()
        w[:, ck:2 * ck], s[:, cb:2 * cb] = w[:, :ck], s[:, :cb]
        x[:, ck:2 * ck] = -x[:, :ck]
        x[:, 2 * ck:] *= 2.0 ** -12
    x = x.bfloat16()
    p = fp8_block_linear_splitk(x, w, s, block, dtype, config=cfg, plan=plan, pending=True)
    assert isinstance(p, PendingSum) and p.shape == (M, N) and p.count > 1
    plain = fp8_block_linear_splitk(x, w, s, block, dtype, config=cfg, plan=plan)
    assert torch.equal(p.materialize(), plain)          # materialize = today's launch
    if dtype == torch.float32:                          # (bf16: the interpreter's cast truncates)
        assert torch.equal(pending_sum_reference(p), plain)
    residual = torch.randn(M, N, dtype=dtype)
    nw = (torch.rand(N) + 0.5).to(dtype)
    for res in (residual, None):
        for fp32_copy in (False, True):
            _assert_equal(*_norm_both(p, res, nw, fp32_copy))
    # with a bias (FP8Linear's: added to the rounded sum, rounded again)
    bias = torch.randn(N, dtype=dtype)
    pb = p.with_bias(bias)
    assert torch.equal(pb.materialize(), plain + bias)
    _assert_equal(*_norm_both(pb, residual, nw, True))


def test_splitk_without_partials_returns_the_tensor(triton_cpu):
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk, splitk_plan

    w, s = _weights(48, 96, (16, 16))
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    plan = splitk_plan(48, 96, 16, 3, 1)
    for cfg in (_cfg(16, level="all"), _cfg(16)):
        one = splitk_plan(48, 96, 16, 1, 1) if cfg.level == "chunk" else plan
        y = fp8_block_linear_splitk(x, w, s, (16, 16), torch.bfloat16, config=cfg, plan=one,
                                    pending=True)
        assert isinstance(y, torch.Tensor)


def test_fp8_linear_forward_pending(triton_cpu, kernel_switches):
    """``FP8Linear.forward_pending``: the split-K path's partials (bias carried); the
    reference backend gives its tensor."""
    from hisparse.models.linear import FP8Linear

    lin = FP8Linear(96, 48, bias=True, block=(16, 16))
    w, s = _weights(48, 96, (16, 16), seed=3)
    lin.weight.data.copy_(w)
    lin.weight_scale_inv.data.copy_(s)
    lin.bias.data.copy_(torch.randn(48))
    lin = lin.to(torch.bfloat16)
    lin.weight.data, lin.weight_scale_inv.data = w, s
    x = torch.randn(6, 96, dtype=torch.bfloat16)
    kernel_switches(fp8_gemm="triton")
    p = lin.forward_pending(x)
    assert isinstance(p, PendingSum) and p.bias is lin.bias
    assert torch.equal(p.materialize(), lin(x))
    kernel_switches(fp8_gemm="reference")
    y = lin.forward_pending(x)
    assert isinstance(y, torch.Tensor) and torch.equal(y, lin(x))


def test_heads_read_in_place_give_pending_partials(triton_cpu, poisoned_empty):
    """The two o_proj fusions together: the per-head output ``[T, H, v]`` with heads strided
    (as the ``w_uv`` bmm leaves it) goes to the split-K kernel in place, its partials to the
    norm: bitwise the flattened copy's linear, reduced, then normed."""
    from hisparse.ops import fp8_block_linear

    T, H, v, N, block = 5, 4, 32, 80, (16, 16)
    w, s = _weights(N, H * v, block, seed=9)
    heads = torch.randn(H, T, v, dtype=torch.bfloat16).transpose(0, 1)      # [T, H, v] strided
    assert not heads.is_contiguous()
    p = fp8_block_linear(heads, w, s, block, backend="triton", pending=True)
    assert isinstance(p, PendingSum) and p.rows == T and p.cols == N
    flat = fp8_block_linear(heads.reshape(T, H * v), w, s, block, backend="triton")
    assert torch.equal(p.materialize(), flat)
    residual = torch.randn(T, N, dtype=torch.bfloat16)
    norm_w = torch.rand(N, dtype=torch.bfloat16) + 0.5
    got, want = _norm_both(p, residual, norm_w)
    _assert_equal(got, want)
    _assert_equal(want, glue.add_rms_norm(flat, residual, norm_w, 1e-6))


# ----------------------------------------------------------------------------- MoE combine
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,K,D", [(1, 9, 64), (7, 4, 200), (5, 3, 512)])
def test_norm_of_moe_slot_rows_is_bitwise_the_unfused(triton_cpu, poisoned_empty, dtype, T, K, D):
    y = (torch.randn(T * K, D) * _spread(T * K, D, 1)).view(T, K, D)
    # every third column: slot 1 = -slot 0, both 2**14 as large as the rest (the rest survive
    # in the slot order only)
    y[:, 0, ::3] *= 2.0 ** 14
    y[:, 1, ::3] = -y[:, 0, ::3]
    y = y.reshape(T * K, D).to(dtype)
    p = pending_combine(y, T, dtype)
    assert p.shape == (T, D) and (p.count, p.group) == (K, K)
    assert torch.equal(p.materialize(), combine(y, T, dtype, use_triton=True))
    residual = torch.randn(T, D, dtype=dtype)
    nw = (torch.rand(D) + 0.5).to(dtype)
    for res in (residual, None):
        for fp32_copy in (False, True):
            _assert_equal(*_norm_both(p, res, nw, fp32_copy))


def test_signed_zeros_and_cancellation(triton_cpu):
    """Rows whose sum is -0, +0 or cancels exactly, against residuals of -0: the fused sum's
    ``0 + gsum`` steps and the residual add round as the unfused path does."""
    T, K, D = 4, 3, 16
    y = torch.zeros(T * K, D, dtype=torch.bfloat16)
    y[0:3] = -0.0                                   # token 0: all -0
    y[3], y[4], y[5] = 1.5, -1.5, -0.0              # token 1: cancels, then -0
    y[6], y[7], y[8] = -0.0, 2.0, -2.0              # token 2
    y[9:12] = torch.randn(3, D).bfloat16()          # token 3: ordinary
    residual = torch.full((T, D), -0.0, dtype=torch.bfloat16)
    residual[:, ::2] = 0.0
    nw = torch.ones(D, dtype=torch.bfloat16)
    got, want = _norm_both(pending_combine(y, T, torch.bfloat16), residual, nw)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))    # the sign bits too


def test_moe_layer_pending(triton_cpu):
    """``moe_layer(pending=True)``: the slot rows of the same routed and shared experts."""
    T, D = 6, 64
    (rw, rb, gu, dn), kw = _moe(16, 32, D, seed=1)
    x = torch.randn(T, D).bfloat16()
    want = moe_layer(x, rw, rb, SMALL, gu, dn, **kw)
    p = moe_layer(x, rw, rb, SMALL, gu, dn, pending=True, **kw)
    assert isinstance(p, PendingSum) and p.count == SMALL.top_k + 1
    assert torch.equal(p.materialize(), want)
    nw = torch.rand(D).bfloat16() + 0.5
    _assert_equal(*_norm_both(p, torch.randn(T, D).bfloat16(), nw))


# ----------------------------------------------------------------------------- dispatch
def test_switches_and_the_reference_path(triton_cpu, kernel_switches):
    y = torch.randn(12, 32).bfloat16()
    residual = torch.randn(4, 32).bfloat16()
    nw = torch.rand(32).bfloat16()
    assert fuses_sums(y)
    kernel_switches(fused_sums=False)
    assert not fuses_sums(y)
    kernel_switches(fused_sums=True, fused_glue=False)     # the references: materialized first
    assert not fuses_sums(y)
    p, calls = _counted(pending_combine(y, 4, torch.bfloat16))
    got = glue.add_rms_norm(p, residual, nw, 1e-6)
    assert calls == [1]
    want = glue.add_rms_norm_reference(p.materialize(), residual, nw, 1e-6)
    _assert_equal(got, want)


def test_bad_pending_sums_are_refused():
    y = torch.randn(12, 32)
    with pytest.raises(ValueError, match="group <= count"):
        PendingSum(y, 4, 32, 96, 32, 3, 4, torch.float32, lambda: y)
    with pytest.raises(ValueError, match="bias must be"):
        PendingSum(y, 4, 32, 96, 32, 3, 3, torch.float32, lambda: y, torch.zeros(3))
    with pytest.raises(ValueError, match="pending_combine"):
        pending_combine(y, 5, torch.float32)
    p = pending_combine(y, 4, torch.float32)
    with pytest.raises(ValueError, match="weight must be"):
        glue.add_rms_norm(p, None, torch.ones(31), 1e-6)
    with pytest.raises(ValueError, match="residual the same"):
        glue.add_rms_norm(p, torch.zeros(3, 32), torch.ones(32), 1e-6)


# ----------------------------------------------------------------------------- GPU: rank shapes
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 3, 8, 13, 16, 24, 32, 48, 64, 96])
def test_gpu_o_proj_partials_into_the_norm(T):
    """``o_proj`` of one TP-8 rank (7168 x 2048, 128-blocks) through split-K: the fused norm
    equals the reduction launch + norm, for each of the table's launches at these T (above 64
    rows the table's launch walks its one group in registers: no partials, no reduction
    launch, the tensor comes back)."""
    from hisparse.ops._gemm_splitk_triton import splitk_config, splitk_plan
    from hisparse.ops.gemm import fp8_block_linear

    plan = splitk_plan(7168, 2048)
    level = splitk_config(T, 7168, 2048, plan).level
    parts = {"chunk": plan.chunks, "group": plan.groups, "all": 1}[level]

    w, s = _weights(7168, 2048, (128, 128), seed=T, device="cuda")
    g = torch.Generator("cuda").manual_seed(T)
    x = torch.randn(T, 2048, generator=g, device="cuda").bfloat16()
    residual = torch.randn(T, 7168, generator=g, device="cuda").bfloat16() * 4
    nw = (torch.rand(7168, generator=g, device="cuda") + 0.5).bfloat16()
    with switches.override(fp8_gemm="triton"):
        p = fp8_block_linear(x, w, s, (128, 128), pending=True)
        if parts == 1:
            assert isinstance(p, torch.Tensor) and T > 64
            assert torch.equal(p, fp8_block_linear(x, w, s, (128, 128)))
            return
        assert isinstance(p, PendingSum) and p.count == parts
        assert torch.equal(p.materialize(), fp8_block_linear(x, w, s, (128, 128)))
        for fp32_copy in (False, True):
            _assert_equal(*_norm_both(p, residual, nw, fp32_copy))
        bias = torch.randn(7168, generator=g, device="cuda").bfloat16()
        _assert_equal(*_norm_both(p.with_bias(bias), residual, nw))


@pytest.fixture(scope="module")
def rank_moe():
    """One TP-8 rank's MoE layer: 256 FP8 experts of 256 (+ the shared one), hidden 7168."""
    return _moe(256, 256, 7168, seed=7, device="cuda", block=(128, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 5, 8, 16, 24, 48, 64, 96])
def test_gpu_moe_combine_into_the_norm(rank_moe, T):
    """The rank's MoE layer (top-8 + the shared expert): its combine summed by the next norm
    equals the combine launch + norm."""
    args, kw = rank_moe
    g = torch.Generator("cuda").manual_seed(100 + T)
    x = torch.randn(T, 7168, generator=g, device="cuda").bfloat16()
    residual = torch.randn(T, 7168, generator=g, device="cuda").bfloat16() * 4
    nw = (torch.rand(7168, generator=g, device="cuda") + 0.5).bfloat16()
    p = moe_layer(x, *args[:2], RANK, *args[2:], pending=True, **kw)
    assert isinstance(p, PendingSum) and p.count == 9
    assert torch.equal(p.materialize(), moe_layer(x, *args[:2], RANK, *args[2:], **kw))
    for fp32_copy in (False, True):
        _assert_equal(*_norm_both(p, residual, nw, fp32_copy))
