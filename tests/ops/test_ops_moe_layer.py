"""The fused MoE layer (router GEMM + routing + alignment + grouped GEMMs with the shared expert +
combine) against its references: Triton under the CPU interpreter at small sizes, CUDA at one
TP-8 rank's shapes."""

import functools

import pytest
import torch

from hisparse.ops import switches
from hisparse.ops.gemm import quantize_fp8_weight
from hisparse.ops.moe import fused_moe_reference, moe_align_reference
from hisparse.ops.moe_layer import (
    AlignConfig,
    RouterConfig,
    RoutingConfig,
    SharedExpert,
    align,
    combine,
    combine_reference,
    moe_layer,
    quantize_act,
    route,
    route_quantized,
    route_reference,
)
from hisparse.ops.moe_tiles import moe_max_tiles


def _router(E, D, seed, device="cpu"):
    g = torch.Generator(device).manual_seed(seed)
    # bf16-valued fp32 weight, as DeepSeek's checkpoints store the gate
    w = (torch.randn(E, D, generator=g, device=device) * D ** -0.5).bfloat16().float()
    return w, torch.randn(E, generator=g, device=device) * 0.05


def _torch_topk_route(x, w, b, cfg):
    """transformers' router (torch.topk): the model's unfused path."""
    from hisparse.models.dsa import DSARouter

    r = DSARouter.__new__(DSARouter)
    torch.nn.Module.__init__(r)
    r.weight, r.e_score_correction_bias = torch.nn.Parameter(w), torch.nn.Parameter(b)
    r.top_k, r.n_group, r.topk_group = cfg.top_k, cfg.n_group, cfg.topk_group
    r.norm_topk_prob, r.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
    return r(x)


@pytest.mark.parametrize("T,E,G,tg,k,ns,norm,bias", [
    (5, 16, 4, 2, 4, 1, True, True), (19, 32, 8, 3, 6, 0, False, True),
    (3, 16, 1, 1, 8, 2, True, False), (1, 8, 2, 2, 2, 1, True, True),
    (19, 24, 4, 2, 4, 1, True, True)])   # 6 experts a group: padded slots alias the next group
