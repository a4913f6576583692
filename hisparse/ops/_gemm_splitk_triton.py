"""The decode FP8 block GEMM (``backend="triton"`` up to ``BATCH_INVARIANT_MAX_M`` rows): split-K,
weight-streaming, batch invariant. Imported lazily by gemm.py.

Why the stream kernel (:func:`_gemm_triton.fp8_block_linear_stream`, now
``backend="triton_stream"``) stayed at 0.15-0.5 of HBM bandwidth:

- its K chunk count aims at about one 64-row program per SM, so a launch is one wave of <= 132
  single-CTA programs (72 for a 4608-row gate/up, 112 for o_proj: SMs left idle), each walking
  12-56 K blocks in series: one CTA of 4 warps per SM cannot keep enough weight bytes in flight;
- with the activation quantized in its K loop, the ``x`` tile of each block is loaded and
  reduced (row amax) in the step that uses it: the pipeliner prefetches only the tiles that
  feed the MMA directly, so each K step waits one L2 round trip;
- its split-K sums are added by the last program of a tile to arrive, ``RED`` (1-4) chunk sums
  in flight at a time: ``S / RED`` dependent L2 round trips in the launch's tail, behind an
  atomic arrival counter kept in a module-global buffer (state a CUDA graph touches, grown on
  demand: against the project rules);
- above 32 rows the activation is quantized by a separate launch.

This kernel: K is cut into ``S`` chunks of ``CHUNK`` scale blocks, and the chunks into ``G``
groups of ``GCH`` chunks, both from the weight shape alone (:func:`splitk_plan`: about
:data:`TARGET_PROGRAMS` 64-row chunk programs, so several CTAs per SM stream at once; groups of
about :data:`GROUP_K` K for many rows). A program covers one chunk, one group or all of K
(``level``, chosen from M), for one (token tile, weight tile); the scales and the raw activation
tile of the next block are loaded a K step ahead in registers, so the in-loop quantization
(``_quant_rows``, as every Triton path) waits on nothing (a pre-quantized tile is streamed by
the pipeliner with the weight's). Chunk or group sums go to an fp32
buffer ``[S or G, M, N]`` (an ordinary temporary of the call: nothing persists between calls,
no counters) and one small reduction launch adds them in order with every load in flight.

Numerics (the lossless contract): a chunk's sum is accumulated from zero over its scale blocks
in K order (``acc += dot(w_blk, q_blk) * (w_scale * a_scale)``, the weight on wgmma's tall side
for every M); a group's sum is ``((0 + c_a) + c_a+1) + ...`` over its chunks; the output is
``((0 + g_0) + g_1) + ...`` over the groups, whichever program level computed which part
(registers or the reduction launch: the same additions in the same order). Only the plan
changes the bits, and it depends on ``(N, K)`` alone; the level, tiles, warps, stages and the
quantizer (in-loop or :func:`_gemm_triton.quantize_fp8_act_triton` first: bitwise the same)
are chosen from M for speed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ._common import bucket_of, interpreted
from ._gemm_triton import _quant_rows, k_groups, quantize_fp8_act_triton
from .block_fp8 import FP8Rows, quantize_fp8_act
from .pending import PendingSum

TARGET_PROGRAMS = 512  # 64-row chunk programs per launch (~4 per SM of an H200)
MIN_CHUNK = 2          # scale blocks per chunk at least (a chunk sum costs a store and a load)
GROUP_K = 2048         # K per group about (group programs: many rows, fewer partial sums)
LEVELS = ("chunk", "group", "all")
# Measured overrides (benchmarks/bench_gemm.py on the H200):
# SPLITK_PLANS[(N, K)] = (chunks, groups) asked for (the numerics: per weight shape, never M);
# SPLITK_TABLE[(N, K, m_bucket(M))] = SplitKConfig (speed only)
SPLITK_PLANS: dict[tuple[int, int], tuple[int, int]] = {}
# SPLITK_TABLE (after SplitKConfig below): the measured launches
M_BUCKETS = (1, 8, 16, 24, 32, 48, 64, 128, 256, 512)


@triton.jit
def _x_block(x_ptr, rows, rmask, kb, K, stride_xm, stride_xg, BPG: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """Block ``kb`` of the activation rows (raw ``x``, or the pre-quantized FP8 tile): the
    blocks lie in groups of ``BPG``, ``stride_xg`` apart (:func:`_gemm_triton.k_groups`; a
    row-contiguous ``x``: ``BPG = 1``, ``stride_xg = BLOCK_K``, block ``kb`` at ``kb *
    BLOCK_K``)."""
    offs = tl.arange(0, BLOCK_K)
    m = rmask[:, None] & (kb * BLOCK_K + offs < K)[None, :]
    src = x_ptr + (kb // BPG) * stride_xg + (kb % BPG) * BLOCK_K
    return tl.load(src + rows[:, None] * stride_xm + offs[None, :], mask=m, other=0.0)


# M, KB, the plan and the scale strides bound loops and masks or index scalars only: not
# specialized, so one compile per launch configuration serves every shape and batch
@triton.jit(do_not_specialize=["M", "KB", "CHUNK", "GROUP", "stride_xsm", "stride_wsn",
                               "stride_ps"])
def _fp8_splitk_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr,
                       M, N, K, KB, CHUNK, GROUP,
                       stride_xm, stride_xg, stride_xsm, stride_wn, stride_wsn, stride_om,
                       stride_ps, BPG: tl.constexpr, LEVEL: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr, QUANT_A: tl.constexpr,
                       POW2: tl.constexpr):
    """``LEVEL`` 0 / 1: ``out[p, t, n]`` = chunk / group ``p = program_id(2)``'s fp32 sum
    (``out`` is the partial buffer); 2: ``out[t, n]`` = the group sums added in order.
    ``CHUNK`` / ``GROUP``: scale blocks per chunk / per group."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    if LEVEL == 0:
        kb_start = tl.program_id(2) * CHUNK
        kb_end = tl.minimum(KB, kb_start + CHUNK)
    elif LEVEL == 1:
        kb_start = tl.program_id(2) * GROUP
        kb_end = tl.minimum(KB, kb_start + GROUP)
    else:
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
    # the scales (and, quantizing here, the raw activation block) of the next K step are loaded
    # a step ahead in registers: the pipeliner prefetches only the tiles that feed the MMA
    # directly (the weight; the activation too when it comes pre-quantized)
    sw = tl.load(ws_blk + kb_start)
    if QUANT_A:
        a = _x_block(x_ptr, rows, rmask, kb_start, K, stride_xm, stride_xg, BPG, BLOCK_K)
    else:
        sa = tl.load(xs_ptr + rows * stride_xsm + kb_start, mask=rmask, other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)     # the chunk's sum
    if LEVEL >= 1:
        gsum = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)  # the group's
    if LEVEL == 2:
        total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        nxt = tl.minimum(kb + 1, KB - 1)  # in bounds; past the range its values go unused
        sw_next = tl.load(ws_blk + nxt)
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=nmask[:, None] & (offs_k < K)[None, :], other=0.0)
        if QUANT_A:
            a_next = _x_block(x_ptr, rows, rmask, nxt, K, stride_xm, stride_xg, BPG, BLOCK_K)
            q, sa = _quant_rows(a.to(tl.float32), POW2)
        else:
            sa_next = tl.load(xs_ptr + rows * stride_xsm + nxt, mask=rmask, other=0.0)
            q = _x_block(x_ptr, rows, rmask, kb, K, stride_xm, stride_xg, BPG, BLOCK_K)
        d = tl.dot(w, tl.trans(q))
        if SCALE_N % BLOCK_N == 0:
            acc += d * (sw * sa)[None, :]
        else:
            acc += d * (sw[:, None] * sa[None, :])
        sw = sw_next
        if QUANT_A:
            a = a_next
        else:
            sa = sa_next
        if LEVEL >= 1:
            c_end = ((kb + 1) % CHUNK == 0) | (kb + 1 == KB)  # a chunk's last block
            gsum = tl.where(c_end, gsum + acc, gsum)
            acc = tl.where(c_end, 0.0, acc)
        if LEVEL == 2:
            g_end = ((kb + 1) % GROUP == 0) | (kb + 1 == KB)  # a group's last block
            total = tl.where(g_end, total + gsum, total)
            gsum = tl.where(g_end, 0.0, gsum)
    omask = nmask[:, None] & rmask[None, :]
    if LEVEL == 2:
        out = out_ptr + rows[None, :] * stride_om + offs_n[:, None]
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        part = out_ptr + tl.program_id(2) * stride_ps + rows[None, :] * N + offs_n[:, None]
        if LEVEL == 0:
            tl.store(part, acc, mask=omask)
        else:
            tl.store(part, gsum, mask=omask)


