"""The split-K decode FP8 GEMM (``backend="triton"`` up to 512 rows) against the reference:
interpreter on CPU (small shapes), the rank's shapes on the GPU (batch invariance, launch
choices, CUDA-graph capture by ascending bucket then replay growing and shrinking)."""

import pytest
import torch

from hisparse.ops.gemm import (
    fp8_block_linear,
    fp8_block_linear_reference,
    quantize_fp8_weight,
)


def _weights(N, K, block, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, generator=g, device=device) * 0.05
    # per-row magnitudes that differ a lot, so a wrong scale index is caught
    rows = torch.rand(N, 1, generator=g, device=device) * 4 + 0.25
    return quantize_fp8_weight(w * rows, block)


def _cfg(bt, bn=64, level="chunk", quant="gemm", warps=4, stages=2):
    from hisparse.ops._gemm_splitk_triton import SplitKConfig

    return SplitKConfig(bt, bn, warps, stages, level, quant)


# (M, N, K, block, (chunks, groups), config): partial weight and token tiles, a partial last K
# block, a short last chunk and group, per-row weight scales (bn < BLOCK_N) and one per tile,
# one chunk, chunk / group / all-K programs, 16..128-wide token tiles, the default launch
CASES = [(1, 48, 80, (16, 16), None, None),
         (19, 70, 96, (32, 32), (2, 1), _cfg(32)),
         (3, 64, 128, (64, 32), (1, 1), _cfg(16)),
         (40, 130, 33, (32, 16), (2, 2), _cfg(64, level="group")),
         (70, 200, 256, (128, 128), (2, 1), _cfg(128, 128, level="all", warps=8)),
         (9, 72, 160, (32, 32), (5, 2), _cfg(32, 128)),
         (9, 72, 224, (32, 32), (3, 2), _cfg(16, level="all")),
         (21, 100, 480, (32, 32), (5, 2), _cfg(16, level="group", quant="kernel")),
         (21, 100, 480, (32, 32), (5, 3), _cfg(32))]


@pytest.mark.parametrize("M,N,K,block,counts,cfg", CASES)
def test_splitk_matches_reference(triton_cpu, poisoned_empty, M, N, K, block, counts, cfg):
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk, splitk_plan

    w, s = _weights(N, K, block, seed=M + N)
    x = torch.randn(M, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(K))
    plan = splitk_plan(N, K, block[1], *(counts or (None, None)))
    want = fp8_block_linear_reference(x, w, s, block, quantize_input=True, out_dtype=torch.float32)
    # (on CPU torch quantizes the activations: the interpreter's fp32 -> fp8 cast rounds
    # differently; the in-loop quantizer is checked against the kernel one below)
    got = fp8_block_linear_splitk(x, w, s, block, torch.float32, config=cfg, plan=plan)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    again = fp8_block_linear_splitk(x, w, s, block, torch.float32, config=cfg, plan=plan)
    assert torch.equal(again, got)  # no state kept between calls
    g16 = fp8_block_linear_splitk(x, w, s, block, torch.bfloat16, config=cfg, plan=plan)
    assert g16.dtype == torch.bfloat16 and g16.shape == (M, N)
    torch.testing.assert_close(g16.float(), want, rtol=1e-2, atol=1e-2)


def test_splitk_launch_choices_do_not_change_bits(triton_cpu, poisoned_empty):
    """For one plan, programs per chunk or per group (partial sums + the reduction launch) or
    over all of K (registers) and both in-kernel quantizers give identical bits; another plan
    does not (the numerics' one parameter). Tile shapes and the pipeline depth are the GPU's
    claim (its test): here ``tl.dot`` is numpy's matmul, which may round by the tile's shape,
    and the interpreter does not pipeline."""
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk, splitk_plan

    N, K, block = 96, 480, (32, 32)
    w, s = _weights(N, K, block, seed=5)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(6)) * 3
    plan = splitk_plan(N, K, 32, chunks=5, groups=2)  # 15 blocks: chunks of 3, groups 3 + 2
    assert (plan.chunk, plan.chunks, plan.group, plan.groups) == (3, 5, 3, 2)
    runs = {(level, quant, st): fp8_block_linear_splitk(
        x, w, s, block, torch.float32, config=_cfg(32, level=level, stages=st), plan=plan,
        quant=quant) for level in ("chunk", "group", "all") for quant in ("gemm", "kernel")
        for st in (1,)}
    first = runs[("all", "gemm", 1)]
    for key, got in runs.items():
        assert torch.equal(got, first), key
    for other_plan in (splitk_plan(N, K, 32, chunks=1, groups=1),
                       splitk_plan(N, K, 32, chunks=5, groups=1)):
        other = fp8_block_linear_splitk(x, w, s, block, torch.float32, config=_cfg(32),
                                        plan=other_plan, quant="gemm")
        torch.testing.assert_close(other, first, rtol=1e-5, atol=1e-5)
        assert not torch.equal(other, first), other_plan


