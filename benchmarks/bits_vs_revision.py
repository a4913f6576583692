"""This tree's glue and split-K kernels against another revision's, bitwise, on the GPU: the
2-D split-K path and the activation quantizer (now reading K blocks by group), the rows write
(now a branch of a launch that can make the query too) and the query kernel stay bit for bit
what they were; the fused rows + query launch and the in-place o_proj equal the old separate
kernels and the old copy.

    mkdir -p /tmp/old/hisparse_old && touch /tmp/old/hisparse_old/__init__.py
    git archive cf89023 hisparse/ops | tar -x -C /tmp/old && mv /tmp/old/hisparse/ops \
        /tmp/old/hisparse_old/ops
    PYTHONPATH=$PWD python3 benchmarks/bits_vs_revision.py /tmp/old

Prints ``BAD 0`` when everything matches.
"""
import sys

import torch

sys.path.insert(0, sys.argv[1])
from hisparse_old.ops import _gemm_splitk_triton as OS  # noqa: E402
from hisparse_old.ops import _gemm_triton as OT  # noqa: E402
from hisparse_old.ops import _glue_triton as OG  # noqa: E402

from hisparse.ops import _gemm_splitk_triton as NS  # noqa: E402
from hisparse.ops import _gemm_triton as NT  # noqa: E402
from hisparse.ops import _glue_triton as NG  # noqa: E402
from hisparse.ops.gemm import fp8_block_linear, quantize_fp8_weight  # noqa: E402

dev, bf = "cuda", torch.bfloat16
bad = 0
for N, K in [(7168, 2048), (2240, 7168), (11264, 1536), (576, 7168), (4608, 7168)]:
    w, s = quantize_fp8_weight(torch.randn(N, K, device=dev) * 0.05, (128, 128))
    for M in list(range(1, 97)) + [128, 256, 512]:
        x = torch.randn(M, K, device=dev, dtype=bf)
        for pow2 in (False, True):
            a = OS.fp8_block_linear_splitk(x, w, s, (128, 128), bf, pow2_scale=pow2)
            b = NS.fp8_block_linear_splitk(x, w, s, (128, 128), bf, pow2_scale=pow2)
            if not torch.equal(a, b):
                bad += 1
                print("splitk differs", N, K, M, pow2)
    print("splitk", N, K, "done", flush=True)
for M in (1, 7, 48, 96, 300):
    x = torch.randn(M, 2048, device=dev, dtype=bf)
    qa, sa = OT.quantize_fp8_act_triton(x, 128, False)
    qb, sb = NT.quantize_fp8_act_triton(x, 128, False)
    if not (torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(sa, sb)):
        bad += 1
        print("act quant differs", M)
H, R, rope, NR = 16, 512, 64, 4096
for T in range(1, 97):
    kv = torch.randn(T, R + rope, device=dev, dtype=bf) * 2
    wn = (torch.rand(R, device=dev) + 0.5).to(bf)
    pos = torch.randint(0, 40000, (T,), device=dev).float()
    f = pos[:, None] * (1.0 / (10000 ** (torch.arange(0, rope, 2, device=dev).float() / rope)))
    cos, sin = (f.cos() * 1.1).to(bf), (f.sin() * 1.1).to(bf)
    rows = torch.randperm(NR, device=dev)[:T]
    qb = torch.randn(T, H, 192, device=dev, dtype=bf)
    q_abs = torch.randn(H, T, R, device=dev, dtype=bf).transpose(0, 1)
    for dst0 in (torch.randint(0, 256, (NR, 656), device=dev, dtype=torch.uint8),
                 torch.randn(NR, R + rope, device=dev, dtype=bf)):
        d_old, d_new, d_fused = dst0.clone(), dst0.clone(), dst0.clone()
        OG.write_mla_rows_triton(kv, wn, 1e-6, cos, sin, d_old, rows, R)
        NG.write_mla_rows_triton(kv, wn, 1e-6, cos, sin, d_new, rows, R)
        q_f = NG.write_mla_rows_triton(kv, wn, 1e-6, cos, sin, d_fused, rows, R, q_abs,
                                       qb[..., 128:])
        q_old = OG.mla_q_latent_triton(q_abs, qb[..., 128:], cos, sin)
        q_new = NG.mla_q_latent_triton(q_abs, qb[..., 128:], cos, sin)
        ok = (torch.equal(d_old.view(torch.uint8), d_new.view(torch.uint8))
              and torch.equal(d_old.view(torch.uint8), d_fused.view(torch.uint8))
              and torch.equal(q_old, q_new) and torch.equal(q_old, q_f))
        if not ok:
            bad += 1
            print("rows/query differ", T, dst0.dtype)
# the einsum layout on CUDA, and the o_proj in place vs HEAD's copy + old kernel
w_uv = torch.randn(H, 128, R, device=dev, dtype=bf) * 0.05
w, s = quantize_fp8_weight(torch.randn(7168, 2048, device=dev) * 0.05, (128, 128))
for T in range(1, 97):
    out = torch.randn(T, H, R, device=dev, dtype=bf)
    v = torch.einsum("thr,hvr->thv", out, w_uv)
    if T in (1, 8, 96):
        print("einsum v strides", T, v.stride())
    old = OS.fp8_block_linear_splitk(v.reshape(T, 2048), w, s, (128, 128), bf)
    new = fp8_block_linear(v, w, s, backend="triton")
    if not torch.equal(old, new):
        bad += 1
        print("o_proj differs", T)
print("BAD", bad)
