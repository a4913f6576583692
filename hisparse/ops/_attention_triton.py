"""Triton sparse MLA attention (imported lazily by attention.py).

One program per (token, block of heads, chunk of the index list). It gathers BLOCK_N rows of
``kv`` per step (rows are shared by all heads: MQA), computes logits with two tensor-core dots
(512-d latent part + 64-d rope part) and accumulates ``p @ kv[:, :512]`` with an online softmax
in fp32. With several chunks (flash-decoding) partial results go to a workspace and a second
kernel merges them by their log-sum-exp. The chunking depends on the head count and the index
count only (:func:`attn_config`), so outputs are batch invariant.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import switches
from ._common import next_pow2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _softmax_step(s, valid, m_i, l_i, qk_scale):
    """Online softmax over one block of logits ``s [BLOCK_H, BLOCK_N]`` (invalid columns
    masked): returns (new running max, the old accumulator's rescale, the block's weights,
    new running sum), all in base 2."""
    s = s * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _attn_kernel(q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr,
                 H, K, N, qk_scale,
                 stride_qt, stride_qh, stride_kv, stride_it,
                 stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                 K_PER_SPLIT: tl.constexpr, D_V: tl.constexpr, D_PE: tl.constexpr,
                 BLOCK_H: tl.constexpr,
                 BLOCK_N: tl.constexpr, DV_BLOCK: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    n_dv: tl.constexpr = D_V // DV_BLOCK
    hblk = hb // n_dv
    dv0 = (hb % n_dv) * DV_BLOCK
    offs_h = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs_h < H
    offs_d = tl.arange(0, D_V)
    offs_p = tl.arange(0, D_PE)
    offs_v = dv0 + tl.arange(0, DV_BLOCK)
    q_base = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_base + offs_d[None, :], mask=hm[:, None], other=0.0)
    q_pe = tl.load(q_base + D_V + offs_p[None, :], mask=hm[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV_BLOCK], tl.float32)
    k_start = sp * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    offs_n = tl.arange(0, BLOCK_N)
    # constexpr trip count (the Triton 3.6 interpreter rejects tensor-valued range bounds)
    for i0 in range(0, K_PER_SPLIT, BLOCK_N):
        kk = k_start + i0 + offs_n
        idx = tl.load(idx_ptr + t.to(tl.int64) * stride_it + kk, mask=kk < k_end, other=-1)
        valid = (idx >= 0) & (idx < N)
        rows = tl.where(valid, idx, 0).to(tl.int64) * stride_kv
        kn = tl.load(kv_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        kp = tl.load(kv_ptr + rows[:, None] + D_V + offs_p[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q_nope.to(tl.float32), tl.trans(kn.to(tl.float32)), input_precision="ieee")
            s = tl.dot(q_pe.to(tl.float32), tl.trans(kp.to(tl.float32)), s, input_precision="ieee")
        else:
            s = tl.dot(q_nope, tl.trans(kn))
            s = tl.dot(q_pe, tl.trans(kp), s)
        m_new, alpha, p, l_i = _softmax_step(s, valid, m_i, l_i, qk_scale)
        if DV_BLOCK == D_V:
            v = kn
        else:
            v = tl.load(kv_ptr + rows[:, None] + offs_v[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_ptrs = o_ptr + sp.to(tl.int64) * stride_os + t.to(tl.int64) * stride_ot \
        + offs_h[:, None] * stride_oh + offs_v[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=hm[:, None])
    if hb % n_dv == 0:
        tl.store(lse_ptr + sp.to(tl.int64) * stride_ls + t.to(tl.int64) * stride_lt + offs_h,
                 lse, mask=hm)


@triton.jit
def _combine_kernel(po_ptr, pl_ptr, o_ptr, lse_ptr, H, S,
                    stride_pos, stride_pot, stride_poh, stride_pls, stride_plt,
                    stride_ot, stride_oh, stride_lt,
                    D_V: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge one (token, head)'s ``S`` chunk partials, weighted by their lse, over the whole
    ``D_V``-column row; grid ``(T, H)``."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    sm = offs_s < S
    l = tl.load(pl_ptr + offs_s * stride_pls + t.to(tl.int64) * stride_plt + h,
                mask=sm, other=float("-inf"))
    lmax = tl.max(l, axis=0)
    lmax_use = tl.where(lmax == float("-inf"), 0.0, lmax)
    w = tl.exp(l - lmax_use)
    wsum = tl.sum(w, axis=0)
    offs_d = tl.arange(0, D_V)
    # a chunk with lse -inf (nothing selected) has weight 0 and may not have stored its output
    live = sm & (l > float("-inf"))
    po = tl.load(po_ptr + offs_s[:, None] * stride_pos + t.to(tl.int64) * stride_pot
                 + h * stride_poh + offs_d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    empty = wsum == 0.0
    wsum_safe = tl.where(empty, 1.0, wsum)
    o = tl.sum(po * w[:, None], axis=0) / wsum_safe
    lse = tl.where(empty, float("-inf"), lmax_use + tl.log(wsum_safe))
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
             o.to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + h, lse)


@dataclass(frozen=True)
class AttnConfig:
    """One launch of the sparse attention kernels. The bits of a call depend on ``block_h``,
    ``block_n``, ``num_warps`` and ``k_per_split``: the index list is cut into chunks of
    ``k_per_split`` entries, each an online softmax over blocks of ``block_n`` rows (a split
    program), merged by their log-sum-exp. ``num_stages`` changes the speed only.
    ``dv_block``: the bf16 kernel's value columns per program (512: all)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    k_per_split: int
    dv_block: int = 512

    def splits(self, K: int) -> int:
        return triton.cdiv(K, self.k_per_split)


