"""Block-scaled FP8 GEMM: Triton (interpreter on CPU) and the quantizers against the reference."""

import pytest
import torch

from hisparse.ops.gemm import (
    FP8_DTYPE,
    dequantize_fp8_act,
    dequantize_fp8_weight,
    fp8_block_linear,
    fp8_block_linear_reference,
    pow2_ceil,
    quantize_fp8_act,
    quantize_fp8_weight,
)


def _weights(N, K, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    # per-block magnitudes that differ a lot, so a wrong scale index is caught
    rows = torch.rand(N, 1, generator=g) * 4 + 0.25
    return quantize_fp8_weight(w * rows, block)


@pytest.mark.parametrize("shape", [(7, 45), (33, 64), (1, 16)])
def test_weight_quant_roundtrip(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    q, s = quantize_fp8_weight(w, (16, 16))
    assert q.dtype == FP8_DTYPE and s.shape == (-(-shape[0] // 16), -(-shape[1] // 16))
    back = dequantize_fp8_weight(q, s, (16, 16))
    # e4m3: half an ulp is 1/16 relative for normal values; subnormals (below 2**-6 of the
    # scaled range) are spaced 2**-9 apart, so their error is absolute: half that, times the scale
    torch.testing.assert_close(back, w, rtol=0.07, atol=float(s.max()) * 2 ** -10)
    # quantizing the dequantized weight again is exact (the block amax is a grid point: 448*s)
    q2, s2 = quantize_fp8_weight(back, (16, 16))
    assert torch.equal(s2, s) and torch.equal(q2.float(), q.float())


def test_act_quant_roundtrip():
    x = torch.randn(5, 40)
    x[2] = 0.0
    q, s = quantize_fp8_act(x, 16)
    assert q.shape == x.shape and s.shape == (5, 3)
    torch.testing.assert_close(dequantize_fp8_act(q, s, 16), x, rtol=0.07, atol=1e-6)


def test_reference_without_input_quant_is_dequant_matmul():
    w, s = _weights(48, 80, (16, 16))
    x = torch.randn(3, 5, 80)
    want = x @ dequantize_fp8_weight(w, s, (16, 16)).t()
    torch.testing.assert_close(fp8_block_linear(x, w, s, (16, 16), backend="reference"), want)


@pytest.mark.parametrize("backend", ["triton", "triton_tile"])
@pytest.mark.parametrize("M,N,K,block", [(1, 48, 80, (16, 16)), (19, 70, 96, (32, 32)),
                                         (40, 64, 33, (32, 16)), (5, 32, 128, (32, 32))])
def test_triton_matches_reference(triton_cpu, M, N, K, block, backend):
    w, s = _weights(N, K, block, seed=M)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    want = fp8_block_linear_reference(x, w, s, block, quantize_input=True, out_dtype=torch.float32)
    got = fp8_block_linear(x, w, s, block, backend=backend, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and close to the unquantized-activation reference (activation FP8 error only)
    ref = fp8_block_linear_reference(x, w, s, block, out_dtype=torch.float32)
    assert (got - ref).abs().max() <= 0.1 * ref.abs().max()


def test_pow2_ceil():
    s = torch.tensor([1.0, 1.5, 0.25, 3.0, 1.1 * 2.0 ** -20, 448.0])
    want = torch.tensor([1.0, 2.0, 0.25, 4.0, 2.0 ** -19, 512.0])
    assert torch.equal(pow2_ceil(s), want)
    q, sc = quantize_fp8_act(torch.randn(3, 64), 32, pow2_scale=True)
    assert torch.equal(pow2_ceil(sc), sc)
    assert q.float().abs().max() <= 448


@pytest.mark.parametrize("backend", ["triton", "triton_tile"])
def test_triton_pow2_scales_match_reference(triton_cpu, backend):
    w, s = _weights(48, 96, (32, 32), seed=9)
    x = torch.randn(7, 96)
    want = fp8_block_linear_reference(x, w, s, (32, 32), quantize_input=True, pow2_scale=True)
    got = fp8_block_linear(x, w, s, (32, 32), backend=backend, pow2_scale=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = fp8_block_linear_reference(x, w, s, (32, 32), quantize_input=True)
    assert not torch.equal(want, plain)


def test_triton_split_k(triton_cpu, monkeypatch):
    from hisparse.ops import _gemm_triton

    monkeypatch.setattr(_gemm_triton, "_num_sms", lambda device: 64)  # forces several K splits
    w, s = _weights(32, 160, (32, 32), seed=3)
    x = torch.randn(4, 160)
    assert _gemm_triton.gemm_config(4, 32, 5, 32, x.device)[2] > 1
    want = fp8_block_linear_reference(x, w, s, (32, 32), quantize_input=True)
    got = fp8_block_linear(x, w, s, (32, 32), backend="triton_tile")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _cfg(bt, bn=64, split=False, quant="gemm", warps=4, blocks=1):
    from hisparse.ops._gemm_triton import StreamConfig

    return StreamConfig(bt, bn, warps, 2, split, quant, blocks)


# (M, N, K, block, chunks, config): per-row scales (bn < BLOCK_N) and one scale per tile,
# partial N tiles, a partial last K block and a short last chunk, one chunk, several chunks
# walked by one program (chain) and one program per chunk (split), token tiles 16..128
STREAM_CASES = [(1, 48, 80, (16, 16), None, None), (19, 70, 96, (32, 32), 3, _cfg(32)),
                (3, 64, 128, (64, 32), 1, _cfg(16, split=True)),
                (40, 130, 33, (32, 16), 2, _cfg(64, split=True)),
                (70, 200, 256, (128, 128), 2, _cfg(128, 128, warps=8)),
                (9, 72, 160, (32, 32), 5, _cfg(32, 128, split=True)),
                (9, 72, 224, (32, 32), 3, _cfg(16)),
                # two scale blocks a K step: one chunk, chained and split chunks, and an odd
                # chunk length (falls back to one block a step)
                (5, 96, 256, (32, 32), 1, _cfg(16, blocks=2)),
                (21, 100, 512, (32, 32), 4, _cfg(32, blocks=2)),
                (21, 100, 480, (32, 32), 3, _cfg(16, split=True, blocks=2)),
                (6, 64, 320, (32, 32), 2, _cfg(16, split=True, blocks=2))]


@pytest.mark.parametrize("M,N,K,block,chunks,cfg", STREAM_CASES)
def test_stream_kernel_matches_reference(triton_cpu, poisoned_empty, M, N, K, block, chunks,
                                         cfg):
    from hisparse.ops import _gemm_triton as G

    w, s = _weights(N, K, block, seed=M + N)
    x = torch.randn(M, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(K))
    want = fp8_block_linear_reference(x, w, s, block, quantize_input=True, out_dtype=torch.float32)
    got = G.fp8_block_linear_stream(x, w, s, block, torch.float32, config=cfg, chunks=chunks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the arrival counters are left zero: a second call (same buffer) sums the same partials
    if G._COUNTERS:
        assert not G._COUNTERS[torch.device("cpu")].any()
    again = G.fp8_block_linear_stream(x, w, s, block, torch.float32, config=cfg, chunks=chunks)
    assert torch.equal(again, got)
    g16 = G.fp8_block_linear_stream(x, w, s, block, torch.bfloat16, config=cfg, chunks=chunks)
    assert g16.dtype == torch.bfloat16  # (the interpreter's fp32 -> bf16 cast is not torch's)
    torch.testing.assert_close(g16.float(), want, rtol=1e-2, atol=1e-2)


def test_stream_kernel_launch_choices_do_not_change_bits(triton_cpu, poisoned_empty):
    """For one chunk count, the chain (registers) and split (per-chunk programs, last arrival
    adds) modes, one or two scale blocks a K step and both activation quantizers give
    identical bits; another chunk count may
    not (the numerics' one parameter). Token tiles and weight-tile heights are the GPU's
    claim (one wgmma kind whatever the tile: the GPU tests); here the interpreter's
    ``tl.dot`` is numpy's matmul, which may round by the tile's shape."""
    from hisparse.ops import _gemm_triton as G

    N, K, block = 96, 384, (32, 32)
    w, s = _weights(N, K, block, seed=5)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(6)) * 3
    runs = {(split, quant, blocks): G.fp8_block_linear_stream(
        x, w, s, block, torch.float32, config=_cfg(32, split=split, blocks=blocks), chunks=3,
        quant=quant) for split in (False, True) for quant in ("gemm", "kernel")
        for blocks in (1, 2)}
    first = runs[(False, "gemm", 1)]
    for key, got in runs.items():
        assert torch.equal(got, first), key
    other = G.fp8_block_linear_stream(x, w, s, block, torch.float32, config=_cfg(32),
                                      chunks=1, quant="gemm")
    torch.testing.assert_close(other, first, rtol=1e-5, atol=1e-5)
    assert not torch.equal(other, first)


# the default launches on CPU take the kernel paths of the reference cases above (activations
# quantized by torch), which the oldest Triton runs: this bitwise relation between them runs
# with the newest only (.ci/triton_matrix.sh; CI time: ~10 s interpreted)
@pytest.mark.newest_triton_only
def test_stream_kernel_rows_are_batch_invariant(triton_cpu, poisoned_empty):
    """Row i of a batch of M equals the same row computed alone and in a full batch of its
    token tile, bitwise, for every default token-tile width and with K in several chunks: the
    chunk count comes from the weight shape only (see the note above on tile widths)."""
    from hisparse.ops import _gemm_triton as G

    N, K, block = 96, 256, (32, 32)
    w, s = _weights(N, K, block, seed=11)
    x = torch.randn(130, K, generator=torch.Generator().manual_seed(12)) * 3
    assert G.stream_chunks(N, K, 32, G._num_sms(x.device)) > 1
    full = fp8_block_linear(x, w, s, block, backend="triton_stream", out_dtype=torch.float32)
    alone = torch.cat([fp8_block_linear(x[i:i + 1], w, s, block, backend="triton_stream",
                                        out_dtype=torch.float32) for i in (0, 17, 129)])
    assert torch.equal(alone, full[[0, 17, 129]])
    sms = G._num_sms(x.device)
    for M in (2, 16, 17, 40, 64, 65):
        got = fp8_block_linear(x[:M], w, s, block, backend="triton_stream",
                               out_dtype=torch.float32)
        cfg = G.stream_config(M, N, K, G.stream_chunks(N, K, 32, sms), sms)
        tiles = -(-M // cfg.block_t) * cfg.block_t  # the same rows in full token tiles
        tile = fp8_block_linear(x[:tiles], w, s, block, backend="triton_stream",
                                out_dtype=torch.float32)
        assert torch.equal(got, tile[:M]), M


def test_stream_chunks_and_configs_ignore_batch():
    """The chunk count is a function of the weight shape; every launch the rules or the sweep
    can pick keeps the weight tile on wgmma's tall side (>= 64 rows, warp groups of 4)."""
    from hisparse.ops import _gemm_triton as G

    for N, K in [(7168, 2048), (1536, 7168), (576, 7168), (7168, 256), (3072, 1536)]:
        KB = K // 128
        s = G.stream_chunks(N, K, 128, 132)
        assert 1 <= s <= max(1, KB // 2) and G.triton.cdiv(KB, G.triton.cdiv(KB, s)) == s
    assert G.stream_chunks(576, 7168, 128, 132) > 1 and G.stream_chunks(7168, 256, 128, 132) == 1
    for M in (1, 5, 16, 33, 64, 100, 256, 512):
        cfgs = G.stream_configs(M) + [G.stream_config(M, 576, 7168, 14, 132)]
        assert cfgs
        for c in cfgs:
            assert c.block_n >= 64 and c.num_warps % 4 == 0 and c.block_t >= 16, c
            assert c.quant in ("gemm", "kernel")


def test_triton_act_quant_matches_torch(triton_cpu):
    from hisparse.ops._gemm_triton import quantize_fp8_act_triton

    x = torch.randn(21, 200, generator=torch.Generator().manual_seed(3)) * 5
    x[4] = 0.0
    for pow2 in (False, True):
        q, sc = quantize_fp8_act_triton(x, 64, pow2)
        q0, s0 = quantize_fp8_act(x, 64, pow2)
        assert q.dtype == FP8_DTYPE and q.shape == x.shape and sc.shape == s0.shape
        assert torch.equal(sc, s0)
        # the interpreter's fp32 -> fp8 cast loses a rounding up into the next binade (125.3 ->
        # 64, not 128): those elements are half torch's; every other one is equal
        qf, q0f = q.float(), q0.float()
        binade = (q0f != 0) & (torch.frexp(q0f.abs())[0] == 0.5) & (qf == q0f / 2)
        assert torch.equal(torch.where(binade, q0f, qf), q0f)
        assert binade.float().mean() < 0.05


def test_bad_shapes():
    w, s = _weights(32, 32, (16, 16))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_block_linear(torch.randn(2, 32), w, s[:1], (16, 16))
    with pytest.raises(ValueError, match="features"):
        fp8_block_linear(torch.randn(2, 31), w, s, (16, 16))
    with pytest.raises(ValueError, match="HISPARSE_FP8_GEMM"):
        fp8_block_linear(torch.randn(2, 32), w, s, (16, 16), backend="cublas")


# ----------------------------------------------------------------------------- GPU, real shapes
# One TP-8 rank of DeepSeek-V3.2 (N, K): q_a, kv_a (576: a partial 128-block), q_b, o_proj,
# indexer wq_b, dense gate/up and down, shared expert gate/up and down.
RANK_SHAPES = [(1536, 7168), (576, 7168), (3072, 1536), (7168, 2048), (8192, 1536),
               (2304, 7168), (7168, 2304), (256, 7168), (7168, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64, 256, 512])
@pytest.mark.parametrize("N,K", RANK_SHAPES)
def test_gpu_fp8_gemm_matches_reference(M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M + N)
    w, s = quantize_fp8_weight(torch.randn(N, K, device="cuda", generator=g) * 0.02)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    want = fp8_block_linear_reference(x, w, s, quantize_input=True, out_dtype=torch.float32)
    tol = 2e-3 * want.abs().max().item()
    # the caching allocator hands the NaN block back: an unwritten output element shows up
    torch.empty(M, N, device="cuda", dtype=torch.bfloat16).fill_(float("nan"))
    for backend in ("triton", "triton_stream"):
        got = fp8_block_linear(x, w, s, backend=backend)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=tol)
    # the tile kernel (the baseline, backend="triton_tile"; bf16 out: the benchmark's compiles)
    tile = fp8_block_linear(x, w, s, backend="triton_tile")
    torch.testing.assert_close(tile.float(), want, rtol=1e-2, atol=tol)
    if M % 16 == 0:
        # torch._scaled_mm where cuBLAS takes the block scaling (falls back to Triton otherwise)
        sm = fp8_block_linear(x, w, s, backend="scaled_mm", out_dtype=torch.float32)
        torch.testing.assert_close(sm, want, rtol=1e-2, atol=4 * tol)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", RANK_SHAPES)
def test_gpu_fp8_gemm_rows_are_batch_invariant(N, K):
    """Row i of a batch of M equals the same row in a batch of 512 (and alone), bitwise, for M
    over every token-tile width, both activation quantizers and both chunk modes the default
    launches pick (backend triton), and for the tile kernel's fixed tiles."""
    g = torch.Generator(device="cuda").manual_seed(N + K)
    w, s = quantize_fp8_weight(torch.randn(N, K, device="cuda", generator=g) * 0.02)
    x = torch.randn(512, K, device="cuda", generator=g, dtype=torch.bfloat16)
    for backend in ("triton", "triton_stream", "triton_tile"):
        full = fp8_block_linear(x, w, s, backend=backend)
        for M in (1, 7, 16, 33, 64, 100, 256, 300):
            got = fp8_block_linear(x[:M], w, s, backend=backend)
            assert torch.equal(got, full[:M]), (backend, M,
                                                (got.float() - full[:M].float()).abs().max())
        alone = fp8_block_linear(x[300:301], w, s, backend=backend)
        assert torch.equal(alone, full[300:301]), backend


# launches spanning the kinds the sweep may pick: token tiles 16..256, weight tiles 64..256,
# 4 and 8 warps, chain and split, both quantizers, one and two scale blocks a K step
SWEEP_SAMPLE = [(16, 64, 4, 4, True, "gemm"), (32, 128, 8, 4, False, "kernel"),
                (64, 64, 4, 3, True, "kernel"), (128, 128, 8, 3, True, "kernel"),
                (64, 256, 8, 3, True, "gemm"), (256, 64, 8, 3, True, "kernel"),
                (64, 128, 8, 4, False, "kernel"), (16, 64, 4, 4, True, "gemm", 2),
                (64, 128, 8, 3, False, "kernel", 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(576, 7168), (7168, 2048), (3072, 1536)])
def test_gpu_stream_launch_choices_do_not_change_bits(N, K):
    """Any launch configuration gives the default's bits (what lets STREAM_TABLE and the sweep
    pick per shape and M freely)."""
    from hisparse.ops._gemm_triton import StreamConfig, fp8_block_linear_stream

    g = torch.Generator(device="cuda").manual_seed(N)
    w, s = quantize_fp8_weight(torch.randn(N, K, device="cuda", generator=g) * 0.02)
    x = torch.randn(100, K, device="cuda", generator=g, dtype=torch.bfloat16)
    want = fp8_block_linear_stream(x, w, s, (128, 128), torch.bfloat16)
    for c in SWEEP_SAMPLE:
        got = fp8_block_linear_stream(x, w, s, (128, 128), torch.bfloat16,
                                      config=StreamConfig(*c))
        assert torch.equal(got, want), (c, (got.float() - want.float()).abs().max())


@pytest.mark.gpu
def test_gpu_act_quant_kernel_matches_gemm_loop():
    """The separate activation quantizer and the GEMM's in-loop one agree bitwise (the stream
    kernel switches between them by M), and both match torch's within one FP8 step."""
    from hisparse.ops._gemm_triton import quantize_fp8_act_triton

    x = torch.randn(77, 7168, device="cuda", dtype=torch.bfloat16) * 4
    for pow2 in (False, True):
        q, sc = quantize_fp8_act_triton(x, 128, pow2)
        q0, s0 = quantize_fp8_act(x, 128, pow2)
        torch.testing.assert_close(sc, s0, rtol=1e-6, atol=0)
        torch.testing.assert_close(dequantize_fp8_act(q, sc), dequantize_fp8_act(q0, s0),
                                   rtol=0.07, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(16, 1536, 7168), (256, 7168, 2048)])
def test_gpu_fp8_gemm_pow2_scales(M, N, K):
    """ue8m0 activation scales: the in-kernel exponent-bit rounding equals torch's."""
    w, s = quantize_fp8_weight(torch.randn(N, K, device="cuda") * 0.02)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    want = fp8_block_linear_reference(x, w, s, quantize_input=True, pow2_scale=True,
                                      out_dtype=torch.float32)
    for backend in ("triton", "triton_stream", "triton_tile"):
        got = fp8_block_linear(x, w, s, backend=backend, pow2_scale=True)
        torch.testing.assert_close(got.float(), want, rtol=1e-2,
                                   atol=2e-3 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(1536, 7168), (576, 7168)])
def test_gpu_fp8_gemm_is_deterministic_and_capturable(N, K):
    """The stream kernel's split chunks with the in-kernel reduction: the same bits on every
    call (200 back-to-back launches: the arrival counters are reset by each launch) and under
    graph replay."""
    from hisparse.ops import _gemm_triton as G

    w, s = quantize_fp8_weight(torch.randn(N, K, device="cuda") * 0.02)
    x = torch.randn(16, K, device="cuda", dtype=torch.bfloat16)
    sms = G._num_sms(x.device)
    assert G.stream_config(16, N, K, G.stream_chunks(N, K, 128, sms), sms).split
    a = fp8_block_linear(x, w, s, backend="triton_stream")
    outs = [fp8_block_linear(x, w, s, backend="triton_stream") for _ in range(200)]
    assert all(torch.equal(a, o) for o in outs)
    want = fp8_block_linear_reference(x, w, s, quantize_input=True, out_dtype=torch.float32)
    torch.testing.assert_close(a.float(), want, rtol=1e-2, atol=2e-3 * want.abs().max().item())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_block_linear(x, w, s, backend="triton_stream")
    x.copy_(torch.randn_like(x))
    for _ in range(3):
        graph.replay()
    assert torch.equal(out, fp8_block_linear(x, w, s, backend="triton_stream"))


def test_gemm_config_is_batch_invariant_for_decode_sized_steps():
    """A row's FP8 GEMM result must not depend on how many rows share its step (tiered and
    unconstrained runs batch differently): same tiles and K splits for every M up to the bound."""
    from hisparse.ops import _gemm_triton as G

    dev = torch.device("cpu")
    for N, KB in [(7168, 16), (1536, 56), (256, 56), (24576, 12)]:
        configs = {G.gemm_config(M, N, KB, 128, dev) for M in range(1, G.BATCH_INVARIANT_MAX_M + 1)}
        assert len(configs) == 1, (N, KB, configs)
    assert G.gemm_config(G.BATCH_INVARIANT_MAX_M + 1, 7168, 16, 128, dev)[2] == 1
