"""The split-K FP8 linear with W8A16 numerics (``mma="bf16"``, ``HISPARSE_FP8_GEMM=triton_w8a16``)
against its spec, the reference without activation quantization: interpreter on CPU (small
shapes), the rank's shapes on the GPU (launch choices and batch sizes bit for bit)."""

import pytest
import torch

from hisparse.ops.gemm import fp8_block_linear, fp8_block_linear_reference, quantize_fp8_weight
from hisparse.ops.pending import PendingSum


def _cfg(bt, bn=64, level="chunk", warps=4, stages=2):
    from hisparse.ops._gemm_splitk_triton import SplitKConfig

    return SplitKConfig(bt, bn, warps, stages, level, "kernel")


def _weights(N, K, block, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, generator=g, device=device) * 0.05
    w = w * (torch.rand(N, 1, generator=g, device=device) * 4 + 0.25)  # rows differ: scale index
    return quantize_fp8_weight(w, block)


def _exact_weights(N, K, block, seed, device="cpu"):
    """Integer e4m3 codes (|q| <= 16) and power-of-two block scales 2^-8..2^-6 (ue8m0-style,
    as DeepSeek-V3.2's): ``q * s`` exact in bf16."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(-16, 17, (N, K), generator=g, device=device).to(torch.float8_e4m3fn)
    nb, kb = -(-N // block[0]), -(-K // block[1])
    s = torch.exp2(torch.randint(-8, -5, (nb, kb), generator=g, device=device).float())
    return q, s


def _bf16_bound(x, w, s, block):
    """Per output, the error the weight's one bf16 rounding allows: sum |x| |w s| 2^-8."""
    from hisparse.ops.block_fp8 import dequantize_fp8_weight

    return (x.float().abs() @ dequantize_fp8_weight(w, s, block).abs().t()) * 2.0 ** -8


def _exact_x(M, K, seed, device="cpu"):
    """Activations of few bits (k / 8, |k| <= 4). With :func:`_exact_weights` every product is
    a multiple of 2^-11 below 2^-3 in magnitude, so any sum of up to 2^16 of them is exact in
    fp32 (< 2^13 over a grid of 2^-11: 24 bits): every summation order gives the same bits."""
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randint(-4, 5, (M, K), generator=g, device=device) / 8).to(torch.bfloat16)


# (M, N, K, block, (chunks, groups), config): partial weight and token tiles, a partial last K
# block, a short last chunk and group, per-row scales (bn < BLOCK_N) and one per tile
CASES = [(1, 48, 80, (16, 16), None, None),
         (19, 70, 96, (32, 32), (2, 1), _cfg(32)),
         (40, 130, 33, (32, 16), (2, 2), _cfg(64, level="group")),
         (70, 200, 256, (128, 128), (2, 1), _cfg(128, 64, level="all", warps=8)),
         (9, 72, 224, (32, 32), (3, 2), _cfg(16, level="all")),
         (21, 100, 480, (32, 32), (5, 2), _cfg(16, level="group"))]


@pytest.mark.parametrize("M,N,K,block,counts,cfg", CASES)
def test_w8a16_matches_reference(triton_cpu, poisoned_empty, M, N, K, block, counts, cfg):
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk, splitk_plan

    w, s = _weights(N, K, block, seed=M + N)
    x = torch.randn(M, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(K))
    plan = splitk_plan(N, K, block[1], *(counts or (None, None)))
    want = fp8_block_linear_reference(x, w, s, block, out_dtype=torch.float32)
    got = fp8_block_linear_splitk(x, w, s, block, torch.float32, config=cfg, plan=plan,
                                  mma="bf16")
    err = (got - want).abs()
    assert (err <= _bf16_bound(x, w, s, block) + 1e-6).all(), err.max()
    # activation quantization would break the bound: the path must not quantize x
    xq = fp8_block_linear_reference(x, w, s, block, quantize_input=True, out_dtype=torch.float32)
    assert not torch.equal(got, xq)


