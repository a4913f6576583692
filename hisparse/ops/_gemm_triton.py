"""Triton block-scaled FP8 GEMMs (imported lazily by gemm.py and moe.py).

Two kernels; both quantize the activation tile ``[rows, bk]`` in registers (``QUANT_A``: row
amax -> scale -> float8_e4m3fn; on CUDA) or read it pre-quantized with its scales (the CPU
interpreter, whose fp32 -> fp8 cast does not round like torch's), multiply it with the FP8
weight tile on the tensor cores (fp32 accumulate) one scale block (``BLOCK_K = bk``) at a time,
and scale each block's product by ``a_scale[m] * w_scale[n-blk]``.

- The stream kernel (:func:`fp8_block_linear_stream`, ``backend="triton"``, every
  ``M <= BATCH_INVARIANT_MAX_M``): the weight is the MMA's tall operand (64..256 rows a
  program, wgmma), the tokens its narrow side (16..256), so any batch from one token runs the
  same MMA kind and each program streams its weight slice once. K is cut into chunks whose
  count is fixed by the weight shape (:func:`stream_chunks`); chunk sums are added in chunk
  order either in registers (one program walks every chunk) or by the last program of a tile
  to arrive (one program per chunk, an atomic arrival counter, same launch). Tiles, warps,
  stages, chunk-per-program and where the activations are quantized follow M
  (:func:`stream_config`, measured entries in :data:`STREAM_TABLE`); none changes a bit.
- The tile kernel (``_fp8_gemm_kernel``; ``backend="triton_tile"`` for every M, and
  ``"triton"`` above 512 rows): one program per (M tile, N tile, K split), partials of several
  splits summed by torch in a fixed order. Autotuned over ``num_warps`` / ``num_stages`` only
  (tile shapes and K splits are fixed by :func:`gemm_config`), keyed on the shape;
  ``HISPARSE_TRITON_AUTOTUNE=0`` uses the first config. The stream kernel is not autotuned.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import switches
from .block_fp8 import quantize_fp8_act


@triton.jit
def _quant_rows(a, POW2: tl.constexpr):
    """fp32 ``a [R, bk]`` -> ``(float8_e4m3fn [R, bk], scale fp32 [R])``, DeepSeek's act_quant.
    Every Triton path quantizes through this one function (in a GEMM's K loop or in
    :func:`_act_quant_kernel`), so they agree bitwise (torch's division may round differently)."""
    sa = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12) / 448.0
    if POW2:  # round up to a power of two from the exponent bits (as block_fp8.pow2_ceil)
        bits = sa.to(tl.int32, bitcast=True)
        ex = bits & 0x7F800000
        sa = tl.where((bits & 0x007FFFFF) == 0, ex, ex + 0x00800000).to(tl.float32,
                                                                        bitcast=True)
    return (a / sa[:, None]).to(tl.float8e4nv), sa


@triton.jit
def _act_tile_fp8(x_ptr, xs_ptr, rows, rmask, offs_k, kmask, kbc, stride_x, stride_xs,
                  QUANT_A: tl.constexpr, POW2: tl.constexpr):
    """The activation tile ``x[rows, offs_k]`` as float8_e4m3fn and its per-row scale:
    quantized here (``QUANT_A``, CUDA) or read pre-quantized with its scales (interpreter)."""
    xm = rmask[:, None] & kmask[None, :]
    if QUANT_A:
        a = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=xm, other=0.0)
        q, sa = _quant_rows(a.to(tl.float32), POW2)
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
    kernel on CUDA gets the first config's launch options from the caller;
    ``HISPARSE_TRITON_AUTOTUNE``: :mod:`hisparse.ops.switches`)."""
    if device.type == "cuda" and switches.current().triton_autotune:
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
    """``(BLOCK_M, BLOCK_N, splits)`` of the tile kernel (``backend="triton_tile"`` for every
    M; ``"triton"`` above ``BATCH_INVARIANT_MAX_M`` rows only), batch-invariant up to
    ``BATCH_INVARIANT_MAX_M`` rows:
    every such M gets the same 64-row tiles and the same K splits, so a row's result does not
    depend on how many other rows share its step (a tiered run batches differently from an
    unconstrained one). Measured on the H200: 16-row tiles (mma.sync) and 64-row tiles (wgmma)
    round differently (the 16-row path upcasts to fp16 for mma.sync, wgmma multiplies fp8), and
    so do different K splits; with either varying by M, greedy tokens of
    an FP8-weight MoE model diverged between the two runs. Larger M (prefill chunks, alone or
    with decode tokens) get no split and round differently. Not covered here: the fused MoE
    picks its tile height from tokens per expert (``moe_tiles.moe_block_m``; it did not change
    tokens in that test). ``BLOCK_N`` and the splits are chosen from N so one row of tiles fills the
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