@triton.jit
def _fp8_splitk_reduce_kernel(part_ptr, out_ptr, n_elem, stride_ps, PARTS: tl.constexpr,
                              GCH: tl.constexpr, BLOCK: tl.constexpr):
    """``out.flat[i]`` from ``PARTS`` partial sums: chunk sums (``GCH`` a group: each group
    summed from zero in order, then the groups from zero in order) or group sums (``GCH = 1``:
    added from zero in order). The loads are independent: all are in flight at once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_elem
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for g in tl.static_range((PARTS + GCH - 1) // GCH):
        gsum = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(GCH):
            if g * GCH + j < PARTS:
                gsum += tl.load(part_ptr + (g * GCH + j) * stride_ps + offs, mask=m, other=0.0,
                                cache_modifier=".cg")
        total += gsum
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _fp32_split_dot(x_ptr, w_ptr, rows, rmask, offs_n, nmask, ps, K, stride_x, stride_w,
                    K_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Split ``ps``'s partial ``x[rows, ps*K_SPLIT:(ps+1)*K_SPLIT] @ w[offs_n, ...]^T``
    ``[BLOCK_T, BLOCK_N]`` accumulated in fp32 (K steps of ``BLOCK_K`` from zero in order; the
    router GEMM's and :func:`fp32_linear_splitk`'s). ``PRECISION``: ``tl.dot``'s
    ``input_precision`` over fp32 operands (``"ieee"``, ``"tf32x3"``), or ``"bf16"``: one bf16
    MMA pass, for operands whose values are all bf16 (each product then exact, as in the
    fp32 passes, which for such operands multiply zeros in all but one)."""
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K_SPLIT, BLOCK_K):
        offs_k = ps * K_SPLIT + kk + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        a = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        if PRECISION == "bf16":
            acc = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
        else:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision=PRECISION)
    return acc


