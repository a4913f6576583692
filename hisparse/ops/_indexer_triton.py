"""Triton scoring kernel of the lightning indexer (imported lazily by indexer.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _fp8_byte_plane(words, sc, J: tl.constexpr, IEEE: tl.constexpr):
    """Byte ``J`` of every int32 word (little-endian: key element ``4 * w + J``) as e4m3 times
    its tile scale ``sc`` (same shape), in fp32 (``IEEE``) or bf16 (exact: power-of-two scale)."""
    f8 = ((words >> (8 * J)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    if IEEE:
        return f8.to(tl.float32) * sc
    return f8.to(tl.bfloat16) * sc.to(tl.bfloat16)


@triton.jit
def _indexer_keys_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, req_ptr, pos_ptr, key_ptr,
                         S_MAX, HI, D,
                         stride_qt, stride_qh, stride_wt, stride_kr, stride_btr, stride_keyt,
                         PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr, NSUB: tl.constexpr, IEEE: tl.constexpr,
                         FP8: tl.constexpr, TILE: tl.constexpr):
    """``FP8``: ``k_ptr`` is the key bytes viewed as int32 words (row stride ``stride_kr``
    words; a 132-B key is 33 words, so rows are only 4-byte aligned and every load is one word),
    ``ks_ptr`` the same memory as fp32; key element ``d`` = e4m3 byte ``d`` times the
    power-of-two scale of its tile. The 4 bytes of a word are 4 interleaved planes of the key
    (elements ``4w + j``): the score is the sum of 4 dots against the matching planes of q."""
    t = tl.program_id(0)
    r = tl.load(req_ptr + t)
    pos = tl.load(pos_ptr + t)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < HI
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q_row = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    if FP8:
        offs_w = tl.arange(0, BLOCK_D // 4)
        q0 = tl.load(q_row + 4 * offs_w[None, :], mask=hmask[:, None], other=0.0)
        q1 = tl.load(q_row + 4 * offs_w[None, :] + 1, mask=hmask[:, None], other=0.0)
        q2 = tl.load(q_row + 4 * offs_w[None, :] + 2, mask=hmask[:, None], other=0.0)
        q3 = tl.load(q_row + 4 * offs_w[None, :] + 3, mask=hmask[:, None], other=0.0)
        if IEEE:
            q0, q1 = q0.to(tl.float32), q1.to(tl.float32)
            q2, q3 = q2.to(tl.float32), q3.to(tl.float32)
    else:
        qv = tl.load(q_row + offs_d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
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
            rows = blk.to(tl.int64) * PAGE + (offs_s % PAGE)
            if FP8:
                wrow = rows[:, None] * stride_kr
                words = tl.load(k_ptr + wrow + offs_w[None, :], mask=valid[:, None], other=0)
                sc = tl.load(ks_ptr + wrow + D // 4 + offs_w[None, :] // (TILE // 4),
                             mask=valid[:, None], other=0.0)
                k0 = _fp8_byte_plane(words, sc, 0, IEEE)
                k1 = _fp8_byte_plane(words, sc, 1, IEEE)
                k2 = _fp8_byte_plane(words, sc, 2, IEEE)
                k3 = _fp8_byte_plane(words, sc, 3, IEEE)
                if IEEE:
                    s = tl.dot(q0, tl.trans(k0), input_precision="ieee")
                    s += tl.dot(q1, tl.trans(k1), input_precision="ieee")
                    s += tl.dot(q2, tl.trans(k2), input_precision="ieee")
                    s += tl.dot(q3, tl.trans(k3), input_precision="ieee")
                else:
                    s = tl.dot(q0, tl.trans(k0.to(q0.dtype)))
                    s += tl.dot(q1, tl.trans(k1.to(q1.dtype)))
                    s += tl.dot(q2, tl.trans(k2.to(q2.dtype)))
                    s += tl.dot(q3, tl.trans(k3.to(q3.dtype)))
            else:
                k = tl.load(k_ptr + rows[:, None] * stride_kr + offs_d[None, :],
                            mask=valid[:, None] & dmask[None, :], other=0.0)
                if IEEE:
                    s = tl.dot(qv.to(tl.float32), tl.trans(k.to(tl.float32)),
                               input_precision="ieee")
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
    invalid. ``out``: a ``[T, P*block_size]`` int64 buffer with unit column stride (e.g. a
    workspace view)."""
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
    tile = 1
    if fp8:
        from .quant import fp8_tile, index_key_bytes
        tile = fp8_tile(D)
        if (k_cache.shape[-1] != index_key_bytes(D) or k_cache.stride(-1) != 1
                or k_cache.stride(0) % 4 or k_cache.storage_offset() % 4 or D & (D - 1)
                or tile % 4):
            raise ValueError(f"indexer_keys: FP8 keys must be uint8 [rows, {index_key_bytes(D)}]"
                             " contiguous, 4-byte aligned, with a power-of-two head dim >= 4")
        if q.is_cuda and D < 64:
            raise ValueError(f"indexer_keys: FP8 keys on CUDA need a head dim >= 64, got {D} "
                             "(each of the 4 byte planes is one tl.dot of D / 4 >= 16)")
        k_scale = k_cache.view(torch.float32)
        k_cache = k_cache.view(torch.int32)
    elif k_cache.dtype != q.dtype and q.dtype != torch.float32:
        k_cache = k_cache.to(q.dtype)
    # the CPU interpreter's bf16 tl.dot is wrong (triton 3.9): upcast there too
    ieee = q.dtype == torch.float32 or k_cache.dtype == torch.float32 or not q.is_cuda
    if not fp8:
        k_scale = k_cache
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights.float()
    block_h = max(16, next_pow2(HI))
    block_d = max(16, next_pow2(D))
    if config is None:
        # (BLOCK_S, NSUB, num_warps); (128, 2, 4) was best or within 3% at 8k-128k on the H200
        config = (128, 2, 4) if q.is_cuda else (64, 2, 4)
    block_s, nsub, nw = config
    grid = (T, triton.cdiv(s_max, block_s * nsub))
    _indexer_keys_kernel[grid](
        q, weights, k_cache, k_scale, block_table, token_req, token_pos, keys,
        s_max, HI, D,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), block_table.stride(0),
        keys.stride(0),
        PAGE=block_size, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_S=block_s, NSUB=nsub, IEEE=ieee,
        FP8=fp8, TILE=tile, num_warps=nw,
    )
    return keys