def test_route_matches_reference(triton_cpu, T, E, G, tg, k, ns, norm, bias):
    D = 80
    w, b = _router(E, D, seed=T + E)
    b = b if bias else None
    cfg = RoutingConfig(k, G, tg, norm, 2.5)
    x = torch.randn(T, D).bfloat16()
    ids, wt = route(x, w, b, cfg, ns)
    want_ids, want_w = route_reference(x, w, b, cfg, ns)
    assert ids.dtype == torch.int32 and ids.shape == (T, k + ns)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(wt, want_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(ids[:, k:], torch.arange(E, E + ns, dtype=torch.int32).expand(T, ns))
    # the same experts and weights as the model's torch.topk router
    t_ids, t_w = _torch_topk_route(x.float(), w, b if b is not None else torch.zeros(E), cfg)
    order = t_ids.sort(1).indices
    torch.testing.assert_close(ids[:, :k].sort(1).values.long(), t_ids.gather(1, order),
                               rtol=0, atol=0)
    torch.testing.assert_close(wt[:, :k].gather(1, ids[:, :k].long().argsort(1)),
                               t_w.gather(1, order), rtol=1e-5, atol=1e-7)


def test_route_takes_a_bf16_gate(triton_cpu):
    """A gate stored in bf16 (``DSAForCausalLM.narrow_fp32_weights_``) routes as its fp32
    form: the same values."""
    E, D, T = 32, 80, 9
    w, b = _router(E, D, seed=4)
    cfg = RoutingConfig(6, 8, 3, True, 2.5)
    x = torch.randn(T, D).bfloat16()
    ids, wt = route(x, w.bfloat16(), b, cfg, 1)
    want_ids, want_w = route(x, w, b, cfg, 1)
    assert torch.equal(ids, want_ids) and torch.equal(wt, want_w)
    from hisparse.ops._gemm_splitk_triton import fp32_precision
    assert fp32_precision(x, w.bfloat16()) == "ieee"       # the interpreter's fp32 dots


def test_route_ties_go_to_the_lower_index(triton_cpu):
    E, D, G = 16, 64, 4
    g = torch.Generator().manual_seed(3)
    # small integers over 64: every logit exact whatever the summation order, so ties are exact
    w = torch.randint(-3, 4, (E, D), generator=g).float() / 64
    w[9] = w[2]                     # experts 2 and 9 always tie, as do groups 1 and 3
    w[4:8] = w[12:16]
    b = torch.zeros(E)
    cfg = RoutingConfig(3, G, 2, True, 1.0)
    x = torch.randint(-3, 4, (12, D), generator=g).float()
    ids, wt = route(x, w, b, cfg)
    want_ids, want_w = route_reference(x, w, b, cfg)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(wt, want_w, rtol=1e-6, atol=1e-7)
    # groups 1 and 3 tie: 3 only with 1; within them expert 12 + i only with its twin 4 + i
    chosen = torch.zeros(12, E, dtype=torch.bool).scatter_(1, ids.long(), True)
    assert chosen[:, 4:8].any()
    assert not (chosen[:, 12:16] & ~chosen[:, 4:8]).any()
    assert not (chosen[:, 9] & ~chosen[:, 2] & chosen[:, 0:4].any(1)).any()


def test_route_rejects_bad_groups():
    w, b = _router(12, 16, seed=0)
    with pytest.raises(ValueError, match="n_group=5"):
        route(torch.randn(2, 16), w, b, RoutingConfig(2, 5, 1, True, 1.0))


def test_route_config_is_checked(triton_cpu):
    w, b = _router(16, 64, seed=0)
    cfg = RoutingConfig(2, 4, 2, True, 1.0)
    with pytest.raises(ValueError, match="k_split=96"):
        route(torch.randn(2, 64), w, b, cfg, config=RouterConfig(k_split=96))
    with pytest.raises(ValueError, match="k_split=64"):
        route(torch.randn(2, 64), w, b, cfg, config=RouterConfig(k_split=64, block_k=128))
    with pytest.raises(ValueError, match="block_t=24"):
        route(torch.randn(2, 64), w, b, cfg, config=RouterConfig(k_split=64, block_t=24))


@pytest.mark.parametrize("block_t", [16, 32])
def test_route_under_other_launches(triton_cpu, block_t):
    c = RouterConfig(k_split=64, block_t=block_t, block_k=32, block_e=8, route_tokens=2)
    T, E, D = 37, 16, 200      # a partial last token tile at either width
    w, b = _router(E, D, seed=1)
    x = torch.randn(T, D).bfloat16()
    ids, wt = route(x, w, b, CFG, 1, config=c)
    want_ids, want_w = route_reference(x, w, b, CFG, 1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(wt, want_w, rtol=1e-6, atol=1e-7)


def _distinct_ids(T, k, E, seed, shared=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.long)
    sh = torch.arange(E, E + shared).expand(T, shared)
    return torch.cat([ids, sh], 1).to(torch.int32)


def _poisoned_out(T, k, E, bm, device="cpu"):
    n = moe_max_tiles(T * k, E, bm)
    return (torch.full((n * bm,), 12345, dtype=torch.int32, device=device),
            torch.full((n,), 12345, dtype=torch.int32, device=device))


@pytest.mark.parametrize("T,k,E,shared,bm,cfg", [
    (1, 2, 8, 1, 16, AlignConfig(2, 16)), (37, 3, 8, 1, 16, AlignConfig(4, 32)),
    (20, 4, 64, 0, 32, AlignConfig(8, 64)), (40, 8, 256, 1, 16, AlignConfig(32, 128)),
    (0, 3, 8, 1, 16, AlignConfig())])
@pytest.mark.parametrize("mode", ["experts", "single"])
def test_align_matches_reference(triton_cpu, T, k, E, shared, bm, cfg, mode):
    ids = _distinct_ids(T, k, E, seed=T, shared=shared)
    out = _poisoned_out(T, k + shared, E + shared, bm)
    got_ids, got_e = align(ids, E + shared, bm, mode=mode, config=cfg, out=out)
    want_ids, want_e = moe_align_reference(ids, E + shared, bm)
    assert got_ids.data_ptr() == out[0].data_ptr()
    assert torch.equal(got_ids, want_ids) and torch.equal(got_e, want_e)


def test_align_mode_and_config_are_checked(monkeypatch):
    ids = _distinct_ids(2, 2, 8, seed=0)
    with pytest.raises(ValueError, match="mode='sorted'"):
        align(ids, 8, 16, use_triton=True, mode="sorted")
    monkeypatch.setenv("HISPARSE_MOE_ALIGN", "sorted")
    with pytest.raises(ValueError, match="HISPARSE_MOE_ALIGN='sorted'"):
        switches.reload()
    with pytest.raises(ValueError, match="experts=3"):
        align(ids, 8, 16, use_triton=True, mode="experts", config=AlignConfig(experts=3))
    with pytest.raises(ValueError, match="align out"):
        align(ids, 8, 16, use_triton=True, mode="experts", out=_poisoned_out(3, 2, 8, 16))


def test_route_quantized_quantizes_x_in_the_router_gemm(triton_cpu):
    from hisparse.ops.gemm import quantize_fp8_act

    T, E, D = 19, 16, 2 * 512 + 96        # a partial split and a partial quant block
    w, b = _router(E, D, seed=5)
    x = torch.randn(T, D).bfloat16() * torch.rand(T, 1).bfloat16() * 8
    ids, wt, (q, sc) = route_quantized(x, w, b, CFG, 1, 128, False)
    want_ids, want_w = route(x, w, b, CFG, 1)
    assert torch.equal(ids, want_ids) and torch.equal(wt, want_w)
    assert torch.equal(sc, quantize_fp8_act(x, 128, False)[1])
    # the interpreter's fp32 -> fp8 cast is not torch's (the GPU test compares with torch
    # bitwise): here the same bits as the quantization kernel under the same interpreter
    kq, ks = quantize_act(x, 128, False, use_triton=True)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(ks, sc)
    assert torch.equal(q.view(torch.uint8), kq.view(torch.uint8))
    with pytest.raises(ValueError, match="block_k=96"):
        route_quantized(x, w, b, CFG, 1, 96, False)


def test_combine_sums_rows_in_slot_order(triton_cpu):
    y = torch.randn(7 * 5, 40)
    assert torch.equal(combine(y, 7, torch.float32), combine_reference(y, 7, torch.float32))
    # the interpreter casts fp32 -> bf16 by truncation: within one bf16 ulp of the reference
    got = combine(y.bfloat16(), 7, torch.bfloat16).float()
    want = combine_reference(y.bfloat16(), 7, torch.float32)
    assert ((got - want).abs() <= want.abs() * 2 ** -7).all()


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_act_kernel(triton_cpu, pow2):
    from hisparse.ops.gemm import quantize_fp8_act

    x = torch.randn(21, 80) * torch.rand(21, 1) * 10
    q, s = quantize_act(x, 32, pow2, use_triton=True)
    want_q, want_s = quantize_fp8_act(x, 32, pow2)
    # the scales exactly; the interpreter's fp32 -> fp8 cast is not torch's (the GPU test
    # compares the FP8 values bitwise): here only its shape and dtype
    assert torch.equal(s, want_s)
    assert q.dtype == torch.float8_e4m3fn and q.shape == want_q.shape


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_quantize_act_kernel_is_torchs(pow2):
    from hisparse.ops.gemm import quantize_fp8_act

    x = torch.randn(300, 7168, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_act(x, 128, pow2)
    want_q, want_s = quantize_fp8_act(x, 128, pow2)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def _experts(E, I, D, seed, device="cpu"):
    g = torch.Generator(device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    gu = torch.randn(E + 1, 2 * I, D, **kw) * D ** -0.5     # the last: the shared one
    dn = torch.randn(E + 1, D, I, **kw) * I ** -0.5
    return gu, dn


def _split(gu, dn, scales=None):
    """Routed experts [:E] and the shared one (expert E) as a SharedExpert."""
    I = dn.shape[2]
    if scales is None:
        return gu[:-1], dn[:-1], SharedExpert(gu[-1, :I], gu[-1, I:], dn[-1])
    gus, dns = scales
    nbi = gus.shape[1] // 2
    return gu[:-1], dn[:-1], SharedExpert(gu[-1, :I], gu[-1, I:], dn[-1], gus[-1, :nbi],
                                          gus[-1, nbi:], dns[-1])


def _quantized(gu, dn, block):
    I = dn.shape[2]
    g_q, g_s = quantize_fp8_weight(gu[:, :I], block)
    u_q, u_s = quantize_fp8_weight(gu[:, I:], block)
    d_q, d_s = quantize_fp8_weight(dn, block)
    return torch.cat([g_q, u_q], 1), torch.cat([g_s, u_s], 1), d_q, d_s


CFG = RoutingConfig(top_k=3, n_group=4, topk_group=2, norm_topk_prob=True,
                    routed_scaling_factor=2.5)


@pytest.mark.parametrize("shared", [True, False])
def test_layer_plain_fp32_matches_reference(triton_cpu, shared):
    T, E, I, D = 11, 16, 32, 64
    gu, dn = _experts(E, I, D, seed=1)
    rw, rb = _router(E, D, seed=2)
    x = torch.randn(T, D)
    r_gu, r_dn, sh = _split(gu, dn)
    got = moe_layer(x, rw, rb, CFG, r_gu, r_dn, shared=sh if shared else None)
    ids, w = route_reference(x, rw, rb, CFG, int(shared))
    want = fused_moe_reference(x, ids.long(), w, gu if shared else r_gu, dn if shared else r_dn)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pow2", [False, True])
def test_layer_fp8_with_shared_matches_reference(triton_cpu, pow2):
    T, E, I, D, block = 9, 16, 32, 64, (32, 32)
    gu, dn = _experts(E, I, D, seed=3)
    gu_q, gu_s, dn_q, dn_s = _quantized(gu, dn, block)
    rw, rb = _router(E, D, seed=4)
    x = torch.randn(T, D)
    r_gu, r_dn, sh = _split(gu_q, dn_q, (gu_s, dn_s))
    got = moe_layer(x, rw, rb, CFG, r_gu, r_dn, gate_up_scale=gu_s[:-1], down_scale=dn_s[:-1],
                    block=block, pow2_scale=pow2, shared=sh)
    ids, w = route_reference(x, rw, rb, CFG, 1)
    want = fused_moe_reference(x, ids.long(), w, gu_q, dn_q, gate_up_scale=gu_s,
                               down_scale=dn_s, block=block, quantize_input=True,
                               pow2_scale=pow2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_quant_mode_is_checked(kernel_switches, monkeypatch):
    """A bad placement is refused, by name, as an override or from the environment, and
    changes nothing."""
    with pytest.raises(ValueError, match="moe_quant .*'tile'"):
        kernel_switches(moe_quant="tile")
    monkeypatch.setenv("HISPARSE_MOE_QUANT", "tile")
    with pytest.raises(ValueError, match="HISPARSE_MOE_QUANT='tile'"):
        switches.reload()
    assert switches.current().moe_quant == "router"


def test_intermediate_quantized_in_the_gate_up_epilogue(triton_cpu, pow2=True):
    """The gate-up epilogue's FP8 intermediate gives the down GEMM's in-tile bits (the same
    quantization of the same rounded values; under one interpreter both casts agree)."""
    from hisparse.ops._moe_triton import grouped_moe

    T, E, I, D, block = 6, 8, 64, 64, (32, 32)
    gu, dn = _experts(E, I, D, seed=8)
    gu_q, gu_s, dn_q, dn_s = _quantized(gu, dn, block)
    x = torch.randn(T, D)
    ids = _distinct_ids(T, 2, E, seed=9)
    w = torch.rand(T, 2) + 0.1
    s_ids, t_e = align(ids, E, 16, use_triton=False)
    run = functools.partial(grouped_moe, x, s_ids, t_e, 16, w, gu_q, dn_q, gu_s, dn_s, block,
                            pow2, skip_empty=True)
    got = run(h_quant="epilogue")
    assert torch.equal(got, run(h_quant="tile"))
    want = fused_moe_reference(x, ids.long(), w, gu_q, dn_q, gate_up_scale=gu_s,
                               down_scale=dn_s, block=block, quantize_input=True,
                               pow2_scale=pow2)
    assert got.shape == (T * 2, D) and got.isfinite().all()
    assert (got.view(T, 2, D).sum(1) - want).abs().max() < 0.5 * want.abs().max()
    with pytest.raises(ValueError, match="gate-up N tile"):
        run(h_quant="epilogue", tile_n=(64, 128))


def test_shared_expert_of_another_shape_is_refused(triton_cpu):
    gu, dn = _experts(8, 32, 64, seed=0)
    r_gu, r_dn, sh = _split(gu, dn)
    sh.down = sh.down[:, :16]
    with pytest.raises(ValueError, match="shared expert down"):
        moe_layer(torch.randn(2, 64), *_router(8, 64, 0), RoutingConfig(2, 2, 1, True, 1.0),
                  r_gu, r_dn, shared=sh)


# ----------------------------------------------------------------------------- GPU, rank shapes
RANK = RoutingConfig(top_k=8, n_group=8, topk_group=4, norm_topk_prob=True,
                     routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def rank_layer():
    """One TP-8 rank's MoE layer (FP8, random): built once, fresh inputs per test."""
    return _rank_layer(seed=7)


def _rank_layer(seed):
    E, I, D = 256, 256, 7168
    gu, dn = _experts(E, I, D, seed=seed, device="cuda")
    gu_q, gu_s, dn_q, dn_s = _quantized(gu, dn, (128, 128))
    del gu, dn
    rw, rb = _router(E, D, seed=seed + 1, device="cuda")
    r_gu, r_dn, sh = _split(gu_q, dn_q, (gu_s, dn_s))
    kw = dict(gate_up_scale=gu_s[:-1], down_scale=dn_s[:-1], block=(128, 128), shared=sh)
    return (rw, rb, r_gu, r_dn), kw, (gu_q, gu_s, dn_q, dn_s)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 24, 64, 256])
def test_gpu_route_matches_reference(T):
    E, D = 256, 7168
    g = torch.Generator("cuda").manual_seed(T)
    # logits exact in any summation order (multiples of 2^-10), many of them tied
    w = torch.randint(-1, 2, (E, D), generator=g, device="cuda").float() / 1024
    b = torch.randint(-8, 9, (E,), generator=g, device="cuda").float() / 1024
    x = torch.randint(-3, 4, (T, D), generator=g, device="cuda").to(torch.bfloat16)
    want_ids, want_w = route_reference(x, w, b, RANK, 1)
    # every launch (the benchmark's candidates): exact logits, so the same choice
    for c in (None, RouterConfig(route_tokens=1, route_warps=1), RouterConfig(block_e=64),
              RouterConfig(k_split=256, block_k=128, gemm_warps=8), RouterConfig(block_e=16),
              RouterConfig(block_t=32), RouterConfig(block_t=64, block_e=64, gemm_warps=8)):
        for gate in (w, w.bfloat16()):      # 3xTF32 and the one bf16 pass
            ids, wt = route(x, gate, b, RANK, 1, config=c)
            assert torch.equal(ids, want_ids), (c, gate.dtype)
            torch.testing.assert_close(wt, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_gpu_bf16_gate_is_batch_invariant_and_routes_as_fp32():
    """The bf16 pass on a DeepSeek-like gate: rows bitwise alone or in any batch; the same
    experts as the 3xTF32 pass over the same (bf16-valued) fp32 weight but for near ties,
    whose logits differ by the MMAs' fp32 summation only."""
    from hisparse.ops._gemm_splitk_triton import fp32_precision

    E, D = 256, 7168
    w, b = _router(E, D, seed=21, device="cuda")
    x = torch.randn(512, D, device="cuda", dtype=torch.bfloat16)
    assert fp32_precision(x, w.bfloat16()) == "bf16" and fp32_precision(x, w) == "tf32x3"
    ids, wt = route(x, w.bfloat16(), b, RANK, 1)
    for T in (1, 8, 16, 24, 48, 96, 128, 256):
        i2, w2 = route(x[:T], w.bfloat16(), b, RANK, 1)
        assert torch.equal(i2, ids[:T]) and torch.equal(w2, wt[:T]), T
    ids32, wt32 = route(x, w, b, RANK, 1)
    same = (ids == ids32).all(1)
    assert same.float().mean() >= 0.98
    torch.testing.assert_close(wt[same], wt32[same], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 24, 64, 256])
def test_gpu_layer_fp8_matches_reference(rank_layer, T):
    args, kw, (gu_q, gu_s, dn_q, dn_s) = rank_layer
    x = torch.randn(T, 7168, device="cuda", dtype=torch.bfloat16)
    ids, w = route(x, args[0], args[1], RANK, 1)
    ref_ids, ref_w = route_reference(x, args[0], args[1], RANK, 1)
    # the router GEMM sums in another order than cuBLAS: the same experts but for near ties
    same = (ids.sort(1).values == ref_ids.sort(1).values).all(1)
    assert same.float().mean() >= 0.95
    by_id = w.gather(1, ids.sort(1).indices)
    ref_by_id = ref_w.gather(1, ref_ids.sort(1).indices)
    torch.testing.assert_close(by_id[same], ref_by_id[same], rtol=1e-4, atol=1e-6)
    got = moe_layer(x, *args[:2], RANK, *args[2:], **kw)
    want = fused_moe_reference(x, ids.long(), w, gu_q, dn_q, gate_up_scale=gu_s,
                               down_scale=dn_s, block=(128, 128), quantize_input=True).float()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.gpu
def test_gpu_layer_rows_are_batch_invariant(rank_layer):
    args, kw, _ = rank_layer
    x = torch.randn(512, 7168, device="cuda", dtype=torch.bfloat16)
    full = moe_layer(x, *args[:2], RANK, *args[2:], **kw)
    ids, w = route(x, args[0], args[1], RANK, 1)
    for T in (1, 8, 16, 24, 48, 64, 128, 256):
        assert torch.equal(moe_layer(x[:T], *args[:2], RANK, *args[2:], **kw), full[:T]), T
        i2, w2 = route(x[:T], args[0], args[1], RANK, 1)
        assert torch.equal(i2, ids[:T]) and torch.equal(w2, w[:T]), T


@pytest.mark.gpu
def test_gpu_layer_captures_and_replays_new_inputs(rank_layer):
    args, kw, _ = rank_layer
    x = torch.randn(24, 7168, device="cuda", dtype=torch.bfloat16)
    moe_layer(x, *args[:2], RANK, *args[2:], **kw)  # compile (and tune) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_layer(x, *args[:2], RANK, *args[2:], **kw)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, moe_layer(x, *args[:2], RANK, *args[2:], **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 24, 64, 256, 512])
def test_gpu_align_matches_reference(T):
    ids = _distinct_ids(T, 8, 256, seed=T, shared=1)
    want_ids, want_e = moe_align_reference(ids, 257, 16)
    ids = ids.cuda()
    for mode, cfg in (("experts", AlignConfig()), ("experts", AlignConfig(4, 512)),
                      ("experts", AlignConfig(16, 1024, 8)), ("experts", AlignConfig(32, 256)),
                      ("single", None)):
        got_ids, got_e = align(ids, 257, 16, mode=mode, config=cfg,
                               out=_poisoned_out(T, 9, 257, 16, "cuda"))
        assert torch.equal(got_ids.cpu(), want_ids) and torch.equal(got_e.cpu(), want_e), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_route_quantized_is_quantize_act(pow2):
    from hisparse.ops.gemm import quantize_fp8_act

    w, b = _router(256, 7168, seed=11, device="cuda")
    for T in (1, 24, 300):
        x = torch.randn(T, 7168, device="cuda", dtype=torch.bfloat16) * 4
        ids, wt, (q, sc) = route_quantized(x, w, b, RANK, 1, 128, pow2)
        want_ids, want_w = route(x, w, b, RANK, 1)
        want_q, want_s = quantize_fp8_act(x, 128, pow2)
        assert torch.equal(ids, want_ids) and torch.equal(wt, want_w)
        assert torch.equal(sc, want_s)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 24, 64, 256, 512])
def test_gpu_layer_glue_modes_agree_bitwise(rank_layer, kernel_switches, T):
    """Every alignment and quantization placement gives the baseline's bits (the one-program
    alignment, two quantization kernels), and so does quantizing in every GEMM tile."""
    args, kw, _ = rank_layer
    x = torch.randn(T, 7168, device="cuda", dtype=torch.bfloat16)
    kernel_switches(moe_align="single", moe_quant="kernel")
    base = moe_layer(x, *args[:2], RANK, *args[2:], **kw)
    assert torch.equal(moe_layer(x, *args[:2], RANK, *args[2:], prequant=False, **kw), base)
    for a in ("experts", "single"):
        for q in ("fused", "gate_up", "router", "kernel"):
            kernel_switches(moe_align=a, moe_quant=q)
            assert torch.equal(moe_layer(x, *args[:2], RANK, *args[2:], **kw), base), (a, q)
    for tile_n in ((32, 128), (128, 64), (64, 32)):   # the benchmark's candidates
        got = moe_layer(x, *args[:2], RANK, *args[2:], tile_n=tile_n, **kw)
        assert torch.equal(got, base), tile_n


@pytest.mark.gpu
def test_gpu_layer_graphs_captured_ascending_replay_in_any_order(rank_layer):
    """As the engine captures (ascending buckets, one pool, static inputs sliced from one
    buffer) and replays (growing and shrinking): each replay is the eager result of its input."""
    args, kw, _ = rank_layer
    buckets = (8, 16, 48, 64, 256, 512)
    x = torch.randn(max(buckets), 7168, device="cuda", dtype=torch.bfloat16)
    pool = torch.cuda.graph_pool_handle()
    graphs, outs = {}, {}
    for T in buckets:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe_layer(x[:T], *args[:2], RANK, *args[2:], **kw)   # compile, tune, warm up
        torch.cuda.current_stream().wait_stream(stream)
        graphs[T] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[T], pool=pool):
            outs[T] = moe_layer(x[:T], *args[:2], RANK, *args[2:], **kw)
    for T in (512, 8, 64, 16, 256, 48, 8, 512):
        x.copy_(torch.randn_like(x))
        graphs[T].replay()
        assert torch.equal(outs[T], moe_layer(x[:T], *args[:2], RANK, *args[2:], **kw)), T


# ----------------------------------------------------------------------------- the model's layer
def _dsa_moe(fp8: bool, device="cpu", smoke=True):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from bench_moe import moe_config

    from hisparse.models.dsa import DSAMoE

    cfg = moe_config(smoke, fp8)
    torch.manual_seed(0)
    with torch.device(device):
        moe = DSAMoE(cfg)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if name.endswith("_scale_inv"):
                p.fill_(0.02 / 32)
            elif p.dtype == torch.float8_e4m3fn:
                p.copy_((torch.randn(p.shape, device=device) * 32).clamp_(-448, 448))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, cfg.hidden_size ** -0.5)
    return moe.requires_grad_(False), cfg