@triton.jit
def _fp32_splitk_parts_kernel(x_ptr, w_ptr, part_ptr, T, N, K, stride_x, stride_w, stride_ps,
                              K_SPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              PRECISION: tl.constexpr):
    """``part[s, t, n]``: split ``s`` of ``x [T, K] @ w [N, K]^T`` (fp32 partials ``[S, T, N]``,
    ``S = cdiv(K, K_SPLIT)``; 16-row token tiles whatever ``T``: a row's partials do not
    depend on its batch)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ps = tl.program_id(2).to(tl.int64)
    rmask = rows < T
    nmask = offs_n < N
    acc = _fp32_split_dot(x_ptr, w_ptr, rows, rmask, offs_n, nmask, ps, K, stride_x, stride_w,
                          K_SPLIT, BLOCK_K, BLOCK_T, BLOCK_N, PRECISION)
    tl.store(part_ptr + ps * stride_ps + rows[:, None] * N + offs_n[None, :], acc,
             mask=rmask[:, None] & nmask[None, :])


@dataclass(frozen=True)
class SplitKPlan:
    """The numerics of a weight shape: ``chunks`` chunks of ``chunk`` scale blocks (the last
    may be short), ``groups`` groups of ``group`` chunks (likewise)."""

    chunk: int
    chunks: int
    group: int
    groups: int


@dataclass(frozen=True)
class SplitKConfig:
    """One launch of the split-K kernel (speed only, never the bits). ``level``: a program per
    ``"chunk"`` or per ``"group"`` (then the reduction launch), or one walking ``"all"`` of K;
    ``quant``: ``"gemm"`` (in the K loop, each weight tile re-quantizing its rows: cheap for few
    rows) or ``"kernel"`` (:func:`quantize_fp8_act_triton` first: one more launch, half the
    activation bytes)."""

    block_t: int
    block_n: int
    num_warps: int
    num_stages: int
    level: str = "chunk"
    quant: str = "gemm"

    def __str__(self) -> str:
        return (f"{self.block_t}x{self.block_n}/w{self.num_warps}/s{self.num_stages}/"
                f"{self.level}/{self.quant}")

    @classmethod
    def parse(cls, text: str) -> SplitKConfig:
        tiles, w, st, level, quant = text.split("/")
        bt, bn = tiles.split("x")
        return cls(int(bt), int(bn), int(w[1:]), int(st[1:]), level, quant)


def _counts(n: int, want: int) -> tuple[int, int]:
    """``(size, count)``: ``n`` items cut into about ``want`` equal runs (the last may be short;
    every run but the last is full)."""
    size = triton.cdiv(n, max(1, min(want, n)))
    return size, triton.cdiv(n, size)


def splitk_plan(N: int, K: int, bk: int = 128, chunks: int | None = None,
                groups: int | None = None) -> SplitKPlan:
    """The numerics of a weight ``[N, K]`` (from the shape alone, never M or the device; the
    arguments override for tests and the benchmark). Default: about :data:`TARGET_PROGRAMS`
    64-row chunk programs, each chunk at least :data:`MIN_CHUNK` blocks, groups of about
    :data:`GROUP_K` K (:data:`SPLITK_PLANS` entries first)."""
    KB = triton.cdiv(K, bk)
    want_s, want_g = SPLITK_PLANS.get((N, K), (None, None))
    s = chunks or want_s or max(1, min(KB // MIN_CHUNK,
                                       round(TARGET_PROGRAMS / triton.cdiv(N, 64))))
    chunk, S = _counts(KB, s)
    group, G = _counts(S, groups or want_g or max(1, round(K / GROUP_K)))
    return SplitKPlan(chunk, S, group, G)


# The fastest launch per (N, K, M bucket) of one TP-8 rank"s linears, measured on the H200
# (2026-12-01, `benchmarks/bench_gemm.py --chunks-sweep`; docs/BENCHMARKS.md, "FP8 linears:
# the split-K kernel"). Every launch of a plan gives the same bits
# (tests/ops/test_ops_gemm_splitk.py).
SPLITK_TABLE: dict[tuple[int, int, int], SplitKConfig] = {
    (1536, 7168, 1): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (1536, 7168, 8): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (1536, 7168, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (1536, 7168, 24): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (1536, 7168, 32): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (1536, 7168, 48): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (1536, 7168, 64): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (1536, 7168, 128): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (1536, 7168, 256): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (1536, 7168, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (576, 7168, 1): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (576, 7168, 8): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (576, 7168, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (576, 7168, 24): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (576, 7168, 32): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (576, 7168, 48): SplitKConfig(64, 64, 4, 4, "chunk", "gemm"),
    (576, 7168, 64): SplitKConfig(64, 64, 4, 3, "chunk", "gemm"),
    (576, 7168, 128): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (576, 7168, 256): SplitKConfig(64, 128, 8, 3, "group", "kernel"),
    (576, 7168, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (3072, 1536, 1): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (3072, 1536, 8): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (3072, 1536, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (3072, 1536, 24): SplitKConfig(32, 64, 4, 4, "chunk", "gemm"),
    (3072, 1536, 32): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (3072, 1536, 48): SplitKConfig(64, 64, 4, 3, "chunk", "gemm"),
    (3072, 1536, 64): SplitKConfig(64, 64, 4, 3, "chunk", "gemm"),
    (3072, 1536, 128): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (3072, 1536, 256): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (3072, 1536, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (7168, 2048, 1): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (7168, 2048, 8): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (7168, 2048, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (7168, 2048, 24): SplitKConfig(32, 128, 4, 3, "chunk", "gemm"),
    (7168, 2048, 32): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (7168, 2048, 48): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (7168, 2048, 64): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (7168, 2048, 128): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (7168, 2048, 256): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (7168, 2048, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (8192, 1536, 1): SplitKConfig(16, 128, 4, 3, "chunk", "gemm"),
    (8192, 1536, 8): SplitKConfig(16, 128, 4, 3, "chunk", "gemm"),
    (8192, 1536, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (8192, 1536, 24): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (8192, 1536, 32): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (8192, 1536, 48): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (8192, 1536, 64): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (8192, 1536, 128): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (8192, 1536, 256): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (8192, 1536, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (128, 7168, 1): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (128, 7168, 8): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (128, 7168, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (128, 7168, 24): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (128, 7168, 32): SplitKConfig(32, 64, 4, 4, "chunk", "gemm"),
    (128, 7168, 48): SplitKConfig(64, 64, 4, 3, "chunk", "gemm"),
    (128, 7168, 64): SplitKConfig(64, 64, 4, 3, "chunk", "gemm"),
    (128, 7168, 128): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (128, 7168, 256): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (128, 7168, 512): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (2304, 7168, 1): SplitKConfig(16, 128, 4, 3, "chunk", "gemm"),
    (2304, 7168, 8): SplitKConfig(16, 128, 4, 3, "chunk", "gemm"),
    (2304, 7168, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (2304, 7168, 24): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (2304, 7168, 32): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (2304, 7168, 48): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (2304, 7168, 64): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (2304, 7168, 128): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (2304, 7168, 256): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (2304, 7168, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (7168, 2304, 1): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (7168, 2304, 8): SplitKConfig(16, 128, 4, 3, "chunk", "gemm"),
    (7168, 2304, 16): SplitKConfig(16, 128, 4, 3, "chunk", "gemm"),
    (7168, 2304, 24): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (7168, 2304, 32): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (7168, 2304, 48): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (7168, 2304, 64): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (7168, 2304, 128): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (7168, 2304, 256): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (7168, 2304, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (512, 7168, 1): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (512, 7168, 8): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (512, 7168, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (512, 7168, 24): SplitKConfig(32, 64, 4, 4, "chunk", "gemm"),
    (512, 7168, 32): SplitKConfig(32, 64, 4, 4, "chunk", "gemm"),
    (512, 7168, 48): SplitKConfig(64, 64, 4, 3, "chunk", "gemm"),
    (512, 7168, 64): SplitKConfig(64, 64, 4, 3, "chunk", "gemm"),
    (512, 7168, 128): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (512, 7168, 256): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (512, 7168, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (7168, 256, 1): SplitKConfig(16, 64, 4, 3, "group", "gemm"),
    (7168, 256, 8): SplitKConfig(16, 64, 4, 3, "group", "gemm"),
    (7168, 256, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (7168, 256, 24): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (7168, 256, 32): SplitKConfig(32, 64, 4, 3, "group", "gemm"),
    (7168, 256, 48): SplitKConfig(64, 64, 4, 3, "chunk", "gemm"),
    (7168, 256, 64): SplitKConfig(64, 64, 4, 3, "group", "gemm"),
    (7168, 256, 128): SplitKConfig(64, 64, 4, 3, "group", "gemm"),
    (7168, 256, 256): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (7168, 256, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    # the stacked projections (models/linear.py: [q_a | wk | kv_a], [q_b | wq_b], dense
    # gate | up), measured on the H200 2026-12-02 (docs/BENCHMARKS.md, "Stacked projections")
    (2240, 7168, 1): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (2240, 7168, 8): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (2240, 7168, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (2240, 7168, 24): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (2240, 7168, 32): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (2240, 7168, 48): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (2240, 7168, 64): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (2240, 7168, 128): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (2240, 7168, 256): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (2240, 7168, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (11264, 1536, 1): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (11264, 1536, 8): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (11264, 1536, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (11264, 1536, 24): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (11264, 1536, 32): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (11264, 1536, 48): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (11264, 1536, 64): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (11264, 1536, 128): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (11264, 1536, 256): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (11264, 1536, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (4608, 7168, 1): SplitKConfig(16, 128, 4, 3, "chunk", "gemm"),
    (4608, 7168, 8): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (4608, 7168, 16): SplitKConfig(16, 64, 4, 3, "chunk", "gemm"),
    (4608, 7168, 24): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (4608, 7168, 32): SplitKConfig(32, 64, 4, 3, "chunk", "gemm"),
    (4608, 7168, 48): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (4608, 7168, 64): SplitKConfig(64, 64, 4, 3, "chunk", "kernel"),
    (4608, 7168, 128): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (4608, 7168, 256): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
    (4608, 7168, 512): SplitKConfig(64, 64, 4, 3, "group", "kernel"),
}

def m_bucket(M: int) -> int:
    """The table key of a batch size: the smallest of :data:`M_BUCKETS` holding it."""
    return bucket_of(M, M_BUCKETS)


def splitk_config(M: int, N: int, K: int, plan: SplitKPlan) -> SplitKConfig:
    """The launch for ``M`` rows: a measured :data:`SPLITK_TABLE` entry, else tokens on wgmma's
    narrow side (16..64 wide), 64 weight rows a program up to 64 tokens (64 x 128 tiles, 8 warps
    and the activations quantized first above); programs per chunk, else per group, while the
    output tiles alone are fewer than two per SM and the partial sums (``4 P M N`` bytes,
    written and read back) are at most twice the weight's bytes; else one walks all of K."""
    cfg = SPLITK_TABLE.get((N, K, m_bucket(M)))
    if cfg is not None:
        return cfg
    if M <= 64:
        bt, bn, warps, quant = max(16, triton.next_power_of_2(M)), 64, 4, "gemm"
    else:
        bt, bn, warps, quant = 64, 128, 8, "kernel"
    level = "all"
    if triton.cdiv(M, bt) * triton.cdiv(N, bn) < 264:
        if plan.chunks > 1 and 2 * plan.chunks * M <= K:
            level = "chunk"
        elif plan.groups > 1 and 2 * plan.groups * M <= K:
            level = "group"
    return SplitKConfig(bt, bn, warps, 3, level, quant)