MAX_SPLITS = 32              # the combine holds one row of every chunk: [MAX_SPLITS, 512] fp32
# The merge's warps a program, from the stages probe's sweep (H100, docs/BENCHMARKS.md,
# twenty-fourth session): 2 take 0.58-0.76x the time of 4 (the count before; 20.8 against 27.5
# us at 96 x 2k); programs over column blocks of the row (64-256) were slower at every point
COMBINE_WARPS = 2
PARTIAL_BYTES = 128 << 20    # chunk partials of one launch at most (see _launch_chunks)


def attn_config(H: int, K: int, fp8: bool, is_fp32: bool) -> AttnConfig:
    """The launch for ``H`` heads and ``K`` indices, from those alone, never the token count:
    a token's output does not depend on the batch it runs in (lossless: a run that spills
    batches differently from one that does not). Chunks grow past the base size only to keep
    at most :data:`MAX_SPLITS` of them, and shrink to ``K`` (rounded to a block) when ``K`` is
    smaller. Measured on the H200 (K = 2048; docs/BENCHMARKS.md, "Batch-invariant sparse
    attention"): FP8 rows at 16 heads, chunks of 64 indices in blocks of 64 rows take 0.49x
    the former batch-dependent split count's time at 8 tokens, 0.92-0.96x at 24-42 and 1.05x
    at 96 (isolated); bf16 rows at 16 heads, chunks of 128 in blocks of 32: 0.80x at 8,
    1.01-1.13x at 24-96; at 64-128 heads chunks of 512 cost 1.0-1.1x at 64 tokens and 1.5-1.7x
    at 8 (the price of invariance there)."""
    if is_fp32:  # interpreter / CPU-forced path: small tiles, two chunks
        bn = 16
        return AttnConfig(16, bn, 4, 1, max(bn, triton.cdiv(triton.cdiv(K, 2), bn) * bn))
    if H <= 16:
        base = AttnConfig(16, 64, 4, 2, 64) if fp8 else AttnConfig(16, 32, 4, 3, 128)
    elif H <= 32:
        base = AttnConfig(32, 64, 8, 2, 256)
    else:  # H = 64 / 128 (one GPU or TP 2 of V3.2): DV_BLOCK=256 overflows smem
        base = AttnConfig(64, 64, 8, 2, 512)
    bn = base.block_n
    kps = max(base.k_per_split, triton.cdiv(triton.cdiv(K, MAX_SPLITS), bn) * bn)
    return replace(base, k_per_split=min(kps, triton.cdiv(K, bn) * bn))


def _check_config(cfg: AttnConfig, fp8: bool) -> None:
    bn = cfg.block_n
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"AttnConfig: block_n ({bn}) must be a power of two >= 16")
    if cfg.k_per_split <= 0 or cfg.k_per_split % bn:
        raise ValueError(f"AttnConfig: k_per_split ({cfg.k_per_split}) must be a positive "
                         f"multiple of block_n ({bn})")
    if 512 % cfg.dv_block or (fp8 and cfg.dv_block != 512):
        raise ValueError(f"AttnConfig: dv_block ({cfg.dv_block}) must divide 512 (bf16 rows) "
                         f"or be 512 (FP8 rows)")