# ----------------------------------------------------------------------------- activation quant
@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_xg, stride_q, stride_s,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BPG: tl.constexpr,
                      POW2: tl.constexpr):
    """One program per (row tile, K block): ``q, s = _quant_rows(x[rows, blk])``. ``x``'s K
    blocks lie in groups of ``BPG`` (contiguous within a group, ``stride_xg`` apart: a 2-D
    ``x`` is one group per block, ``stride_xg = BLOCK_K``); ``q`` is ``[M, K]``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < M
    m = rmask[:, None] & (offs_k < K)[None, :]
    src = x_ptr + (kb // BPG) * stride_xg + (kb % BPG) * BLOCK_K
    a = tl.load(src + rows[:, None] * stride_x + tl.arange(0, BLOCK_K)[None, :], mask=m,
                other=0.0)
    q, sa = _quant_rows(a.to(tl.float32), POW2)
    tl.store(q_ptr + rows[:, None] * stride_q + offs_k[None, :], q, mask=m)
    tl.store(s_ptr + rows * stride_s + kb, sa, mask=rmask)


def quantize_fp8_act_triton(x: torch.Tensor, block_k: int, pow2_scale: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_fp8.quantize_fp8_act` in one Triton launch, bitwise equal to the quantization
    the stream kernel does in its K loop: ``x [M, K]`` -> ``(q [M, K] float8_e4m3fn,
    s [M, ceil(K/bk)] fp32)``. ``x`` may also be ``[M, G, K // G]`` with ``K // G`` a multiple
    of ``block_k`` and any strides but a contiguous last dim (row ``m`` is ``x[m]`` flattened:
    the per-head attention output, read where it lies)."""
    x, stride_g, bpg = k_groups(x, block_k)
    M, K = x.shape[0], x.shape[1] if x.dim() == 2 else x.shape[1] * x.shape[2]
    kb = triton.cdiv(K, block_k)
    q = torch.empty(M, K, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(M, kb, device=x.device, dtype=torch.float32)
    if M:
        block_r = 16
        _act_quant_kernel[(triton.cdiv(M, block_r), kb)](
            x, q, s, M, K, x.stride(0), stride_g, q.stride(0), s.stride(0),
            BLOCK_R=block_r, BLOCK_K=block_k, BPG=bpg, POW2=pow2_scale)
    return q, s


def k_groups(x: torch.Tensor, block_k: int) -> tuple[torch.Tensor, int, int]:
    """The activation as the GEMM kernels read it: ``(x, stride_g, bpg)``, its K blocks in
    groups of ``bpg`` blocks (contiguous within a group), groups ``stride_g`` elements apart.
    ``x [M, K]``: made row-contiguous, one block per group (``stride_g = block_k``). ``x [M, G,
    K // G]`` (row ``m`` is ``x[m]`` flattened): kept as it lies when ``K // G`` is a multiple
    of ``block_k`` and its last dim is contiguous (the per-head attention output: no copy),
    else flattened (a copy)."""
    if x.dim() == 3:
        M, G, kg = x.shape
        if kg % block_k == 0 and x.stride(2) == 1:
            return x, x.stride(1), kg // block_k
        x = x.reshape(M, G * kg)
    return x.contiguous(), block_k, 1


# ----------------------------------------------------------------------------- stream kernel
# The numerics of a row are fixed by the weight shape alone: K is cut into S chunks of CHUNK
# scale blocks (from N and K: stream_chunks); within a chunk the blocks' scaled products are
# accumulated in K order from zero; the chunks' sums are added in chunk order to a zero total.
# Whether one program walks all chunks or each chunk has its own program, the tile sizes,
# warps and stages are free (chosen from M for speed) and do not change a bit of the result.
MODE_ONE = 0    # S == 1: the one chunk's sum is the output
MODE_CHAIN = 1  # one program per output tile walks all S chunks: the total in registers
MODE_SPLIT = 2  # one program per (output tile, chunk) stores the chunk's sum; the last of an
#                 output tile's S programs to arrive adds all S in chunk order


@triton.jit
def _block_dot(x_ptr, w_ptr, rows, rmask, offs_n, nmask, kb, K, stride_xm, stride_wn,
               BLOCK_K: tl.constexpr, QUANT_A: tl.constexpr, POW2: tl.constexpr):
    """``(w[offs_n, blk] @ q[rows, blk]^T, a_scale)`` for scale block ``kb``; the activation
    scale is computed only with ``QUANT_A`` (else the caller's prefetched one is used: the
    returned value is a placeholder)."""
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=nmask[:, None] & kmask[None, :], other=0.0)
    xm = rmask[:, None] & kmask[None, :]
    a = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=xm, other=0.0)
    if QUANT_A:
        q, sa = _quant_rows(a.to(tl.float32), POW2)
    else:
        q = a
        sa = tl.zeros_like(rows).to(tl.float32)
    return tl.dot(w, tl.trans(q)), sa