@functools.cache
def quantizes_first(M: int, N: int, K: int, bk: int = 128) -> bool:
    """Whether the default launch for ``M`` rows of a weight ``[N, K]`` quantizes the
    activations in a kernel of their own before the GEMM (``quant="kernel"``)."""
    return splitk_config(M, N, K, splitk_plan(N, K, bk)).quant == "kernel"


def splitk_configs(M: int) -> list[SplitKConfig]:
    """Candidate launches for ``M`` rows (the benchmark's sweep; every one gives the same bits):
    a handful per M bucket, so the sweep compiles few kernels."""
    if M <= 64:
        bt = max(16, triton.next_power_of_2(M))
        out = [SplitKConfig(bt, 64, 4, 3), SplitKConfig(bt, 64, 4, 4),
               SplitKConfig(bt, 128, 4, 3), SplitKConfig(bt, 64, 4, 3, "group"),
               SplitKConfig(bt, 64, 4, 3, "all"), SplitKConfig(bt, 64, 4, 4, "all")]
        return out + ([SplitKConfig(bt, 64, 4, 3, "chunk", "kernel")] if bt == 64 else [])
    # 128-token tiles: above 64 rows one weight tile feeds every row (read once per launch;
    # 128 x 128 spills: 91-397 us at 96 rows on an H100, dropped);
    # 5-6 stages: more bytes in flight where few programs walk long K ranges (each K block's
    # MMA is waited for before its scaled add, so a program's own loads are its only overlap)
    big = [(64, 64, 4, 3, "chunk"), (64, 128, 8, 3, "chunk"), (64, 64, 4, 3, "group"),
           (64, 128, 8, 3, "group"), (64, 128, 8, 3, "all"), (128, 64, 4, 3, "chunk"),
           (128, 64, 8, 3, "group"), (64, 64, 4, 5, "group"), (64, 64, 4, 6, "all")]
    return ([SplitKConfig(bt, bn, w, st, level, "kernel") for bt, bn, w, st, level in big]
            + [SplitKConfig(64, 64, 4, 3, "group")])