def test_w8a16_exact_data_bits(triton_cpu, poisoned_empty):
    """With power-of-two scales and few-bit activations the result is exact: equal to the
    reference bit for bit under every level, token tile and batch size, and with ``x`` given
    per head ``[M, G, K // G]`` (read in place)."""
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk, splitk_plan

    N, K, block = 96, 512, (32, 32)
    w, s = _exact_weights(N, K, block, seed=3)
    x = _exact_x(24, K, seed=4)
    want = fp8_block_linear_reference(x, w, s, block, out_dtype=torch.float32)
    plan = splitk_plan(N, K, 32, chunks=5, groups=2)
    for cfg in (_cfg(16), _cfg(32, level="group"), _cfg(64, level="all"), _cfg(16, 128), None):
        for M in (1, 7, 24):
            got = fp8_block_linear_splitk(x[:M], w, s, block, torch.float32, config=cfg,
                                          plan=plan, mma="bf16")
            assert torch.equal(got, want[:M]), (cfg, M)
    heads = fp8_block_linear_splitk(x.reshape(24, 4, K // 4), w, s, block, torch.float32,
                                    plan=plan, mma="bf16")
    assert torch.equal(heads, want)


@pytest.mark.parametrize("bt,bn,block,K,counts", [(16, 64, (32, 32), 480, (5, 2)),
                                                   (32, 64, (128, 128), 1024, (3, 2)),
                                                   (16, 128, (32, 32), 480, (7, 3))])
def test_w8a16_levels_same_bits(triton_cpu, poisoned_empty, bt, bn, block, K, counts):
    """On random data (sums that round), programs per chunk (partials, then the reduction), per
    group or over all of K add the same numbers in the same order: the same bits. Plans with a
    short last chunk and group."""
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk, splitk_plan

    N = 100
    w, s = _weights(N, K, block, seed=K)
    x = torch.randn(13, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    plan = splitk_plan(N, K, block[1], *counts)
    assert plan.chunks * plan.chunk > -(-K // block[1]) or plan.groups * plan.group > plan.chunks
    got = [fp8_block_linear_splitk(x, w, s, block, torch.float32, config=_cfg(bt, bn, level),
                                   plan=plan, mma="bf16") for level in ("chunk", "group", "all")]
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


def test_w8a16_backend_and_pending(triton_cpu, poisoned_empty, kernel_switches):
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk

    N, K, block = 160, 1024, (128, 128)
    w, s = _weights(N, K, block, seed=8)
    x = torch.randn(12, K, generator=torch.Generator().manual_seed(9)).bfloat16()
    direct = fp8_block_linear_splitk(x, w, s, block, torch.float32, mma="bf16")
    assert torch.equal(fp8_block_linear(x, w, s, block, backend="triton_w8a16",
                                        out_dtype=torch.float32), direct)
    kernel_switches(fp8_gemm="triton_w8a16")     # HISPARSE_FP8_GEMM selects it
    assert torch.equal(fp8_block_linear(x, w, s, block, out_dtype=torch.float32), direct)
    fp8 = fp8_block_linear(x, w, s, block, backend="triton", out_dtype=torch.float32)
    assert not torch.equal(fp8, direct)          # the FP8-MMA path: other numerics
    pend = fp8_block_linear_splitk(x, w, s, block, torch.float32, mma="bf16", pending=True)
    assert isinstance(pend, PendingSum)
    assert torch.equal(pend.materialize(), direct)


def test_w8a16_bad_arguments(triton_cpu):
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk

    w, s = _weights(64, 128, (128, 128), seed=0)
    with pytest.raises(ValueError, match="mma must be fp8 or bf16"):
        fp8_block_linear_splitk(torch.randn(2, 128), w, s, (128, 128), torch.float32,
                                mma="fp16")
    with pytest.raises(ValueError, match="quant='kernel' with mma='bf16'"):
        fp8_block_linear_splitk(torch.randn(2, 128), w, s, (128, 128), torch.float32,
                                mma="bf16", quant="kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(2240, 7168), (11264, 1536), (7168, 2048)])
def test_gpu_w8a16_batch_invariant_and_bounded(N, K):
    """The rank's stacked linears: every candidate launch and batch size give the same bits
    (the wgmma's sum does not depend on the token tile), within the weight's bf16 rounding of
    the reference, and exactly the reference on exact data."""
    from hisparse.ops import _gemm_splitk_triton as G

    block = (128, 128)
    w, s = _weights(N, K, block, seed=N, device="cuda")
    x = torch.randn(300, K, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(K))
    full = fp8_block_linear(x, w, s, backend="triton_w8a16", out_dtype=torch.float32)
    want = fp8_block_linear_reference(x, w, s, block, out_dtype=torch.float32)
    assert ((full - want).abs() <= _bf16_bound(x, w, s, block) + 1e-5).all()
    for M in (1, 7, 24, 48, 100, 128, 300):
        got = fp8_block_linear(x[:M], w, s, backend="triton_w8a16", out_dtype=torch.float32)
        assert torch.equal(got, full[:M]), M
        for cfg in G.splitk_configs(M) if M in (7, 24, 100, 300) else ():
            got = G.fp8_block_linear_splitk(x[:M], w, s, block, torch.float32, config=cfg,
                                            mma="bf16")
            assert torch.equal(got, full[:M]), (M, str(cfg))
    wp, sp = _exact_weights(N, K, block, seed=N, device="cuda")
    xe = _exact_x(64, K, seed=1, device="cuda")
    assert torch.equal(fp8_block_linear(xe, wp, sp, backend="triton_w8a16",
                                        out_dtype=torch.float32),
                       fp8_block_linear_reference(xe, wp, sp, block, out_dtype=torch.float32))
