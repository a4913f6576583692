"""Triton scoring kernel of the lightning indexer (imported lazily by indexer.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _indexer_keys_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, req_ptr, pos_ptr, key_ptr,
                         S_MAX, HI, D,
                         stride_qt, stride_qh, stride_wt, stride_kr, stride_ksp, stride_btr,
                         stride_keyt,
                         PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr, NSUB: tl.constexpr, IEEE: tl.constexpr,
                         FP8: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr,
                         EVEN_D: tl.constexpr):
    """Unquantized keys: ``k_ptr`` rows of ``stride_kr`` elements, flat row ``blk * PAGE + o``.

    ``FP8``: page-split keys (:class:`hisparse.ops.quant.FP8KeyLayout`): ``k_ptr`` the uint8
    pages (``stride_kr`` bytes apart), ``ks_ptr`` the same memory as fp32 (``stride_ksp`` words
    per page). Slot ``o`` of page ``blk`` has its ``D`` e4m3 values at byte ``o * D`` (16-B
    aligned rows: plain vector loads) and its ``NT`` scales at word ``PAGE * D / 4 + o * NT``.
    One tile (``NT == 1``): one dot over the e4m3 values upcast, times the key's power-of-two
    scale after the dot (exact: ``relu(c * x) = c * relu(x)`` for ``c > 0``, and scaling by a
    power of two commutes with fp32 rounding). Several tiles: each value is scaled by its
    tile's scale before the dot (exact in bf16 as well)."""
    t = tl.program_id(0)
    r = tl.load(req_ptr + t)
    pos = tl.load(pos_ptr + t)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < HI
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q_row = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    qv = tl.load(q_row + offs_d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
    if IEEE:
        qv = qv.to(tl.float32)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=hmask, other=0.0)
    invalid_key = tl.full([BLOCK_S], -9223372036854775808, tl.int64)
    for i in range(NSUB):
        sb = tl.program_id(1) * NSUB + i
        offs_s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
        smask = offs_s < S_MAX
        key_ptrs = key_ptr + t.to(tl.int64) * stride_keyt + offs_s
        if (r < 0) | (sb * BLOCK_S > pos):
            tl.store(key_ptrs, invalid_key, mask=smask)
        else:
            valid = smask & (offs_s <= pos)
            page = offs_s // PAGE
            blk = tl.load(bt_ptr + r.to(tl.int64) * stride_btr + page, mask=valid, other=-1)
            valid = valid & (blk >= 0)
            slot = offs_s % PAGE
            kmask = valid[:, None] & dmask[None, :]
            if FP8:
                vptrs = k_ptr + (blk.to(tl.int64) * stride_kr + slot * D)[:, None] + offs_d[None, :]
                if EVEN_D:      # a row mask only: nothing stops 16-B vector loads
                    f8 = tl.load(vptrs, mask=valid[:, None], other=0)
                else:
                    f8 = tl.load(vptrs, mask=kmask, other=0)
                f8 = f8.to(tl.float8e4nv, bitcast=True)
                srow = blk.to(tl.int64) * stride_ksp + (PAGE * D // 4) + slot * NT
                if NT == 1:
                    sc = tl.load(ks_ptr + srow, mask=valid, other=0.0)          # [BLOCK_S]
                    if IEEE:
                        s = tl.dot(qv, tl.trans(f8.to(tl.float32)), input_precision="ieee")
                    else:
                        s = tl.dot(qv, tl.trans(f8.to(qv.dtype)))
                    s = s * sc[None, :]
                else:
                    sc = tl.load(ks_ptr + srow[:, None] + (offs_d // TILE)[None, :], mask=kmask,
                                 other=0.0)
                    if IEEE:
                        s = tl.dot(qv, tl.trans(f8.to(tl.float32) * sc), input_precision="ieee")
                    else:
                        s = tl.dot(qv, tl.trans((f8.to(tl.float32) * sc).to(qv.dtype)))
            else:
                k = tl.load(k_ptr + (blk.to(tl.int64) * PAGE + slot)[:, None] * stride_kr
                            + offs_d[None, :], mask=kmask, other=0.0)
                if IEEE:
                    s = tl.dot(qv, tl.trans(k.to(tl.float32)), input_precision="ieee")
                else:
                    s = tl.dot(qv, tl.trans(k.to(qv.dtype)))
            s = tl.maximum(s, 0.0)
            score = tl.sum(s * w[:, None], axis=0)                   # [BLOCK_S] fp32
            score = tl.where(score == 0.0, 0.0, score)               # -0.0 -> +0.0
            bits = score.to(tl.int32, bitcast=True)
            okey = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)       # order-preserving int32
            low = (4294967295 - offs_s.to(tl.int64))                 # ties: lower position wins
            key = (okey.to(tl.int64) << 32) | low
            key = tl.where(valid, key, invalid_key)
            tl.store(key_ptrs, key, mask=smask)


def indexer_keys(q, weights, k_cache, block_table, token_req, token_pos, block_size, config=None,
                 out=None):
    """int64 keys [T, P*block_size]: (orderable fp32 score << 32) | (2^32-1-pos); INT64_MIN
    invalid. ``k_cache``: one layer's keys ``[rows, D]``, or FP8 page-split keys ``[blocks,
    block_size * key_bytes]`` uint8 (``quant.FP8KeyLayout``). ``out``: a ``[T, P*block_size]``
    int64 buffer with unit column stride (e.g. a workspace view). ``config``: ``(BLOCK_S, NSUB,
    num_warps)``."""
    T, HI, D = q.shape
    s_max = block_table.shape[1] * block_size
    if out is None:
        keys = torch.empty((T, s_max), dtype=torch.int64, device=q.device)
    else:
        if out.shape != (T, s_max) or out.stride(-1) != 1 or out.dtype != torch.int64:
            raise ValueError("indexer_keys: out must be [T, P*block_size] int64 with unit "
                             "column stride")
        keys = out
    fp8 = k_cache.dtype == torch.uint8
    tile = nt = 1
    if fp8:
        from .quant import FP8KeyLayout, fp8_tile
        layout = FP8KeyLayout.of(k_cache, D)
        if layout.block_size != block_size or k_cache.dim() != 2:
            raise ValueError(f"indexer_keys: FP8 keys must be one layer's pages [blocks, "
                             f"{block_size} * {layout.key_bytes}], got {tuple(k_cache.shape)}")
        if q.is_cuda and (layout.page_bytes % 16 or k_cache.stride(0) % 16
                          or k_cache.data_ptr() % 16):
            # 16-B aligned value rows are the point of the layout; smaller pages (block_size
            # < 4) would only be 4- or 8-B aligned, and Triton's alignment analysis has issued
            # 16-B loads on such rows before (misaligned address on the H200).
            raise ValueError(f"indexer_keys: FP8 key pages on CUDA must be 16-B aligned "
                             f"(block_size {block_size} x {layout.key_bytes} B)")
        tile = fp8_tile(D)
        nt = D // tile
        k_scale = k_cache.view(torch.float32)
        stride_ksp = k_scale.stride(0)
    else:
        if k_cache.dtype != q.dtype and q.dtype != torch.float32:
            k_cache = k_cache.to(q.dtype)
        k_scale, stride_ksp = k_cache, 0
    # the CPU interpreter's bf16 tl.dot is wrong (triton 3.9): upcast there too
    ieee = q.dtype == torch.float32 or k_cache.dtype == torch.float32 or not q.is_cuda
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights.float()
    block_h = max(16, next_pow2(HI))
    block_d = max(16, next_pow2(D))
    if config is None:
        # (BLOCK_S, NSUB, num_warps); (128, 2, 4) was best or within 3% at 8k-128k on the H200
        # for bf16 keys
        config = (128, 2, 4) if q.is_cuda else (64, 2, 4)
    block_s, nsub, nw = config
    grid = (T, triton.cdiv(s_max, block_s * nsub))
    _indexer_keys_kernel[grid](
        q, weights, k_cache, k_scale, block_table, token_req, token_pos, keys,
        s_max, HI, D,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), stride_ksp,
        block_table.stride(0), keys.stride(0),
        PAGE=block_size, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_S=block_s, NSUB=nsub, IEEE=ieee,
        FP8=fp8, TILE=tile, NT=nt, EVEN_D=block_d == D, num_warps=nw,
    )
    return keys