_STAGES: dict[tuple, int] = {}  # launch -> stages that fit in shared memory (host-side memo)
REDUCE_BLOCK = 512


def fp8_block_linear_splitk(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                            block: tuple[int, int], out_dtype: torch.dtype,
                            pow2_scale: bool = False, config: SplitKConfig | None = None,
                            plan: SplitKPlan | None = None, quant: str | None = None,
                            pending: bool = False, x_fp8: FP8Rows | None = None
                            ) -> torch.Tensor | PendingSum:
    """``x [M, K]`` times FP8 ``w [N, K]`` -> ``[M, N]`` ``out_dtype``: one launch (level
    ``all``, or one part), two (chunk or group sums, then their reduction), one more with
    ``quant="kernel"``. Row ``i`` equals that row computed in any other batch, bitwise, whatever
    ``config`` and ``quant``: only ``plan`` (default :func:`splitk_plan`, from the weight shape)
    changes bits. On CPU (interpreter) torch quantizes the activations unless ``quant`` says
    otherwise. ``parts * M * N`` must stay below 2**31. ``pending``: where the call has partial
    sums, return them as a :class:`~hisparse.ops.pending.PendingSum` instead of launching the
    reduction (its ``materialize`` launches it; the fused norm adds them itself).

    ``x`` may also be ``[M, G, K // G]``, row ``m`` being ``x[m]`` flattened (the per-head
    attention output as the ``w_uv`` product leaves it, heads strided): with ``K // G`` a
    multiple of ``bk`` the kernels load its blocks where they lie (:func:`_gemm_triton.
    k_groups`; the same values as from the flattened copy, so the same bits), else it is
    flattened first. ``x_fp8``: ``x`` (2-D) already quantized in this call's format (the caller
    checked :meth:`FP8Rows.fits`): read as ``quant="kernel"`` reads its own (``quant`` is then
    ignored)."""
    M = x.shape[0]
    K = x.shape[1] if x.dim() == 2 else x.shape[1] * x.shape[2]
    N = w.shape[0]
    bn, bk = block
    KB = triton.cdiv(K, bk)
    plan = plan or splitk_plan(N, K, bk)
    if plan.chunk * plan.chunks < KB or plan.group * plan.groups < plan.chunks:
        raise ValueError(f"fp8_block_linear_splitk: plan {plan} does not cover {KB} K blocks")
    cfg = config or splitk_config(M, N, K, plan)
    if cfg.level not in LEVELS:
        raise ValueError(f"fp8_block_linear_splitk: level must be one of {LEVELS}, "
                         f"got {cfg.level!r}")
    quant = "rows" if x_fp8 is not None else quant or (cfg.quant if x.is_cuda else "torch")
    if quant == "rows":
        if x_fp8 is None:
            raise ValueError("fp8_block_linear_splitk: quant='rows' reads x_fp8 (the rows "
                             "quantized by their producer): none given")
        xq, xs, stride_g, bpg = x_fp8.q, x_fp8.scale, bk, 1
    else:
        x, stride_g, bpg = k_groups(x, bk)
        if quant == "gemm":
            xq, xs = x, x  # xs unused
        elif quant == "kernel":
            xq, xs = quantize_fp8_act_triton(x, bk, pow2_scale)
            stride_g, bpg = bk, 1
        elif quant == "torch":
            xq, xs = quantize_fp8_act(x.reshape(M, K), bk, pow2_scale)
            xq, stride_g, bpg = xq.contiguous(), bk, 1
        else:
            raise ValueError(f"fp8_block_linear_splitk: quant must be gemm, kernel, torch or "
                             f"rows (with x_fp8), got {quant!r}")
    w = w if w.stride(1) == 1 else w.contiguous()
    ws = w_scale_inv.float().contiguous()
    # one part of either kind: its program walks all of K (the same additions, no reduction)
    parts = {"chunk": plan.chunks, "group": plan.groups, "all": 1}[cfg.level]
    level = LEVELS.index(cfg.level) if parts > 1 else 2
    if parts * M * N >= 2 ** 31:        # the kernels' partial-sum offsets are int32
        raise ValueError(f"fp8_block_linear_splitk: {parts} parts x M={M} x N={N} partial sums "
                         f"exceed the int32 offsets (< 2**31): use fewer rows per call")
    defer = pending and level < 2
    out = None if defer else torch.empty(M, N, device=x.device, dtype=out_dtype)
    dst = torch.empty(parts, M, N, device=x.device, dtype=torch.float32) if level < 2 else out
    grid = (triton.cdiv(M, cfg.block_t), triton.cdiv(N, cfg.block_n), parts)
    args = (xq, xs, w, ws, dst, M, N, K, KB, plan.chunk, plan.chunk * plan.group,
            xq.stride(0), stride_g, xs.stride(0), w.stride(0), ws.stride(0), N, M * N)
    meta = dict(BPG=bpg, LEVEL=level, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=bk,
                SCALE_N=bn, QUANT_A=quant == "gemm", POW2=pow2_scale)
    if not x.is_cuda:
        _fp8_splitk_kernel[grid](*args, **meta)
    else:
        key = (x.device, cfg, level, bk, bn, quant, pow2_scale, bpg)
        stages = _STAGES.get(key, cfg.num_stages)
        while True:  # fewer stages where shared memory runs out (remembered per launch)
            try:
                _fp8_splitk_kernel[grid](*args, **meta, num_warps=cfg.num_warps,
                                         num_stages=stages)
                break
            except OutOfResources:
                if stages <= 1:
                    raise
                stages -= 1
        _STAGES[key] = stages
    if level == 2:
        return out
    gch = plan.group if level == 0 else 1
    if defer:
        return PendingSum(dst, rows=M, cols=N, row_stride=N, part_stride=M * N, count=parts,
                          group=gch, dtype=out_dtype,
                          reduce=functools.partial(_reduce_parts, dst, M, N, parts, gch,
                                                   out_dtype))
    return _reduce_parts(dst, M, N, parts, gch, out_dtype, out)


