"""Triton block-scaled FP8 GEMM (imported lazily by gemm.py and moe.py).

One program per (M tile, N tile, K split). The K loop steps one scale block (``BLOCK_K = bk``)
at a time: the activation tile ``[BLOCK_M, bk]`` is quantized in registers (``QUANT_A``: row
amax -> scale -> float8_e4m3fn; on CUDA) or read pre-quantized with its scales (the CPU
interpreter, whose fp32 -> fp8 cast does not round like torch's), multiplied with the FP8
weight tile on the tensor cores (fp32 accumulate), and scaled by ``a_scale[m] * w_scale[n-blk]``.
``BLOCK_N`` divides ``bn`` so a tile has one weight scale per K block. With several K splits,
partials go to a fp32 workspace ``[SPLIT, M, N]`` summed in a fixed order (deterministic, no
atomics).

On CUDA the kernels are autotuned over ``num_warps`` / ``num_stages`` only (tile shapes and K
splits are fixed by :func:`gemm_config`, so every config computes the same sums in the same
order), keyed on the shape; the first call of a new shape tunes (a warm-up, never a graph
capture, sees it first). ``HISPARSE_TRITON_AUTOTUNE=0`` uses the first config without tuning.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _fp8_tile_dot(acc, x_ptr, xs_ptr, w_ptr, ws_ptr, rows, rmask, offs_n, nmask, kb, K, KB,
                  stride_x, stride_w, stride_xs, ws_off,
                  BLOCK_K: tl.constexpr, QUANT_A: tl.constexpr, POW2: tl.constexpr):
    """``acc += (quant(x[rows, kb-block]) @ w[offs_n, kb-block]^T) * a_scale * w_scale``."""
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs_k < K          # false for every k of a block past the end (kb >= KB)
    kbc = tl.minimum(kb, KB - 1)  # scale index kept in bounds; its product is with zeros
    xm = rmask[:, None] & kmask[None, :]
    if QUANT_A:
        a = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=xm, other=0.0)
        a = a.to(tl.float32)
        sa = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12) / 448.0
        if POW2:  # round up to a power of two from the exponent bits (as gemm.pow2_ceil)
            bits = sa.to(tl.int32, bitcast=True)
            ex = bits & 0x7F800000
            sa = tl.where((bits & 0x007FFFFF) == 0, ex, ex + 0x00800000).to(tl.float32,
                                                                            bitcast=True)
        q = (a / sa[:, None]).to(tl.float8e4nv)
    else:
        q = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=xm, other=0.0)
        sa = tl.load(xs_ptr + rows * stride_xs + kbc, mask=rmask, other=0.0)
    w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :],
                mask=nmask[:, None] & kmask[None, :], other=0.0)
    sw = tl.load(ws_ptr + ws_off + kbc)
    return acc + tl.dot(q, tl.trans(w)) * (sa[:, None] * sw)


@triton.jit
def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr,
                     M, N, K, KB,
                     stride_xm, stride_xsm, stride_wn, stride_wsn, stride_os, stride_om,
                     KB_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr, QUANT_A: tl.constexpr,
                     POW2: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    ws_off = ((pid_n * BLOCK_N) // SCALE_N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(KB_PER_SPLIT):
        kb = pid_s * KB_PER_SPLIT + i
        acc = _fp8_tile_dot(acc, x_ptr, xs_ptr, w_ptr, ws_ptr, rows, rmask, offs_n, nmask, kb,
                            K, KB, stride_xm, stride_wn, stride_xsm, ws_off, BLOCK_K, QUANT_A,
                            POW2)
    out = out_ptr + pid_s * stride_os + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


AUTOTUNE_ENV = "HISPARSE_TRITON_AUTOTUNE"
TUNE_CONFIGS = [triton.Config({}, num_warps=w, num_stages=st)
                for w, st in ((4, 3), (4, 4), (8, 3), (4, 5), (8, 4))]


def tuned(kernel, key: list[str]):
    """``kernel`` autotuned over :data:`TUNE_CONFIGS` (CUDA only: the interpreter runs the plain
    kernel)."""
    import triton.testing

    bench = functools.partial(triton.testing.do_bench, warmup=5, rep=20)
    return triton.autotune(configs=TUNE_CONFIGS, key=key, do_bench=bench)(kernel)


def pick(kernel, tuned_kernel, device: torch.device):
    """The launchable for ``device``: tuned on CUDA unless disabled, plain otherwise (the plain
    kernel on CUDA gets the first config's launch options from the caller)."""
    if device.type == "cuda" and os.environ.get(AUTOTUNE_ENV, "1") not in ("0", ""):
        return tuned_kernel, {}
    if device.type == "cuda":
        return kernel, {"num_warps": TUNE_CONFIGS[0].num_warps,
                        "num_stages": TUNE_CONFIGS[0].num_stages}
    return kernel, {}


_fp8_gemm_tuned = tuned(_fp8_gemm_kernel, ["N", "K", "KB_PER_SPLIT", "BLOCK_M", "BLOCK_N",
                                           "QUANT_A", "POW2"])


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


BATCH_INVARIANT_MAX_M = 512


def gemm_config(M: int, N: int, KB: int, bn: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, splits)``, batch-invariant up to ``BATCH_INVARIANT_MAX_M`` rows:
    every such M gets the same 64-row tiles and the same K splits, so a row's result does not
    depend on how many other rows share its step (a tiered run batches differently from an
    unconstrained one). Measured on the H200: 16-row tiles (mma.sync) and 64-row tiles (wgmma)
    round differently, and so do different K splits; with either varying by M, greedy tokens of
    an FP8-weight MoE model diverged between the two runs. Larger M (prefill chunks, alone or
    with decode tokens) get no split and round differently. Not covered here: the fused MoE
    picks its tile height from tokens per expert (``moe.moe_block_m``; it did not change tokens
    in that test). ``BLOCK_N`` and the splits are chosen from N so one row of tiles fills the
    SMs (decode GEMMs are GEMV-like: every SM must stream weights)."""
    block_m = 64
    block_n = min(bn, 128)
    while block_n > 16 and bn % block_n:
        block_n //= 2
    if block_n > 64 and triton.cdiv(N, block_n) < _num_sms(device) and bn % 64 == 0:
        block_n = 64
    if M > BATCH_INVARIANT_MAX_M:
        return block_m, block_n, 1
    want = 2 * _num_sms(device)
    splits = max(1, min(KB, want // triton.cdiv(N, block_n)))
    return block_m, block_n, splits


def fp8_block_linear_triton(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                            block: tuple[int, int], out_dtype: torch.dtype,
                            quant_in_kernel: bool | None = None, pow2_scale: bool = False
                            ) -> torch.Tensor:
    """``x [M, K]`` (any float dtype) times FP8 ``w [N, K]`` -> ``[M, N]`` ``out_dtype``."""
    from .gemm import quantize_fp8_act

    M, K = x.shape
    N = w.shape[0]
    bn, bk = block
    KB = triton.cdiv(K, bk)
    if quant_in_kernel is None:
        quant_in_kernel = x.is_cuda
    x = x.contiguous()
    if quant_in_kernel:
        xq, xs = x, x  # xs unused
    else:
        xq, xs = quantize_fp8_act(x, bk, pow2_scale)
        xq = xq.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    ws = w_scale_inv.float().contiguous()
    block_m, block_n, splits = gemm_config(M, N, KB, bn, x.device)
    kb_per_split = triton.cdiv(KB, splits)
    splits = triton.cdiv(KB, kb_per_split)
    if splits == 1:
        out = torch.empty(1, M, N, device=x.device, dtype=out_dtype)
    else:
        out = torch.empty(splits, M, N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), splits)
    kernel, opts = pick(_fp8_gemm_kernel, _fp8_gemm_tuned, x.device)
    kernel[grid](xq, xs, w, ws, out, M, N, K, KB,
                 xq.stride(0), xs.stride(0), w.stride(0), ws.stride(0),
                 out.stride(0), out.stride(1),
                 KB_PER_SPLIT=kb_per_split, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_K=bk, SCALE_N=bn, QUANT_A=quant_in_kernel, POW2=pow2_scale, **opts)
    if splits == 1:
        return out[0]
    return out.sum(0).to(out_dtype)