@triton.jit
def _chunk_sum(part, c, S, stride_ps, omask):
    """Chunk ``c``'s stored sum (past the last chunk: the last one again, which the caller
    does not add)."""
    return tl.load(part + tl.minimum(c, S - 1) * stride_ps, mask=omask, other=0.0,
                   cache_modifier=".cg")


# M, KB, the chunking and the scale strides only bound loops and masks or index scalars: not
# specialized, so one compile per tile configuration serves every rank shape and batch
@triton.jit(do_not_specialize=["M", "KB", "N_TILES", "CHUNK", "S", "stride_xsm", "stride_wsn",
                               "stride_ps"])
def _fp8_stream_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr,
                       M, N, K, KB, N_TILES, CHUNK, S,
                       stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, stride_ps,
                       MODE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr, QUANT_A: tl.constexpr,
                       POW2: tl.constexpr, RED: tl.constexpr, BLOCKS: tl.constexpr):
    """``out[t, n] = sum_chunks(sum_blocks(dot(w[n, blk], q[t, blk]) * w_scale * a_scale))``.
    Each program owns BLOCK_N weight rows (the MMA's tall side, so any M from 1 uses wgmma) and
    BLOCK_T tokens and streams its K range once. See MODE_* for how chunks are combined."""
    pid_t = tl.program_id(0)
    pid_np = tl.program_id(1)
    if MODE == 2:
        pid_n = pid_np // S
        chunk = pid_np % S
        kb_start = chunk * CHUNK
        kb_end = tl.minimum(KB, kb_start + CHUNK)
    else:
        pid_n = pid_np
        kb_start = 0
        kb_end = KB
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    if SCALE_N % BLOCK_N == 0:  # one weight scale per tile and K block
        ws_blk = ws_ptr + ((pid_n * BLOCK_N) // SCALE_N) * stride_wsn
    else:                       # one per row (tiles over several scale blocks: small bn)
        ws_blk = ws_ptr + (tl.minimum(offs_n, N - 1) // SCALE_N) * stride_wsn
    sw = tl.load(ws_blk + kb_start)
    xs_rows = xs_ptr + rows * stride_xsm
    if not QUANT_A:
        sa = tl.load(xs_rows + kb_start, mask=rmask, other=0.0)
    if BLOCKS == 2:
        sw1 = tl.load(ws_blk + kb_start + 1)
        if not QUANT_A:
            sa1 = tl.load(xs_rows + kb_start + 1, mask=rmask, other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    if MODE == 1:
        total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    # BLOCKS scale blocks a step (2: fewer waits per byte; the wrapper keeps every chunk and
    # K an even number of blocks then); the products are added one block at a time, in K order
    for kb in range(kb_start, kb_end, BLOCKS):
        # the scales of the next step loaded a step ahead: the software pipeliner prefetches
        # only the tiles (see _fp8_tile_dot), and a scale load waited on in the step that
        # issues it costs a memory latency per step
        nxt = tl.minimum(kb + BLOCKS, KB - 1)
        sw_next = tl.load(ws_blk + nxt)
        if not QUANT_A:
            sa_next = tl.load(xs_rows + nxt, mask=rmask, other=0.0)
        if BLOCKS == 2:
            nxt1 = tl.minimum(kb + 3, KB - 1)
            sw1_next = tl.load(ws_blk + nxt1)
            if not QUANT_A:
                sa1_next = tl.load(xs_rows + nxt1, mask=rmask, other=0.0)
        d, sq = _block_dot(x_ptr, w_ptr, rows, rmask, offs_n, nmask, kb, K, stride_xm,
                           stride_wn, BLOCK_K, QUANT_A, POW2)
        if QUANT_A:
            sa = sq
        if SCALE_N % BLOCK_N == 0:
            acc += d * (sw * sa)[None, :]
        else:
            acc += d * (sw[:, None] * sa[None, :])
        sw = sw_next
        if not QUANT_A:
            sa = sa_next
        if BLOCKS == 2:
            d1, sq1 = _block_dot(x_ptr, w_ptr, rows, rmask, offs_n, nmask, kb + 1, K,
                                 stride_xm, stride_wn, BLOCK_K, QUANT_A, POW2)
            if QUANT_A:
                sa1 = sq1
            if SCALE_N % BLOCK_N == 0:
                acc += d1 * (sw1 * sa1)[None, :]
            else:
                acc += d1 * (sw1[:, None] * sa1[None, :])
            sw1 = sw1_next
            if not QUANT_A:
                sa1 = sa1_next
        if MODE == 1:
            end = ((kb + BLOCKS) % CHUNK == 0) | (kb + BLOCKS == KB)  # a chunk's last step
            total = tl.where(end, total + acc, total)
            acc = tl.where(end, 0.0, acc)
    # (made after the loop: a [BLOCK_N, BLOCK_T] mask held through it costs registers)
    omask = nmask[:, None] & rmask[None, :]
    out = out_ptr + rows[None, :] * stride_om + offs_n[:, None]
    if MODE == 0:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=omask)
    elif MODE == 1:
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        part = part_ptr + rows[None, :] * N + offs_n[:, None]
        tl.store(part + chunk * stride_ps, acc, mask=omask)
        # every warp's chunk sum is stored before the count (one thread, acq_rel, GPU scope)
        tl.debug_barrier()
        cnt = cnt_ptr + pid_t * N_TILES + pid_n
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == S - 1:
            # chunk order, as MODE_CHAIN; RED loads in flight at a time
            total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for c in range(0, S, RED):
                p0 = tl.load(part + c * stride_ps, mask=omask, other=0.0, cache_modifier=".cg")
                if RED > 1:
                    p1 = _chunk_sum(part, c + 1, S, stride_ps, omask)
                if RED > 2:
                    p2 = _chunk_sum(part, c + 2, S, stride_ps, omask)
                    p3 = _chunk_sum(part, c + 3, S, stride_ps, omask)
                total += p0
                if RED > 1:
                    total = tl.where(c + 1 < S, total + p1, total)
                if RED > 2:
                    total = tl.where(c + 2 < S, total + p2, total)
                    total = tl.where(c + 3 < S, total + p3, total)
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt, 0)


@dataclass(frozen=True)
class StreamConfig:
    """How the stream kernel runs one call (speed only: never the numerics). ``split``: one
    program per K chunk and output tile (MODE_SPLIT) rather than one walking all chunks
    (MODE_CHAIN; the same when there is one chunk); ``quant``: activations quantized in the
    GEMM's K loop (``"gemm"``, re-done by every N tile: cheap for few rows) or first by
    :func:`quantize_fp8_act_triton` (``"kernel"``); on CPU torch's quantizer is used always.
    ``blocks``: scale blocks a K step (2 needs an even chunk length and block count, else 1 is
    used)."""

    block_t: int
    block_n: int
    num_warps: int
    num_stages: int
    split: bool
    quant: str = "gemm"
    blocks: int = 1


STREAM_MIN_CHUNK = 2   # scale blocks per chunk at least: a chunk of one costs more to add up
QUANT_IN_GEMM_MAX_M = 32
# Measured choices (bench_moe.py --sweep on the H200) override the heuristics below:
# STREAM_CHUNKS[(N, K)] = S; STREAM_TABLE[(N, K, m_bucket(M))] = StreamConfig
STREAM_CHUNKS: dict[tuple[int, int], int] = {}
STREAM_TABLE: dict[tuple[int, int, int], StreamConfig] = {}


def stream_chunks(N: int, K: int, bk: int, sms: int) -> int:
    """S, the chunk count of a weight ``[N, K]`` (the numerics: never from M). Default: about
    one 64-row program per SM at M = 1 (each chunk at least STREAM_MIN_CHUNK blocks)."""
    KB = triton.cdiv(K, bk)
    s = STREAM_CHUNKS.get((N, K))
    if s is None:
        s = max(1, min(KB // STREAM_MIN_CHUNK, sms // triton.cdiv(N, 64)))
    chunk = triton.cdiv(KB, max(1, min(s, KB)))
    return triton.cdiv(KB, chunk)


def m_bucket(M: int) -> int:
    """The table key of a batch size: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(M))


def stream_config(M: int, N: int, K: int, chunks: int, sms: int) -> StreamConfig:
    """The launch of the stream kernel for ``M`` rows (speed only). Measured entries win
    (:data:`STREAM_TABLE`); otherwise: tokens on the MMA's narrow side in 16..64-wide tiles,
    64 weight rows per program up to 64 tokens (128 above, 8 warps), K split into its chunks
    while the output tiles alone leave half the SMs idle, activations quantized in the K loop
    up to QUANT_IN_GEMM_MAX_M rows."""
    cfg = STREAM_TABLE.get((N, K, m_bucket(M)))
    if cfg is not None:
        return cfg
    quant = "gemm" if M <= QUANT_IN_GEMM_MAX_M else "kernel"
    if M <= 64:
        bt = max(16, triton.next_power_of_2(M))
        tiles = triton.cdiv(M, bt) * triton.cdiv(N, 64)
        return StreamConfig(bt, 64, 4, 6 if bt <= 32 else 4, chunks > 1 and 2 * tiles < sms,
                            quant)
    # 64 x 128 tiles: 128 x 128 spills (ptxas, triton 3.6: the prefetched activation scales
    # sit in the MMA layout, a column's worth a thread); the chain mode's three accumulators
    # fit too
    tiles = triton.cdiv(M, 64) * triton.cdiv(N, 128)
    return StreamConfig(64, 128, 8, 4, chunks > 1 and 2 * tiles < sms, quant)


def stream_configs(M: int) -> list[StreamConfig]:
    """Candidate launches for ``M`` rows (the sweep; every one gives the same bits): token
    tiles around M, 64..256 weight rows, one or two warp groups, a few pipeline depths, both
    chunk modes, the quantizer :func:`stream_config` picks for M (the sweep times the other
    one on the default launch); none past the registers (ptxas: the chain mode holds three
    accumulators) or shared memory."""
    top = max(16, min(256, triton.next_power_of_2(M)))
    bts = sorted({top, max(16, top // 2), max(16, min(top, 64))})
    quant = "gemm" if M <= QUANT_IN_GEMM_MAX_M else "kernel"
    out = []
    for bt in bts:
        for bn, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
            per_thread = bt * bn // (32 * warps)
            if per_thread > 64:
                continue
            stage = bn * 128 + bt * 128 * (2 if quant == "gemm" else 1)
            depths = (4, 6) if bt <= 32 and bn == 64 else ((3, 4) if bt * bn <= 8192 else (3,))
            for stages in depths:
                if stage * stages > 200 * 1024:
                    continue
                for split in (False, True):
                    if not split and per_thread > 32:
                        continue
                    out.append(StreamConfig(bt, bn, warps, stages, split, quant))
                    if bt <= 64 and (bn, warps) in ((64, 4), (128, 8)) and \
                            2 * stage * stages <= 200 * 1024:
                        out.append(StreamConfig(bt, bn, warps, stages, split, quant, 2))
    return out


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
        raise RuntimeError(f"fp8_block_linear_stream: {n} split-K counters needed inside a "
                           f"CUDA graph capture but {0 if buf is None else buf.numel()} exist: "
                           "run the call once eagerly before capturing (counters are never "
                           "allocated in a capture)")
    if n > COUNTER_SLOTS:
        return torch.zeros(n, dtype=torch.int32, device=device)
    buf = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


_STAGES: dict[tuple, int] = {}


def _red(n: int) -> int:
    return 4 if n >= 4 else (2 if n >= 2 else 1)


def fp8_block_linear_stream(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                            block: tuple[int, int], out_dtype: torch.dtype,
                            pow2_scale: bool = False, config: StreamConfig | None = None,
                            chunks: int | None = None, quant: str | None = None
                            ) -> torch.Tensor:
    """``x [M, K]`` times FP8 ``w [N, K]`` -> ``[M, N]`` ``out_dtype`` through the stream
    kernel, one launch (two with ``quant="kernel"``). Row ``i`` of any batch equals that row
    computed alone, bitwise, whatever ``config`` (from M by default) and ``quant``: K's
    chunking ``chunks`` (default :func:`stream_chunks`, from the weight shape) is the only
    parameter of the numerics (another count rounds differently). On CPU (interpreter) the
    activations are quantized by torch unless ``quant`` says otherwise. ``M * N * chunks``
    must stay below 2**31."""
    M, K = x.shape
    N = w.shape[0]
    bn, bk = block
    KB = triton.cdiv(K, bk)
    sms = _num_sms(x.device)
    S = chunks or stream_chunks(N, K, bk, sms)
    chunk = triton.cdiv(KB, S)
    S = triton.cdiv(KB, chunk)
    cfg = config or stream_config(M, N, K, S, sms)
    quant = quant or (cfg.quant if x.is_cuda else "torch")
    x = x.contiguous()
    if quant == "gemm":
        xq, xs = x, x  # xs unused
    elif quant == "kernel":
        xq, xs = quantize_fp8_act_triton(x, bk, pow2_scale)
    elif quant == "torch":
        xq, xs = quantize_fp8_act(x, bk, pow2_scale)
        xq = xq.contiguous()
    else:
        raise ValueError(f"fp8_block_linear_stream: quant must be gemm, kernel or torch, "
                         f"got {quant!r}")
    w = w if w.stride(1) == 1 else w.contiguous()
    ws = w_scale_inv.float().contiguous()
    t_tiles, n_tiles = triton.cdiv(M, cfg.block_t), triton.cdiv(N, cfg.block_n)
    mode = MODE_ONE if S == 1 else (MODE_SPLIT if cfg.split else MODE_CHAIN)
    blocks = 2 if cfg.blocks == 2 and KB % 2 == 0 and (S == 1 or chunk % 2 == 0) else 1
    out = torch.empty(M, N, device=x.device, dtype=out_dtype)
    if mode == MODE_SPLIT:
        part = torch.empty(S, M, N, device=x.device, dtype=torch.float32)
        cnt = _tile_counters(x.device, t_tiles * n_tiles)
    else:
        part = cnt = out  # unused
    args = (xq, xs, w, ws, out, part, cnt, M, N, K, KB, n_tiles, chunk, S,
            xq.stride(0), xs.stride(0), w.stride(0), ws.stride(0), out.stride(0), M * N)
    meta = dict(MODE=mode, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=bk, SCALE_N=bn,
                QUANT_A=quant == "gemm", POW2=pow2_scale,
                # chunk sums the reducer loads at once (1, 2 or 4): <= 64 registers a thread
                RED=_red(64 * 32 * cfg.num_warps // (cfg.block_t * cfg.block_n)), BLOCKS=blocks)
    grid = (t_tiles, n_tiles * (S if mode == MODE_SPLIT else 1))
    if not x.is_cuda:
        _fp8_stream_kernel[grid](*args, **meta)
        return out
    # fewer stages if shared memory runs out (remembered per configuration)
    key = (x.device, cfg, mode, blocks, bk, out_dtype, quant)
    stages = _STAGES.get(key, cfg.num_stages)
    while True:
        try:
            _fp8_stream_kernel[grid](*args, **meta, num_warps=cfg.num_warps, num_stages=stages)
            break
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
    _STAGES[key] = stages
    return out
