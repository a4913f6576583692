"""Fused decoder-layer glue: RMSNorm with the residual add, MLA row and indexer-key writes with
their norm and RoPE, the absorbed MLA query with its RoPE.

Each op = PyTorch reference (the spec: exactly the unfused model math, op by op, so a CPU model
is bitwise what it was before fusion) + one Triton kernel + dispatcher. The kernels compute every
element with the reference's roundings (each bf16 product and sum of the RoPE rounded as torch
rounds it); only the norms' reductions (sum of squares, mean, variance) run in another order, so
fused outputs equal the reference to about one bf16 ulp. Every kernel is one program per token
(or per token and head) and never reduces across tokens: a row's result does not depend on the
batch it runs in (the lossless contract's batch invariance).

Dispatch: Triton on CUDA (or ``HISPARSE_FORCE_TRITON=1``) unless ``HISPARSE_FUSED_GLUE=0``,
which runs the references everywhere (the unfused path: kernel-count baselines).

The norm's input may be a :class:`~hisparse.ops.pending.PendingSum`: a reduction its producer
left to it (``o_proj``'s split-K partials, the MoE combine's slot rows, a dense ``down_proj``'s
partials). The norm's kernel adds the parts in the producer's order and rounds as its store
would: bitwise the producer's launch followed by the norm, one launch and one bf16 round trip
fewer (``HISPARSE_FUSED_SUMS=0``: the producers launch their reductions, as before).

RoPE conventions (:mod:`hisparse.models.dsa`): ``interleaved`` rotates ``(x[2j], x[2j+1])`` and
stores ``[rotated evens | rotated odds]``; half-split rotates ``(x[j], x[j + d/2])`` in place.
``cos`` / ``sin``: ``[T, rope_dim // 2]`` in the model dtype (YaRN factor included).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import switches
from ._common import want_triton
from .block_fp8 import FP8Rows
from .pending import PendingSum, fuses_sums
from .quant import check_mla_rows_dst, quantize_write_index_keys, quantize_write_mla_rows


def fused(*tensors: Tensor) -> bool:
    """Triton unless ``HISPARSE_FUSED_GLUE=0`` (:mod:`hisparse.ops.switches`): whether the glue
    ops on ``tensors`` run their kernels (and the model hands the indexer's queries on
    unfused, :class:`hisparse.ops.indexer.IndexerQueries`)."""
    return switches.current().fused_glue and want_triton(*tensors)


# ----------------------------------------------------------------------------- references
def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` with the statistics in fp32 and the normalised
    value rounded to ``x.dtype`` before the weight multiplies it (transformers' RMSNorm)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(x[2i], x[2i+1])``; output laid out ``[rotated evens | rotated odds]``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(x[i], x[i + d/2])`` (non-interleaved, "rotate_half" convention)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def add_rms_norm_reference(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
                           ) -> tuple[Tensor, Tensor]:
    """``h = x + residual`` (in ``x.dtype``; ``h = x`` without a residual), returns
    ``(rms_norm(h), h)``."""
    h = x if residual is None else x + residual
    return rms_norm_reference(h, weight, eps), h


def mla_rows_reference(kv: Tensor, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                       kv_lora_rank: int) -> Tensor:
    """``kv [T, R + rope]`` (the ``kv_a_proj_with_mqa`` output) -> the cache rows
    ``[rms_norm(kv[:, :R]) | rope_interleaved(kv[:, R:])]`` ``[T, R + rope]``."""
    c = rms_norm_reference(kv[:, :kv_lora_rank], norm_weight, eps)
    return torch.cat([c, rope_interleaved(kv[:, kv_lora_rank:], cos, sin)], dim=-1)


def index_keys_reference(k: Tensor, ln_weight: Tensor, ln_bias: Tensor, eps: float, cos: Tensor,
                         sin: Tensor, rope_dim: int, interleaved: bool) -> Tensor:
    """``k [T, Di]`` (the ``wk`` output) -> LayerNorm, then RoPE on the first ``rope_dim``
    dims (the rest pass through) ``[T, Di]``."""
    k = torch.nn.functional.layer_norm(k, (k.shape[-1],), ln_weight, ln_bias, eps)
    rope = rope_interleaved if interleaved else rope_half
    return torch.cat([rope(k[..., :rope_dim], cos, sin), k[..., rope_dim:]], dim=-1)


def rope_heads_reference(q: Tensor, cos: Tensor, sin: Tensor, rope_dim: int,
                         interleaved: bool) -> Tensor:
    """``q [T, Hn, D]``: RoPE on the first ``rope_dim`` dims of every head (the indexer query)."""
    rope = rope_interleaved if interleaved else rope_half
    return torch.cat([rope(q[..., :rope_dim], cos[:, None], sin[:, None]), q[..., rope_dim:]],
                     dim=-1)


def resident_rows_reference(topk: Tensor, table: Tensor, token_slot: Tensor,
                            block_size: int) -> Tensor:
    """Flat arena rows ``[T, K]`` int32 of the selected positions ``topk [T, K]`` (``-1``
    none) when every page is resident: ``table[slot, pos // block_size] * block_size + pos %
    block_size`` (:func:`hisparse.kv.plan.flat_rows`) with ``slot = token_slot[t]`` (padding
    tokens, ``-1``, read slot 0's table); ``-1`` where nothing is selected or the page has no
    block."""
    from hisparse.kv.plan import flat_rows

    valid = topk >= 0
    pos = topk.clamp(min=0).long()
    rows = flat_rows(table, token_slot.clamp(min=0).long()[:, None], pos, block_size)
    return torch.where(valid & (rows >= 0), rows.int(), torch.full_like(topk, -1))


def mla_q_latent_reference(q_abs: Tensor, q_pe: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``[q_abs | rope_interleaved(q_pe)]``: ``q_abs [T, H, R]``, ``q_pe [T, H, rope]`` (any
    strides) -> ``[T, H, R + rope]`` contiguous, in ``q_pe.dtype``."""
    return torch.cat([q_abs.to(q_pe.dtype), rope_interleaved(q_pe, cos[:, None], sin[:, None])],
                     dim=-1)


# ----------------------------------------------------------------------------- dispatchers
def _check_rope(name: str, x: Tensor, cos: Tensor, sin: Tensor, rope_dim: int) -> None:
    want = (x.shape[0], rope_dim // 2)
    if tuple(cos.shape) != want or tuple(sin.shape) != want:
        raise ValueError(f"{name}: cos/sin must be {list(want)}, got {tuple(cos.shape)} / "
                         f"{tuple(sin.shape)}")


def _check_q_latent(q_abs: Tensor, q_pe: Tensor, cos: Tensor, sin: Tensor) -> None:
    if q_abs.dim() != 3 or q_pe.dim() != 3 or q_abs.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"mla_q_latent: q_abs [T, H, R] and q_pe [T, H, rope] expected, got "
                         f"{tuple(q_abs.shape)} / {tuple(q_pe.shape)}")
    _check_rope("mla_q_latent", q_pe, cos, sin, q_pe.shape[2])


def add_rms_norm(x: Tensor | PendingSum, residual: Tensor | None, weight: Tensor, eps: float,
                 fp32_copy: bool = False, fp8_rows: tuple[int, bool] | None = None
                 ) -> tuple[Tensor | FP8Rows | None, ...]:
    """Fused :func:`add_rms_norm_reference`: ``x, residual [T, D]`` -> ``(normed [T, D],
    h [T, D])``, one kernel (``h`` is ``x`` itself when ``residual`` is None); with
    ``fp32_copy`` a third output ``normed.float()`` from the same kernel (the fp32 linears the
    reference keeps -- the router, the indexer's ``weights_proj`` -- read it: no cast kernel).
    With ``fp8_rows = (block_k, pow2_scale)`` a last output: ``normed`` quantized per ``1 x
    block_k`` tile by the same kernel (:class:`~hisparse.ops.block_fp8.FP8Rows`, bitwise what
    an FP8 linear's own quantizer makes of ``normed``), or None where the norm runs unfused
    (the linear then quantizes ``normed`` itself).
    ``x`` may be a :class:`~hisparse.ops.pending.PendingSum` (a split-K GEMM's partials, the
    MoE layer's slot rows): the kernel does its sum first, the same additions and rounding as
    its own reduction (bitwise :meth:`~hisparse.ops.pending.PendingSum.materialize` then the
    norm; ``h`` is then the sum plus the residual, a new tensor). Where the norm does not fuse
    (``HISPARSE_FUSED_GLUE=0`` or ``HISPARSE_FUSED_SUMS=0``, no Triton) the sum is
    materialized first."""
    if fp8_rows is not None:
        bk, pow2 = fp8_rows
        if not isinstance(bk, int) or bk < 16 or bk & (bk - 1) or not isinstance(pow2, bool):
            raise ValueError(f"add_rms_norm: fp8_rows must be (block_k, pow2_scale) with "
                             f"block_k a power of two >= 16 and pow2_scale a bool, got "
                             f"{fp8_rows!r}")
    if isinstance(x, PendingSum):
        if x.rows == 0 or not fuses_sums(x.base):
            x = x.materialize()
        else:
            _check_norm_args(x.shape, residual, weight)
            from ._glue_triton import add_rms_norm_sum_triton
            return add_rms_norm_sum_triton(x, residual, weight, eps, fp32_copy, fp8_rows)
    _check_norm_args(tuple(x.shape), residual, weight)
    if x.shape[0] == 0 or not fused(x):
        y, h = add_rms_norm_reference(x, residual, weight, eps)
        return ((y, h) + ((y.float(),) if fp32_copy else ())
                + ((None,) if fp8_rows is not None else ()))
    from ._glue_triton import add_rms_norm_triton
    return add_rms_norm_triton(x, residual, weight, eps, fp32_copy, fp8_rows)


def _check_norm_args(shape: tuple[int, ...], residual: Tensor | None, weight: Tensor) -> None:
    if len(shape) != 2 or (residual is not None and tuple(residual.shape) != shape):
        got = None if residual is None else tuple(residual.shape)
        raise ValueError(f"add_rms_norm: x must be [T, D] and residual the same, got "
                         f"{shape} / {got}")
    if weight.shape != (shape[1],):
        raise ValueError(f"add_rms_norm: weight must be [{shape[1]}], got {tuple(weight.shape)}")


def write_mla_rows(kv: Tensor, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                   dst: Tensor, rows: Tensor, kv_lora_rank: int, q_abs: Tensor | None = None,
                   q_pe: Tensor | None = None) -> Tensor | None:
    """``dst[rows[t]] = mla_rows_reference(kv)[t]``: one layer's arena ``dst`` is ``[N, R +
    rope]`` in a float dtype (rows cast to it) or FP8 byte rows ``[N, 656]`` uint8 (quantized,
    :mod:`hisparse.ops.quant`); ``rows [T]`` flat row ids (a shared sink row: any token wins).
    One kernel: norm, RoPE, quantization and the scattered write.

    With ``q_abs`` and ``q_pe`` (the same tokens' query parts, :func:`mla_q_latent`) also
    returns :func:`mla_q_latent` ``(q_abs, q_pe, cos, sin)``, made by extra programs of the same
    launch (bitwise the separate kernel's; the references when the rows run on theirs, and a
    separate :func:`mla_q_latent` where the two do not share a launch: another dtype or RoPE
    size); else returns None."""
    T, D = kv.shape
    _check_rope("write_mla_rows", kv, cos, sin, D - kv_lora_rank)
    if rows.shape != (T,):
        raise ValueError(f"write_mla_rows: rows must be [T={T}], got {tuple(rows.shape)}")
    query = q_abs is not None
    if query:
        _check_q_latent(q_abs, q_pe, cos, sin)
        if q_pe.shape[0] != T:
            raise ValueError(f"write_mla_rows: the query must have T={T} tokens, got "
                             f"{tuple(q_pe.shape)}")
    fp8 = dst.dtype == torch.uint8
    if T and not fp8 and (dst.dim() != 2 or dst.shape[1] != D):
        raise ValueError(f"write_mla_rows: destination must be [rows, {D}], got "
                         f"{tuple(dst.shape)}")
    if T and fused(kv, dst):
        if fp8:
            check_mla_rows_dst(dst, kv_lora_rank, D - kv_lora_rank)
        from ._glue_triton import write_mla_rows_triton
        fuse = query and q_pe.dtype == kv.dtype and q_pe.shape[2] == D - kv_lora_rank
        q = write_mla_rows_triton(kv, norm_weight, eps, cos, sin, dst, rows, kv_lora_rank,
                                  *((q_abs, q_pe) if fuse else ()))
        if fuse or not query:
            return q
    elif T:
        new = mla_rows_reference(kv, norm_weight, eps, cos, sin, kv_lora_rank)
        if fp8:
            quantize_write_mla_rows(new, dst, rows, kv_lora_rank)
        else:
            dst.index_copy_(0, rows.to(device=dst.device, dtype=torch.long), new.to(dst.dtype))
    return mla_q_latent(q_abs, q_pe, cos, sin) if query else None


def write_index_keys(k: Tensor, ln_weight: Tensor, ln_bias: Tensor, eps: float, cos: Tensor,
                     sin: Tensor, rope_dim: int, interleaved: bool, dst: Tensor, rows: Tensor,
                     ) -> None:
    """Key of flat row ``rows[t]`` = ``index_keys_reference(k)[t]``: ``dst`` one layer's keys,
    ``[N, Di]`` float (cast) or FP8 page-split ``[blocks, block_size * 132]`` uint8
    (:class:`hisparse.ops.quant.FP8KeyLayout`). One kernel: LayerNorm, RoPE, quantization, write."""
    T, d = k.shape
    _check_rope("write_index_keys", k, cos, sin, rope_dim)
    if rows.shape != (T,):
        raise ValueError(f"write_index_keys: rows must be [T={T}], got {tuple(rows.shape)}")
    if T == 0:
        return
    fp8 = dst.dtype == torch.uint8
    if not fp8 and (dst.dim() != 2 or dst.shape[1] != d):
        raise ValueError(f"write_index_keys: destination must be [rows, {d}], got "
                         f"{tuple(dst.shape)}")
    if fused(k, dst):
        block_size = 1
        if fp8:
            from .quant import FP8KeyLayout
            block_size = FP8KeyLayout.of(dst, d).block_size
        from ._glue_triton import write_index_keys_triton
        write_index_keys_triton(k, ln_weight, ln_bias, eps, cos, sin, rope_dim, interleaved, dst,
                                rows, block_size)
        return
    new = index_keys_reference(k, ln_weight, ln_bias, eps, cos, sin, rope_dim, interleaved)
    if fp8:
        quantize_write_index_keys(new, dst, rows)
    else:
        dst.index_copy_(0, rows.to(device=dst.device, dtype=torch.long), new.to(dst.dtype))


def rope_heads(q: Tensor, cos: Tensor, sin: Tensor, rope_dim: int, interleaved: bool) -> Tensor:
    """Fused :func:`rope_heads_reference` (one kernel, no ``cat``); returns a new tensor."""
    if q.dim() != 3:
        raise ValueError(f"rope_heads: q must be [T, heads, D], got {tuple(q.shape)}")
    _check_rope("rope_heads", q, cos, sin, rope_dim)
    if q.shape[0] == 0 or not fused(q):
        return rope_heads_reference(q, cos, sin, rope_dim, interleaved)
    from ._glue_triton import rope_heads_triton
    return rope_heads_triton(q, cos, sin, rope_dim, interleaved)


def resident_rows(topk: Tensor, table: Tensor, token_slot: Tensor, block_size: int) -> Tensor:
    """Fused :func:`resident_rows_reference` (one kernel; the GPU-resident attention path)."""
    if topk.dim() != 2 or token_slot.shape != (topk.shape[0],) or table.dim() != 2:
        raise ValueError(f"resident_rows: topk [T, K], token_slot [T] and table [R, P] "
                         f"expected, got {tuple(topk.shape)}, {tuple(token_slot.shape)}, "
                         f"{tuple(table.shape)}")
    if topk.numel() == 0 or not fused(topk):
        return resident_rows_reference(topk, table, token_slot, block_size)
    from ._glue_triton import resident_rows_triton
    return resident_rows_triton(topk, table, token_slot, block_size)


def mla_q_latent(q_abs: Tensor, q_pe: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Fused :func:`mla_q_latent_reference` (one kernel reading both inputs in place; or folded
    into the rows' launch: :func:`write_mla_rows`)."""
    _check_q_latent(q_abs, q_pe, cos, sin)
    if q_pe.shape[0] == 0 or not fused(q_pe):
        return mla_q_latent_reference(q_abs, q_pe, cos, sin)
    from ._glue_triton import mla_q_latent_triton
    return mla_q_latent_triton(q_abs, q_pe, cos, sin)