def _launch_chunks(out: torch.Tensor, lse: torch.Tensor, splits: int, launch) -> None:
    """Run ``launch(tokens, po, pl, strides)`` (one kernel launch for the token slice
    ``tokens`` writing ``po``/``pl`` with ``strides = (chunk, token, head)`` of ``po`` then
    ``(chunk, token)`` of ``pl``), then merge the chunks into ``out``/``lse``. One chunk: the
    kernel writes ``out`` directly. Several: over token slices whose partials fit
    :data:`PARTIAL_BYTES` (a 2048-token prefill chunk at 16 heads x 32 chunks would need
    1 GiB of bf16 partials); tokens are independent, so the slicing changes no bit. A chunk's
    normalized output is stored in ``out``'s dtype when that is 16-bit (lse stays fp32; the
    merge sums in fp32): in fp32 the partials were as many bytes as the rows gathered at 16
    heads, their store and merge ~40% of the kernel's time at 96 x 2k (docs/BENCHMARKS.md,
    thirteenth session)."""
    T, H, d_v = out.shape
    if splits == 1:
        launch(slice(0, T), out, lse, (0, out.stride(0), out.stride(1), 0, lse.stride(0)))
        return
    po_dtype = out.dtype if out.element_size() == 2 else torch.float32
    step = max(1, min(T, PARTIAL_BYTES // (splits * H * (d_v * po_dtype.itemsize + 4))))
    po = torch.empty((splits, step, H, d_v), dtype=po_dtype, device=out.device)
    pl = torch.empty((splits, step, H), dtype=torch.float32, device=out.device)
    strides = (po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1))
    for a in range(0, T, step):
        tokens = slice(a, min(a + step, T))
        launch(tokens, po, pl, strides)
        o, ls = out[tokens], lse[tokens]
        _combine_kernel[(o.shape[0], H)](
            po, pl, o, ls, H, splits, *strides, o.stride(0), o.stride(1), ls.stride(0),
            D_V=d_v, BLOCK_S=max(2, next_pow2(splits)), num_warps=COMBINE_WARPS,
        )


def _prepare_call(q: torch.Tensor, indices: torch.Tensor, d_v: int,
                  out: torch.Tensor | None, lse: torch.Tensor | None):
    """A launch's operands: ``q`` and int32 ``indices`` with unit last strides, ``out [T, H,
    d_v]`` (``q``'s dtype) and ``lse [T, H]`` fp32 allocated where not given. Returns ``(q,
    indices, out, lse, done)``; ``done``: nothing to launch (no token, or no index: outputs
    zeros and lse ``-inf``, written here)."""
    T, H = q.shape[:2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    indices = indices.to(torch.int32)
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    if out is None:
        out = torch.empty((T, H, d_v), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T and not indices.shape[1]:
        out.zero_()
        lse.fill_(float("-inf"))
    return q, indices, out, lse, T == 0 or indices.shape[1] == 0


def sparse_mla_attention_triton(q, kv, indices, sm_scale, d_v=512, config=None, out=None, lse=None):
    T, H, D = q.shape
    if d_v != 512 or D != 576:
        raise ValueError("Triton sparse MLA attention supports d_qk=576, d_v=512")
    if kv.stride(-1) != 1:
        raise ValueError("kv rows must be contiguous")
    q, indices, out, lse, done = _prepare_call(q, indices, d_v, out, lse)
    if done:
        return out, lse
    K = indices.shape[1]
    N = kv.shape[0]
    # fp32 inputs use IEEE fp32 dots; so does the CPU interpreter for every dtype (its bf16
    # tl.dot is wrong in triton 3.9), where operands are upcast in the kernel.
    is_fp32 = q.dtype == torch.float32 or kv.dtype == torch.float32 or not q.is_cuda
    if kv.dtype != q.dtype:
        kv = kv.to(q.dtype)
    cfg = config or attn_config(H, K, False, is_fp32)
    _check_config(cfg, fp8=False)
    splits = cfg.splits(K)
    qk_scale = sm_scale * LOG2E

    def launch(tokens, po, pl, strides):
        qs, ids = q[tokens], indices[tokens]
        grid = (qs.shape[0], triton.cdiv(H, cfg.block_h) * (512 // cfg.dv_block), splits)
        _attn_kernel[grid](
            qs, kv, ids, po, pl, H, K, N, qk_scale,
            qs.stride(0), qs.stride(1), kv.stride(0), ids.stride(0), *strides,
            K_PER_SPLIT=cfg.k_per_split, D_V=512, D_PE=D - 512, BLOCK_H=cfg.block_h,
            BLOCK_N=cfg.block_n, DV_BLOCK=cfg.dv_block, IEEE=is_fp32,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch_chunks(out, lse, splits, launch)
    return out, lse


# ---------------------------------------------------------------------------------------------
# FP8 rows (hisparse.ops.quant format): [d_v e4m3 | NT fp32 scales | d_pe bf16] bytes per row.

@triton.jit
def _fp8_rows(kv_u8, kv_f32, kv_bf16, idx_ptr, kk, k_end, N, stride_row,
              offs_d, offs_s, offs_p, D_V: tl.constexpr, NT: tl.constexpr):
    """One block's gather: the rows ``idx[kk]`` (``-1`` / out of range / past ``k_end``:
    invalid, loaded as zeros) as (valid, e4m3 bytes, tile scales, rope)."""
    idx = tl.load(idx_ptr + kk, mask=kk < k_end, other=-1)
    valid = (idx >= 0) & (idx < N)
    rows = tl.where(valid, idx, 0).to(tl.int64) * stride_row            # byte offsets
    raw = tl.load(kv_u8 + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
    sc = tl.load(kv_f32 + (rows // 4)[:, None] + D_V // 4 + offs_s[None, :],
                 mask=valid[:, None], other=0.0)
    kp = tl.load(kv_bf16 + (rows // 2)[:, None] + (D_V + 4 * NT) // 2 + offs_p[None, :],
                 mask=valid[:, None], other=0.0)
    return valid, raw, sc, kp


@triton.jit
def _one_copy(x):
    """``x`` unchanged, through an opaque PTX move the compiler may neither duplicate nor
    move: a value both dots read is then computed once, not once per dot operand layout.
    Without it Triton 3.6 recomputes the dequantized tile from the raw bytes in each dot's
    layout (SM90 SASS at the 16-head plan: 4,168 instructions a warp, 255 registers and 32
    stack bytes, against 2,360, 189 and none with it; benchmarks/attention_resources.py).
    The dots then take their operands in another register layout (the same values at other
    lanes of each MMA), so the last bits may differ from a kernel without it; every batch runs
    the same code, so batch invariance holds. Compiled code only (the interpreter has no
    PTX)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype,
                                     is_pure=False, pack=2)


# e4m3 -> bf16 of four bytes (``$2``, element 0 in the low byte) into two bf16 pairs (``$0``:
# elements 0-1, ``$1``: 2-3) by integer operations: each byte's exponent and mantissa shifted
# left 4 into its bf16 lane, the sign to bit 15. Read as bf16 each lane is the e4m3 value times
# 2^-120 (e4m3's exponent bias 7 against bf16's 127; its subnormals land on bf16 subnormals of
# the same scaled value). e4m3fn's NaN codes (0x7F / 0xFF, stored only for a NaN input) come
# out finite: the one difference from the conversion instructions.
E4M3_BF16_PTX = tl.constexpr(
    "{ .reg .b32 lo, hi, a, b; prmt.b32 lo, $2, 0, 0x4140; prmt.b32 hi, $2, 0, 0x4342; "
    "shl.b32 a, lo, 4; and.b32 a, a, 0x07F007F0; shl.b32 b, lo, 8; and.b32 b, b, 0x80008000; "
    "or.b32 $0, a, b; shl.b32 a, hi, 4; and.b32 a, a, 0x07F007F0; shl.b32 b, hi, 8; "
    "and.b32 b, b, 0x80008000; or.b32 $1, a, b; }")
TWO_POW_120 = tl.constexpr(1.329227995784916e36)


@triton.jit
def _e4m3_tiles_bf16(raw, sc, BLOCK_N: tl.constexpr, NT: tl.constexpr, TILE: tl.constexpr,
                     D_V: tl.constexpr):
    """``raw [BLOCK_N, D_V]`` e4m3 bytes (uint8) times their tiles' power-of-two scales ``sc
    [BLOCK_N, NT]`` fp32, as bf16: the bits of ``e4m3.to(bf16) * sc.to(bf16)`` (every finite
    code) without the conversion instructions (SM90 runs one ``F2F.BF16.F16`` a value on its
    narrow conversion pipe: 256 a thread at the 16-head plan). :data:`E4M3_BF16_PTX` gives
    the value times 2^-120; two bf16 factors, ``min(sc, 2^7) * 2^120`` and ``max(sc / 2^7,
    1)``, restore it exactly for every scale the quantizer makes (2^-13 .. 2^120: each product
    is a power-of-two multiple of a 4-bit-mantissa value, kept exact while it stays in bf16's
    range, as the plain product is). Compiled code only (the interpreter has no PTX)."""
    k120 = tl.inline_asm_elementwise(E4M3_BF16_PTX, "=r,=r,r", [raw], dtype=tl.bfloat16,
                                     is_pure=True, pack=4)
    return tl.reshape(tl.reshape(k120, [BLOCK_N, NT, TILE])
                      * (tl.minimum(sc, 128.0) * TWO_POW_120).to(tl.bfloat16)[:, :, None]
                      * tl.maximum(sc * 0.0078125, 1.0).to(tl.bfloat16)[:, :, None],
                      [BLOCK_N, D_V])


@triton.jit
def _fp8_block(q_nope, q_pe, valid, raw, sc, kp, m_i, l_i, acc, qk_scale,
               D_V: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
               BLOCK_N: tl.constexpr, IEEE: tl.constexpr, INT_CVT: tl.constexpr):
    """The online-softmax update of one gathered block: returns (m_i, l_i, acc).
    ``INT_CVT``: the tile dequantized by :func:`_e4m3_tiles_bf16` (the same bits)."""
    if IEEE:
        f8 = raw.to(tl.float8e4nv, bitcast=True)
        kn = tl.reshape(tl.reshape(f8.to(tl.float32), [BLOCK_N, NT, TILE])
                        * sc[:, :, None], [BLOCK_N, D_V])
        kp = kp.to(tl.float32)
        s = tl.dot(q_nope, tl.trans(kn), input_precision="ieee")
        s = tl.dot(q_pe, tl.trans(kp), s, input_precision="ieee")
    else:
        if INT_CVT:
            kn = _e4m3_tiles_bf16(raw, sc, BLOCK_N, NT, TILE, D_V)
        else:
            f8 = raw.to(tl.float8e4nv, bitcast=True)
            kn = tl.reshape(tl.reshape(f8.to(tl.bfloat16), [BLOCK_N, NT, TILE])
                            * sc.to(tl.bfloat16)[:, :, None], [BLOCK_N, D_V])
        kn = _one_copy(kn)
        s = tl.dot(q_nope, tl.trans(kn))
        s = tl.dot(q_pe, tl.trans(kp), s)
    m_new, alpha, p, l_i = _softmax_step(s, valid, m_i, l_i, qk_scale)
    if IEEE:
        acc = tl.dot(p, kn, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(kn.dtype), kn, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _attn_fp8_kernel(q_ptr, kv_u8, kv_f32, kv_bf16, idx_ptr, o_ptr, lse_ptr,
                     H, K, N, qk_scale,
                     stride_qt, stride_qh, stride_row, stride_it,
                     stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                     K_PER_SPLIT: tl.constexpr, KPS_PAD: tl.constexpr, D_V: tl.constexpr,
                     D_PE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                     DIRECT: tl.constexpr, SKIP_EMPTY: tl.constexpr, INT_CVT: tl.constexpr):
    """Same math as ``_attn_kernel`` over rows dequantized in registers: e4m3 -> float, times
    the tile's power-of-two scale (exact in bf16), rope read as bf16. A chunk without a valid
    index (a padding token's, a short request's tail) loads no query and runs no dot: it
    stores its lse, ``-inf``, and its output only when it is the token's result (``DIRECT``,
    one chunk: zeros); :func:`_combine_kernel` reads no output of a chunk whose lse is
    ``-inf``. The bits are those of running it: every block of such a chunk leaves the running
    max at ``-inf`` (so ``alpha = 0``, ``p = 0``), the sum at 0 and the accumulator at +0,
    whose output is +0 and lse ``-inf``; ``SKIP_EMPTY = False`` runs such chunks (the tests'
    witness). ``INT_CVT``: :func:`_fp8_block`'s."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs_h < H
    offs_d = tl.arange(0, D_V)
    k_start = sp * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    idx_row = idx_ptr + t.to(tl.int64) * stride_it
    offs_c = tl.arange(0, KPS_PAD)
    chunk = tl.load(idx_row + k_start + offs_c,
                    mask=(offs_c < K_PER_SPLIT) & (k_start + offs_c < k_end), other=-1)
    n_valid = tl.sum(((chunk >= 0) & (chunk < N)).to(tl.int32), axis=0)
    if not SKIP_EMPTY:
        n_valid += 1
    o_ptrs = o_ptr + sp.to(tl.int64) * stride_os + t.to(tl.int64) * stride_ot \
        + offs_h[:, None] * stride_oh + offs_d[None, :]
    lse_ptrs = lse_ptr + sp.to(tl.int64) * stride_ls + t.to(tl.int64) * stride_lt + offs_h
    if n_valid > 0:
        offs_p = tl.arange(0, D_PE)
        offs_s = tl.arange(0, NT)
        q_base = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
        q_nope = tl.load(q_base + offs_d[None, :], mask=hm[:, None], other=0.0)
        q_pe = tl.load(q_base + D_V + offs_p[None, :], mask=hm[:, None], other=0.0)
        if IEEE:
            q_nope = q_nope.to(tl.float32)
            q_pe = q_pe.to(tl.float32)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D_V], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for i0 in range(0, K_PER_SPLIT, BLOCK_N):
            valid, raw, sc, kp = _fp8_rows(kv_u8, kv_f32, kv_bf16, idx_row,
                                           k_start + i0 + offs_n, k_end, N, stride_row,
                                           offs_d, offs_s, offs_p, D_V, NT)
            m_i, l_i, acc = _fp8_block(q_nope, q_pe, valid, raw, sc, kp, m_i, l_i, acc,
                                       qk_scale, D_V, TILE, NT, BLOCK_N, IEEE, INT_CVT)

        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        o = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=hm[:, None])
        tl.store(lse_ptrs, lse, mask=hm)
    else:
        tl.store(lse_ptrs, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=hm)
        if DIRECT:
            tl.store(o_ptrs, tl.zeros([BLOCK_H, D_V], o_ptr.dtype.element_ty), mask=hm[:, None])


def sparse_mla_attention_fp8_triton(q, kv, indices, sm_scale, d_v=512, config=None, out=None,
                                    lse=None, skip_empty: bool = True):
    """``kv``: FP8 byte rows ``[N, row_bytes]`` uint8 (hisparse.ops.quant layout).
    ``skip_empty``: chunks without a valid index do no work (speed only: the same bits).
    ``HISPARSE_FP8_CONVERT=int`` (:mod:`~hisparse.ops.switches`): the rows dequantized by
    integer operations (speed only: the same bits; compiled code)."""
    from ._common import fp8_tile, mla_row_bytes

    T, H, D = q.shape
    d_pe = D - d_v
    tile = fp8_tile(d_v)
    nt = d_v // tile
    if kv.dtype != torch.uint8 or kv.dim() != 2 or kv.shape[1] != mla_row_bytes(d_v, d_pe):
        raise ValueError(f"FP8 attention: kv must be uint8 [N, {mla_row_bytes(d_v, d_pe)}]")
    if kv.stride(1) != 1 or kv.stride(0) % 4 or kv.storage_offset() % 4:
        raise ValueError("FP8 attention: kv rows must be contiguous and 4-byte aligned")
    q, indices, out, lse, done = _prepare_call(q, indices, d_v, out, lse)
    if done:
        return out, lse
    K = indices.shape[1]
    N = kv.shape[0]
    is_fp32 = q.dtype == torch.float32 or not q.is_cuda
    cfg = config or attn_config(H, K, True, is_fp32)
    _check_config(cfg, fp8=True)
    splits = cfg.splits(K)
    int_cvt = not is_fp32 and switches.current().fp8_convert == "int"

    def launch(tokens, po, pl, strides):
        qs, ids = q[tokens], indices[tokens]
        _attn_fp8_kernel[(qs.shape[0], triton.cdiv(H, cfg.block_h), splits)](
            qs, kv, kv.view(torch.float32), kv.view(torch.bfloat16), ids, po, pl,
            H, K, N, sm_scale * LOG2E,
            qs.stride(0), qs.stride(1), kv.stride(0), ids.stride(0), *strides,
            K_PER_SPLIT=cfg.k_per_split, KPS_PAD=next_pow2(cfg.k_per_split), D_V=d_v,
            D_PE=d_pe, TILE=tile, NT=nt, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
            IEEE=is_fp32, DIRECT=splits == 1, SKIP_EMPTY=bool(skip_empty), INT_CVT=int_cvt,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    _launch_chunks(out, lse, splits, launch)
    return out, lse
