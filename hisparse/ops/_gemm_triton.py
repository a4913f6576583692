"""Triton block-scaled FP8 GEMMs (imported lazily by gemm.py and moe.py).

Two kernels; both quantize the activation tile ``[rows, bk]`` in registers (``QUANT_A``: row
amax -> scale -> float8_e4m3fn; on CUDA) or read it pre-quantized with its scales (the CPU
interpreter, whose fp32 -> fp8 cast does not round like torch's), multiply it with the FP8
weight tile on the tensor cores (fp32 accumulate) one scale block (``BLOCK_K = bk``) at a time,
and scale each block's product by ``a_scale[m] * w_scale[n-blk]``.

- The decode kernel (:func:`fp8_block_linear_nt`, every ``M <= BATCH_INVARIANT_MAX_M``): the
  weight is the MMA's tall operand (64 or 128 rows per tile, wgmma), the tokens its narrow side
  (16..128), so a 1..64-token batch wastes no MMA rows and small weights still give every SM a
  tile: K is split by a count fixed by N and K (:func:`nt_splits`) and the fp32 partials are
  summed in split order by the last program of each tile (an atomic arrival counter), in the
  same launch. Tile sizes follow M; split count and order do not, so rows are batch invariant.
- The tile kernel (``_fp8_gemm_kernel``; ``backend="triton"``, the default, for every M):
  one program per (M tile, N tile, K split), partials of several splits summed by torch in a
  fixed order. Autotuned over ``num_warps`` / ``num_stages`` only (tile shapes and K splits are
  fixed by :func:`gemm_config`), keyed on the shape; ``HISPARSE_TRITON_AUTOTUNE=0`` uses the
  first config. The decode kernel is not autotuned (fixed launch options).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

FP8_MAX = 448.0


@triton.jit
def _act_tile_fp8(x_ptr, xs_ptr, rows, rmask, offs_k, kmask, kbc, stride_x, stride_xs,
                  QUANT_A: tl.constexpr, POW2: tl.constexpr):
    """The activation tile ``x[rows, offs_k]`` as float8_e4m3fn and its per-row scale:
    quantized here (``QUANT_A``, CUDA) or read pre-quantized with its scales (interpreter)."""
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
    return q, sa


@triton.jit
def _fp8_tile_dot(acc, x_ptr, xs_ptr, w_ptr, sw, rows, rmask, offs_n, nmask, kb, K, KB,
                  stride_x, stride_w, stride_xs,
                  BLOCK_K: tl.constexpr, QUANT_A: tl.constexpr, POW2: tl.constexpr):
    """``acc += (quant(x[rows, kb-block]) @ w[offs_n, kb-block]^T) * a_scale * sw`` (``sw``:
    the weight tile's scale for block ``kb``, loaded one iteration ahead by the caller: the
    software pipeliner only prefetches loads that feed the MMA, and a scale load waited on in
    every K step costs a memory latency per step)."""
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs_k < K          # false for every k of a block past the end (kb >= KB)
    kbc = tl.minimum(kb, KB - 1)  # scale index kept in bounds; its product is with zeros
    q, sa = _act_tile_fp8(x_ptr, xs_ptr, rows, rmask, offs_k, kmask, kbc, stride_x, stride_xs,
                          QUANT_A, POW2)
    w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :],
                mask=nmask[:, None] & kmask[None, :], other=0.0)
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
    ws_tile = ws_ptr + ((pid_n * BLOCK_N) // SCALE_N) * stride_wsn
    kb0 = pid_s * KB_PER_SPLIT
    sw = tl.load(ws_tile + tl.minimum(kb0, KB - 1))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(KB_PER_SPLIT):
        kb = kb0 + i
        sw_next = tl.load(ws_tile + tl.minimum(kb + 1, KB - 1))
        acc = _fp8_tile_dot(acc, x_ptr, xs_ptr, w_ptr, sw, rows, rmask, offs_n, nmask, kb,
                            K, KB, stride_xm, stride_wn, stride_xsm, BLOCK_K, QUANT_A, POW2)
        sw = sw_next
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
    """``(BLOCK_M, BLOCK_N, splits)`` of the tile kernel (``backend="triton"`` for every M;
    ``"triton_decode"`` above ``BATCH_INVARIANT_MAX_M`` rows only), batch-invariant up to
    ``BATCH_INVARIANT_MAX_M`` rows:
    every such M gets the same 64-row tiles and the same K splits, so a row's result does not
    depend on how many other rows share its step (a tiered run batches differently from an
    unconstrained one). Measured on the H200: 16-row tiles (mma.sync) and 64-row tiles (wgmma)
    round differently (the 16-row path upcasts to fp16 for mma.sync, wgmma multiplies fp8), and
    so do different K splits; with either varying by M, greedy tokens of
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