# the model layer's choice of the fused path (no kernel of its own): the newest Triton only
# (.ci/triton_matrix.sh; ~2 x 8 s interpreted); the oldest runs the layer kernel it takes in
# test_layer_plain_fp32_matches_reference / test_layer_fp8_with_shared_matches_reference
@pytest.mark.newest_triton_only
@pytest.mark.parametrize("fp8", [False, True])
def test_dsa_moe_fused_matches_unfused(triton_cpu, kernel_switches, fp8):
    moe, cfg = _dsa_moe(fp8)
    assert moe._fusable_shared() is not None            # served as the extra expert
    x = torch.randn(13, cfg.hidden_size)
    assert moe.fused(x)
    got = moe(x)
    from hisparse.ops.moe_layer import MOE_LAYER_MAX_TOKENS
    assert not moe.fused(torch.empty(MOE_LAYER_MAX_TOKENS + 1, cfg.hidden_size))  # prefill
    kernel_switches(fused_moe=False)
    assert not moe.fused(x)
    want = moe(x)
    tol = 1e-5 if not fp8 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_dsa_moe_fused_matches_unfused_and_is_batch_invariant(kernel_switches, fp8):
    moe, cfg = _dsa_moe(fp8, device="cuda", smoke=False)
    if not fp8:
        moe = moe.to(torch.bfloat16)
        moe.gate.float()
    x = torch.randn(256, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    got = moe(x)
    for T in (1, 16, 24, 64):
        assert torch.equal(moe(x[:T]), got[:T]), T
    kernel_switches(fused_moe=False)
    want = moe(x).float()
    # bf16 roundings (the unfused path rounds routed and shared outputs apart) and FP8
    # activation quantization of intermediates rounded differently
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < (0.03 if fp8 else 0.02), err


def test_the_layers_kernels_count_as_moe_in_the_kernel_profile():
    """``hisparse bench --profile-kernels`` counts the whole fused layer in its MoE class."""
    pytest.importorskip("triton")
    from hisparse.bench.kernels import kernel_class
    from hisparse.ops import _moe_layer_triton, _moe_triton

    names = [n for mod in (_moe_layer_triton, _moe_triton) for n in vars(mod)
             if n.endswith("_kernel")]
    assert len(names) == 8
    assert {n: kernel_class(n) for n in names} == {n: "MoE" for n in names}


def test_moe_launch_table_holds_autotune_candidates():
    """Every measured launch is one of the autotune's candidates, keyed by a real bucket."""
    from hisparse.ops._gemm_splitk_triton import M_BUCKETS, SPLITK_TABLE
    from hisparse.ops._gemm_triton import TUNE_CONFIGS
    from hisparse.ops._moe_triton import MOE_LAUNCHES, MOE_T_BUCKETS, t_bucket

    assert [t_bucket(t) for t in (1, 2, 8, 9, 96, 97, 512, 4096)] == [1, 8, 8, 16, 96, 128,
                                                                      512, 512]
    cands = {(c.num_warps, c.num_stages) for c in TUNE_CONFIGS}
    assert MOE_LAUNCHES
    for (name, _, _, b), cfg in MOE_LAUNCHES.items():
        assert name in ("gate_up", "down") and b in MOE_T_BUCKETS and cfg in cands, (name, b)
    assert all(b in M_BUCKETS for _, _, b in SPLITK_TABLE)


def test_moe_launch_uses_the_table_for_measured_calls_only():
    from hisparse.ops import _moe_triton as M

    cuda = torch.device("cuda")    # a device object only: nothing runs
    b = M.t_bucket(24)
    want = M.MOE_LAUNCHES[("down", 256, 7168, b)]
    plain = M._moe_down_kernel
    got = M._launch("down", plain, M._down_tuned, cuda, 256, 7168, 24, True)
    assert got == (plain, {"num_warps": want[0], "num_stages": want[1]})
    # another specialization, past the last bucket, or no entry: the autotune's pick
    for args in ((256, 7168, 24, False), (256, 7168, 4096, True), (512, 7168, 24, True)):
        kernel, _ = M._launch("down", plain, M._down_tuned, cuda, *args)
        assert kernel is M._down_tuned, args


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 24, 96])
def test_gpu_layer_launches_never_change_a_bit(rank_layer, monkeypatch, T):
    """Every (num_warps, num_stages) the launch table may hold (the autotune's candidates)
    gives the autotuned launch's bits, for both grouped GEMMs."""
    from hisparse.ops import _moe_triton as M
    from hisparse.ops._gemm_triton import TUNE_CONFIGS

    args, kw, _ = rank_layer
    x = torch.randn(T, 7168, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(M, "MOE_LAUNCHES", {})
    seen = []
    launch = M._launch
    monkeypatch.setattr(M, "_launch", lambda *a: seen.append(a[-1]) or launch(*a))
    base = moe_layer(x, *args[:2], RANK, *args[2:], **kw)
    assert seen == [True, True]     # the layer's calls are the kind the table was measured for
    for c in TUNE_CONFIGS:
        for name in ("gate_up", "down"):
            M.MOE_LAUNCHES.clear()
            M.MOE_LAUNCHES[(name, 256, 7168, M.t_bucket(T))] = (c.num_warps, c.num_stages)
            got = moe_layer(x, *args[:2], RANK, *args[2:], **kw)
            assert torch.equal(got, base), (name, c)