# the default launches on CPU take the kernel paths of the reference cases above (activations
# quantized by torch), which the oldest Triton runs: this bitwise relation between them runs
# with the newest only (.ci/triton_matrix.sh; CI time: ~7 s interpreted)
@pytest.mark.newest_triton_only
def test_splitk_rows_are_batch_invariant(triton_cpu, poisoned_empty):
    """Row i of a batch of M (default launch from M, backend triton) equals the same row in the
    same token tile filled up, bitwise, and computed alone: the chunk count follows the weight
    shape only."""
    from hisparse.ops import _gemm_splitk_triton as G

    N, K, block = 96, 256, (32, 32)
    w, s = _weights(N, K, block, seed=11)
    x = torch.randn(130, K, generator=torch.Generator().manual_seed(12)) * 3
    plan = G.splitk_plan(N, K, 32)
    assert plan.chunks > 1
    full = fp8_block_linear(x, w, s, block, backend="triton", out_dtype=torch.float32)
    alone = torch.cat([fp8_block_linear(x[i:i + 1], w, s, block, backend="triton",
                                        out_dtype=torch.float32) for i in (0, 17, 129)])
    assert torch.equal(alone, full[[0, 17, 129]])
    for M in (2, 16, 17, 40, 64, 65):
        got = fp8_block_linear(x[:M], w, s, block, backend="triton", out_dtype=torch.float32)
        cfg = G.splitk_config(M, N, K, plan)
        tiles = -(-M // cfg.block_t) * cfg.block_t
        tile = G.fp8_block_linear_splitk(x[:tiles], w, s, block, torch.float32, config=cfg)
        assert torch.equal(got, tile[:M]), M


@pytest.mark.parametrize("G,kg,M,cfg", [(4, 32, 5, _cfg(16)), (3, 64, 9, _cfg(16, level="all")),
                                        (5, 32, 20, _cfg(32, level="group")),
                                        (2, 96, 3, _cfg(16, 128))])
@pytest.mark.parametrize("quant", ["gemm", "kernel", "torch"])
def test_splitk_reads_head_strided_activations_in_place(triton_cpu, poisoned_empty, G, kg, M,
                                                        cfg, quant):
    """``x [M, G, K // G]`` with the groups strided (the attention's ``[T, H, v]`` as the w_uv
    product leaves it, ``[H, T, v]`` in memory): bitwise the flattened copy's result, whatever
    the level and quantizer, one block or several per group. Fresh data each run."""
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk, splitk_plan

    N, K, block = 72, G * kg, (32, 32)
    w, s = _weights(N, K, block, seed=int(torch.randint(0, 2**30, ())))
    x = (torch.randn(G, M, kg) * 3).to(torch.bfloat16).transpose(0, 1)    # heads strided
    assert not x.is_contiguous()
    plan = splitk_plan(N, K, 32, chunks=min(3, K // 32), groups=2)
    flat = x.reshape(M, K)
    want = fp8_block_linear_splitk(flat, w, s, block, torch.float32, config=cfg, plan=plan,
                                   quant=quant)
    got = fp8_block_linear_splitk(x, w, s, block, torch.float32, config=cfg, plan=plan,
                                  quant=quant)
    assert got.shape == (M, N) and torch.equal(got, want)
    if quant == "torch":  # (the interpreter's fp32 -> fp8 cast rounds its own way)
        ref = fp8_block_linear_reference(flat, w, s, block, quantize_input=True,
                                         out_dtype=torch.float32)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_act_quant_kernel_reads_head_strided_activations(triton_cpu, poisoned_empty):
    from hisparse.ops._gemm_triton import quantize_fp8_act_triton

    x = (torch.randn(4, 7, 64) * 2).to(torch.bfloat16).transpose(0, 1)      # [7, 4, 64]
    q, sc = quantize_fp8_act_triton(x, 32)
    q2, sc2 = quantize_fp8_act_triton(x.reshape(7, 256), 32)
    assert q.shape == (7, 256) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(sc, sc2)


def test_fp8_block_linear_takes_split_k_rows(triton_cpu, no_force, kernel_switches):
    """``fp8_block_linear(x [M, G, K // G])``: ``[M, N]``, bitwise the flattened call's on every
    backend that runs here (in place on the split-K kernel, a copy elsewhere)."""
    from hisparse.ops import switches

    N, K, block = 40, 128, (32, 32)
    w, s = _weights(N, K, block, seed=3)
    x = torch.randn(4, 6, 32, dtype=torch.bfloat16).transpose(0, 1)          # [6, 4, 32]
    for force, backend in ((True, "triton"), (False, "reference")):
        kernel_switches(force_triton=force)
        assert switches.current().force_triton == force
        got = fp8_block_linear(x, w, s, block, backend=backend)
        assert got.shape == (6, N)
        assert torch.equal(got, fp8_block_linear(x.reshape(6, K), w, s, block, backend=backend))
    with pytest.raises(ValueError, match="features"):
        fp8_block_linear(x[..., :16], w, s, block)


def test_splitk_plan_follows_the_weight_shape_only():
    """The plan depends on (N, K) alone and covers K with full runs but the last, chunks of
    >= 2 blocks, and gives the rank's linears enough programs to fill the SMs several times;
    every candidate launch keeps the weight on wgmma's tall side."""
    from hisparse.ops import _gemm_splitk_triton as G

    for N, K in [(1536, 7168), (576, 7168), (3072, 1536), (7168, 2048), (8192, 1536),
                 (2304, 7168), (7168, 2304), (128, 7168), (7168, 256)]:
        KB = K // 128
        p = G.splitk_plan(N, K)
        assert p.chunk * (p.chunks - 1) < KB <= p.chunk * p.chunks, (N, K, p)
        assert p.group * (p.groups - 1) < p.chunks <= p.group * p.groups, (N, K, p)
        assert p.chunks == 1 or p.chunk >= G.MIN_CHUNK, (N, K, p)
        if N >= 512 and KB >= 12:
            assert -(-N // 64) * p.chunks >= 250, (N, K, p)
    assert G.splitk_plan(7168, 256).chunks == 1 and G.splitk_plan(1536, 7168).groups > 1
    plan = G.splitk_plan(576, 7168)
    for M in (1, 5, 8, 16, 24, 33, 48, 64, 100, 128, 256, 512):
        assert G.m_bucket(M) >= M
        for c in G.splitk_configs(M) + [G.splitk_config(M, 576, 7168, plan)]:
            assert c.block_n >= 64 and c.num_warps % 4 == 0 and c.block_t >= 16, c
            assert c.quant in ("gemm", "kernel") and c.level in G.LEVELS, c
            assert G.SplitKConfig.parse(str(c)) == c


def test_splitk_bad_arguments(triton_cpu):
    from hisparse.ops._gemm_splitk_triton import SplitKPlan, fp8_block_linear_splitk

    w, s = _weights(32, 64, (32, 32))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="quant"):
        fp8_block_linear_splitk(x, w, s, (32, 32), torch.float32, quant="x")
    with pytest.raises(ValueError, match="level"):
        fp8_block_linear_splitk(x, w, s, (32, 32), torch.float32, config=_cfg(16, level="x"))
    with pytest.raises(ValueError, match="cover"):
        fp8_block_linear_splitk(x, w, s, (32, 32), torch.float32, plan=SplitKPlan(1, 1, 1, 1))


# ----------------------------------------------------------------------------- GPU, real shapes
# One TP-8 rank of DeepSeek-V3.2 (N, K): q_a, kv_a (576: a partial 128-row scale block), q_b,
# o_proj, indexer wq_b and wk, dense gate / up (each) and down, shared expert gate/up and down.
RANK_SHAPES = [(1536, 7168), (576, 7168), (3072, 1536), (7168, 2048), (8192, 1536),
               (128, 7168), (2304, 7168), (7168, 2304), (512, 7168), (7168, 256)]
GPU_MS = (1, 8, 24, 48, 64, 128, 256, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", RANK_SHAPES)
def test_gpu_splitk_matches_reference(N, K):
    from hisparse.ops._gemm_splitk_triton import fp8_block_linear_splitk

    w, s = _weights(N, K, (128, 128), seed=N + K, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(K)
    for M in GPU_MS:
        x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
        want = fp8_block_linear_reference(x, w, s, quantize_input=True, out_dtype=torch.float32)
        tol = 2e-3 * want.abs().max().item()
        # the caching allocator hands the NaN blocks back: an unwritten element shows up
        torch.empty(8 * M, N, device="cuda", dtype=torch.float32).fill_(float("nan"))
        got = fp8_block_linear(x, w, s, backend="triton")
        assert got.dtype == torch.bfloat16 and got.shape == (M, N)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=tol)
        f32 = fp8_block_linear_splitk(x, w, s, (128, 128), torch.float32)
        torch.testing.assert_close(f32, want, rtol=1e-2, atol=tol)
        assert torch.equal(f32.to(torch.bfloat16), got)  # one rounding of the same sums


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", RANK_SHAPES)
def test_gpu_splitk_rows_are_batch_invariant(N, K):
    """Row i of a batch of M equals the same row in a batch of 512 (and alone), bitwise, for M
    across every bucket (default launches: token tiles 16..64, weight tiles 64/128, chunk,
    group and all-K programs, both quantizers), and under every candidate launch of the sweep
    (M = 7, 24, 48, 100, 300 meet them all: the candidates differ by token tile only)."""
    from hisparse.ops import _gemm_splitk_triton as G

    w, s = _weights(N, K, (128, 128), seed=N, device="cuda")
    x = torch.randn(512, K, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(N + 1)) * 2
    full = fp8_block_linear(x, w, s, backend="triton")
    for M in (1, 7, 8, 16, 24, 33, 48, 64, 100, 128, 200, 256, 300, 511):
        got = fp8_block_linear(x[:M], w, s, backend="triton")
        assert torch.equal(got, full[:M]), (M, (got.float() - full[:M].float()).abs().max())
        for cfg in G.splitk_configs(M) if M in (7, 24, 48, 100, 300) else ():
            got = G.fp8_block_linear_splitk(x[:M], w, s, (128, 128), torch.bfloat16, config=cfg)
            assert torch.equal(got, full[:M]), (M, str(cfg))
    alone = fp8_block_linear(x[300:301], w, s, backend="triton")
    assert torch.equal(alone, full[300:301])


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(1536, 7168), (7168, 2048)])
def test_gpu_splitk_pow2_scales(N, K):
    w, s = _weights(N, K, (128, 128), seed=3, device="cuda")
    for M in (16, 256):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        want = fp8_block_linear_reference(x, w, s, quantize_input=True, pow2_scale=True,
                                          out_dtype=torch.float32)
        got = fp8_block_linear(x, w, s, backend="triton", pow2_scale=True)
        torch.testing.assert_close(got.float(), want, rtol=1e-2,
                                   atol=2e-3 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(1536, 7168), (576, 7168), (7168, 2048)])
def test_gpu_splitk_graphs_ascending_capture_then_replay_up_and_down(N, K):
    """As the engine runs it: one graph per batch bucket captured in ascending order on static
    buffers, then replays growing and shrinking with fresh inputs: each equals the eager call
    bitwise, and a bucket's rows equal the largest bucket's (batch invariance under graphs)."""
    from hisparse.ops._gemm_splitk_triton import M_BUCKETS

    w, s = _weights(N, K, (128, 128), seed=7, device="cuda")
    xbuf = torch.randn(M_BUCKETS[-1], K, device="cuda", dtype=torch.bfloat16)
    fp8_block_linear(xbuf, w, s, backend="triton")  # warm-up (compiles) outside any capture
    pool = torch.cuda.graph_pool_handle()
    graphs, outs = {}, {}
    for M in M_BUCKETS:
        fp8_block_linear(xbuf[:M], w, s, backend="triton")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            outs[M] = fp8_block_linear(xbuf[:M], w, s, backend="triton")
        graphs[M] = g
    order = list(M_BUCKETS) + list(reversed(M_BUCKETS[:-1])) + [1, 512, 8, 256]
    for i, M in enumerate(order):
        xbuf.copy_(torch.randn_like(xbuf) * (1 + i % 3))
        graphs[M].replay()
        want = fp8_block_linear(xbuf[:M], w, s, backend="triton")
        assert torch.equal(outs[M], want), (i, M)
        graphs[M_BUCKETS[-1]].replay()
        assert torch.equal(outs[M_BUCKETS[-1]][:M], want), (i, M)


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_o_proj_reads_the_heads_in_place(pow2):
    """The TP-8 rank's o_proj (7168 x 2048: 16 heads x v_head 128) on the attention's per-head
    output exactly as ``DSAAttention.forward`` makes it (``einsum("thr,hvr->thv")`` over
    kv_lora 512: cuBLAS's bmm leaves ``[H, T, v]`` storage) read in place (one 128-wide K block
    per head) equals the call on the flattened copy bitwise, T = 1..96 (every bucket and both
    quantizers: "kernel" from 48 rows)."""
    H, R, V, N = 16, 512, 128, 7168
    w, s = _weights(N, H * V, (128, 128), seed=21, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(22)
    w_uv = torch.randn(H, V, R, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    for T in range(1, 97):
        out = torch.randn(T, H, R, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.einsum("thr,hvr->thv", out, w_uv)
        if T > 1:
            assert v.stride() == (V, T * V, 1), v.stride()   # what the copy was for
        torch.empty(8 * T, N, device="cuda", dtype=torch.float32).fill_(float("nan"))
        got = fp8_block_linear(v, w, s, backend="triton", pow2_scale=pow2)
        want = fp8_block_linear(v.reshape(T, H * V), w, s, backend="triton", pow2_scale=pow2)
        assert got.shape == (T, N) and torch.equal(got, want), T