def _reduce_parts(dst: torch.Tensor, M: int, N: int, parts: int, gch: int,
                  out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reduction launch: ``dst [parts, M, N]`` fp32 partial sums -> ``[M, N]``
    ``out_dtype`` (groups of ``gch`` parts, each from zero in order, then the groups)."""
    if out is None:
        out = torch.empty(M, N, device=dst.device, dtype=out_dtype)
    _fp8_splitk_reduce_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](
        dst, out, M * N, M * N, PARTS=parts, GCH=gch, BLOCK=REDUCE_BLOCK)
    return out


@dataclass(frozen=True)
class Fp32SplitConfig:
    """Launch and numerics of :func:`fp32_linear_splitk`: ``k_split`` K per partial (a power of
    two, a multiple of ``block_k``; it sets the summation order, so the bits), ``block_n``
    outputs per program, ``num_warps``. Token tiles are always :data:`FP32_BLOCK_T` rows."""
    k_split: int = 256
    block_n: int = 32
    block_k: int = 64
    num_warps: int = 4

    def __post_init__(self) -> None:
        k, bk = self.k_split, self.block_k
        if k & (k - 1) or bk & (bk - 1) or k % bk:
            raise ValueError(f"{self}: k_split and block_k must be powers of two, k_split a "
                             f"multiple of block_k")


FP32_BLOCK_T = 16
FP32_SPLIT = Fp32SplitConfig()
FP32_MAX_ROWS = 4096     # rows a call's partials cover (a prefill chunk: in row slices)


def fp32_precision(x: torch.Tensor, w: torch.Tensor) -> str:
    """:func:`_fp32_split_dot`'s products for ``x @ w^T``: one bf16 MMA pass (``"bf16"``) for
    two bf16 tensors on CUDA (each product exact, as in fp32), 3xTF32 for fp32 ones (exact for
    bf16-valued operands, about fp32 otherwise), IEEE fp32 in the interpreter (whose bf16
    ``tl.dot`` is wrong in recent Triton releases: the bf16 branch runs on GPUs only, and GPU
    tests check it). The sums are fp32 in each; the grouping inside the MMA differs, so the
    last bits of a sum may."""
    if interpreted() or not x.is_cuda:
        return "ieee"
    return "bf16" if x.dtype == w.dtype == torch.bfloat16 else "tf32x3"


def fp32_linear_splitk(x: torch.Tensor, w: torch.Tensor, defer: bool = False,
                       config: Fp32SplitConfig = FP32_SPLIT) -> torch.Tensor | PendingSum:
    """``x [T, K] @ w [N, K]^T`` in fp32 (both fp32 or both bf16: :func:`fp32_precision`; unit
    last stride): fixed K-split partials ``[S, T, N]`` then their sum from zero in split order,
    so a row's result does not depend on ``T`` (cuBLAS picks its kernel, and with it the
    summation, by shape). ``defer``: the
    partials as a :class:`PendingSum` (one group of ``S``) for a consumer that sums them (up to
    :data:`FP32_MAX_ROWS` rows; more: the summed tensor)."""
    c = config
    T, K = x.shape
    N = w.shape[0]
    if T > FP32_MAX_ROWS:   # partials of a bounded size; rows are independent: the same bits
        out = torch.empty(T, N, device=x.device, dtype=torch.float32)
        for a in range(0, T, FP32_MAX_ROWS):
            out[a:a + FP32_MAX_ROWS] = fp32_linear_splitk(x[a:a + FP32_MAX_ROWS], w,
                                                          config=c)
        return out
    parts = triton.cdiv(K, c.k_split)
    dst = torch.empty(parts, T, N, device=x.device, dtype=torch.float32)
    if T:
        grid = (triton.cdiv(T, FP32_BLOCK_T), triton.cdiv(N, c.block_n), parts)
        _fp32_splitk_parts_kernel[grid](
            x, w, dst, T, N, K, x.stride(0), w.stride(0), dst.stride(0),
            K_SPLIT=c.k_split, BLOCK_T=FP32_BLOCK_T, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            PRECISION=fp32_precision(x, w), num_warps=c.num_warps)
    reduce = functools.partial(_reduce_parts, dst, T, N, parts, parts, torch.float32)
    if defer:
        return PendingSum(dst, rows=T, cols=N, row_stride=N, part_stride=T * N, count=parts,
                          group=parts, dtype=torch.float32, reduce=reduce)
    return reduce()