# ----------------------------------------------------------------------------- decode kernel
# M (and M * N) only bound masks and offsets: not specialized, so one compile serves every M of
# a tile width
@triton.jit(do_not_specialize=["M", "stride_ps"])
def _fp8_gemm_nt_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr,
                        M, N, K, KB, N_TILES,
                        stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, stride_ps,
                        SPLITS: tl.constexpr, KB_PER_SPLIT: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SCALE_N: tl.constexpr, QUANT_A: tl.constexpr, POW2: tl.constexpr):
    """One program per (token tile, N tile, K split): ``acc[n, t] = sum over its K blocks of
    (w[n, blk] . q[t, blk]) * w_scale * a_scale`` (the weight is the MMA's 64+-row operand, the
    tokens its narrow side). With ``SPLITS > 1`` each program stores its fp32 partial into
    ``part [SPLITS, M, N]`` and counts itself in ``cnt[tile]``; the program that arrives last
    sums the partials in split order (fixed, whoever arrives last), stores the output and
    resets the counter to 0. A row's result depends on its own data, N, K and the split
    count only."""
    pid_t = tl.program_id(0)
    pid_ns = tl.program_id(1)
    pid_n = pid_ns // SPLITS
    pid_s = pid_ns % SPLITS
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    if SCALE_N % BLOCK_N == 0:  # one weight scale per tile and K block
        ws_blk = ws_ptr + ((pid_n * BLOCK_N) // SCALE_N) * stride_wsn
    else:                       # one per row (tiles over several scale blocks: small bn)
        ws_blk = ws_ptr + (tl.minimum(offs_n, N - 1) // SCALE_N) * stride_wsn
    kb0 = pid_s * KB_PER_SPLIT
    sw = tl.load(ws_blk + tl.minimum(kb0, KB - 1))
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for i in range(KB_PER_SPLIT):
        kb = kb0 + i
        # next block's weight scale loaded a step ahead (see _fp8_tile_dot)
        sw_next = tl.load(ws_blk + tl.minimum(kb + 1, KB - 1))
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = offs_k < K          # false for every k of a block past the end (kb >= KB)
        kbc = tl.minimum(kb, KB - 1)  # scale index kept in bounds; its product is with zeros
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        q, sa = _act_tile_fp8(x_ptr, xs_ptr, rows, rmask, offs_k, kmask, kbc, stride_xm,
                              stride_xsm, QUANT_A, POW2)
        d = tl.dot(w, tl.trans(q))
        if SCALE_N % BLOCK_N == 0:
            acc += d * (sw * sa)[None, :]
        else:
            acc += d * (sw[:, None] * sa[None, :])
        sw = sw_next
    omask = nmask[:, None] & rmask[None, :]
    out = out_ptr + rows[None, :] * stride_om + offs_n[:, None]
    if SPLITS == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        part = part_ptr + rows[None, :] * N + offs_n[:, None]
        tl.store(part + pid_s * stride_ps, acc, mask=omask)
        # every warp's partial is stored before the count (one thread, acq_rel, GPU scope)
        tl.debug_barrier()
        cnt = cnt_ptr + pid_t * N_TILES + pid_n
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for s in range(SPLITS):
                total += tl.load(part + s * stride_ps, mask=omask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt, 0)


NT_BLOCK_N = 64  # weight rows per tile (one wgmma M of 4 warps); the split count assumes it


@functools.cache
def nt_splits(N: int, KB: int, sms: int) -> int:
    """K splits of the decode kernel, from the weight shape and the SM count only (never from
    M: batch invariance): about one program per SM for one token tile, each K split at least
    two K blocks long (a split of one block costs more in the in-kernel reduction than it
    gains). Measured on the H200 (bench_moe.py --sweep, docs/BENCHMARKS.md): two programs per
    SM, the first choice, was 1.1-1.6x slower at M = 16 and up to 2x at M = 256 than half the
    splits on every rank linear but dense.gate_up."""
    return max(1, min(KB // 2, sms // triton.cdiv(N, NT_BLOCK_N)))


def nt_tiles(M: int) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_N, num_warps, max_stages)`` by M. Not part of the numerics: one MMA
    instruction kind (wgmma) computes each output element the same way whatever the tile
    (checked bitwise on the GPU: tests/ops/test_ops_gemm.py). The pipeline is as deep as shared
    memory allows (a stage holds the weight tile and the bf16 activation tile) for 2+ CTAs per
    SM: decode GEMMs are bound by the weight bytes in flight."""
    if M <= 64:
        block_t = max(16, triton.next_power_of_2(M))
        return block_t, NT_BLOCK_N, 4, 6 if block_t <= 32 else 4
    return 128, 2 * NT_BLOCK_N, 8, 3


COUNTER_SLOTS = 1 << 15
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` int32 zeros that the kernel leaves zero again. One fixed buffer per device, made
    on the first eager call (the engine's graph captures run their body eagerly first), so
    split-K launches on one device must not run concurrently on two streams (hisparse computes
    on one stream; its side streams only copy). An eager call that needs more slots gets fresh
    zeros of its own. Inside a CUDA-graph capture nothing is allocated (DESIGN section 7: a
    buffer made in the graph's pool could be handed to another tensor while replays still
    write it): no buffer yet, or too small, is an error."""
    buf = _COUNTERS.get(device)
    if buf is not None and n <= buf.numel():
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"fp8_block_linear_nt: {n} split-K counters needed inside a CUDA "
                           f"graph capture but {0 if buf is None else buf.numel()} exist: run "
                           "the call once eagerly before capturing (counters are never "
                           "allocated in a capture)")
    if n > COUNTER_SLOTS:
        return torch.zeros(n, dtype=torch.int32, device=device)
    buf = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


_STAGES: dict[tuple, int] = {}


def fp8_block_linear_nt(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                        block: tuple[int, int], out_dtype: torch.dtype,
                        quant_in_kernel: bool | None = None, pow2_scale: bool = False,
                        splits: int | None = None,
                        tiles: tuple[int, int, int, int] | None = None,
                        num_stages: int | None = None) -> torch.Tensor:
    """``x [M, K]`` times FP8 ``w [N, K]`` -> ``[M, N]`` ``out_dtype`` through the decode kernel:
    one launch, K split by :func:`nt_splits` and reduced in-kernel in a fixed order, so row
    ``i`` of any batch equals that row computed alone, bitwise. ``M * N * splits`` must stay
    below 2**31. ``splits`` / ``tiles`` (:func:`nt_tiles`) / ``num_stages``
    override the defaults (benchmarks; another split count changes the rounding)."""
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
    splits = splits or nt_splits(N, KB, _num_sms(x.device))
    kb_per_split = triton.cdiv(KB, splits)
    splits = triton.cdiv(KB, kb_per_split)
    block_t, block_n, warps, max_stages = tiles or nt_tiles(M)
    t_tiles, n_tiles = triton.cdiv(M, block_t), triton.cdiv(N, block_n)
    out = torch.empty(M, N, device=x.device, dtype=out_dtype)
    if splits > 1:
        part = torch.empty(splits, M, N, device=x.device, dtype=torch.float32)
        cnt = _tile_counters(x.device, t_tiles * n_tiles)
    else:
        part = cnt = out  # unused
    args = (xq, xs, w, ws, out, part, cnt, M, N, K, KB, n_tiles,
            xq.stride(0), xs.stride(0), w.stride(0), ws.stride(0), out.stride(0), M * N)
    meta = dict(SPLITS=splits, KB_PER_SPLIT=kb_per_split, BLOCK_T=block_t, BLOCK_N=block_n,
                BLOCK_K=bk, SCALE_N=bn, QUANT_A=quant_in_kernel, POW2=pow2_scale)
    grid = (t_tiles, n_tiles * splits)
    if not x.is_cuda:
        _fp8_gemm_nt_kernel[grid](*args, **meta)
        return out
    # pipeline depth: deep enough to keep a split's weight loads in flight; fewer stages if
    # shared memory runs out (remembered per configuration)
    key = (x.device, splits, kb_per_split, block_t, block_n, bk, out_dtype, quant_in_kernel)
    stages = num_stages or _STAGES.get(key, min(max_stages, max(2, kb_per_split + 1)))
    while True:
        try:
            _fp8_gemm_nt_kernel[grid](*args, **meta, num_warps=warps, num_stages=stages)
            break
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
    _STAGES[key] = stages
    return out
