"""Fused routed-expert MoE (DeepSeek / GLM): token sorting by expert, grouped GEMMs, combine.

Contract (``fused_moe``): ``x [T, D]``, routing ``topk_ids [T, k]`` (expert ids) and
``topk_weights [T, k]`` (fp32, already scaled), experts ``gate_up [E, 2I, D]`` (rows ``[gate;
up]``) and ``down [E, D, I]``, either in the model dtype or FP8 block-quantized with
``gate_up_scale [E, 2 * ceil(I/bn), ceil(D/bk)]`` (gate blocks, then up blocks: a partial last
gate block never shares a scale with up rows) and ``down_scale [E, ceil(D/bn), ceil(I/bk)]``.
Returns ``sum_j w[t, j] * down[e_j] @ silu(gate[e_j] x) * (up[e_j] x)`` in ``x.dtype``.
``pow2_scale``: FP8 activation scales rounded up to powers of two (``scale_fmt: ue8m0``).

The fused path has no host sync and fixed shapes (CUDA-graph capturable):

1. :func:`moe_align` (:mod:`hisparse.ops.moe_tiles`): the ``A = T * k`` assignments are sorted
   by expert (``torch.sort``, stable) into a padded per-expert layout of ``BLOCK_M``-row tiles:
   ``sorted_ids [max_tiles * BLOCK_M]`` (assignment id or -1) and ``tile_expert [max_tiles]``
   (expert or -1), where ``max_tiles = ceil((A + min(E, A) * (BLOCK_M - 1)) / BLOCK_M)``
   bounds any routing;
2. grouped GEMM 1 (Triton): per (tile, N block) the tile's token rows are gathered, multiplied
   with the tile's expert gate and up rows (FP8: activations quantized per 1 x bk in registers),
   ``silu(g) * u`` stored in the padded layout;
3. grouped GEMM 2: ``down`` per (tile, D block), times the routing weight, stored per
   assignment ``[A, D]`` in ``x.dtype``; the combine sums the k assignments of each token in
   fp32 in a fixed order (deterministic, no atomics). Tiles of no expert (-1) load nothing.

``fused_moe_reference`` is the per-expert Python loop (host sync; the spec).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import cdiv, want_triton
from .block_fp8 import dequantize_fp8_act, dequantize_fp8_weight, quantize_fp8_act
from .moe_tiles import moe_align as moe_align  # the layout's API, public here too
from .moe_tiles import moe_align_reference as moe_align_reference
from .moe_tiles import moe_max_tiles as moe_max_tiles

_ACT = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int,
                   block: tuple[int, int] | None, rows_split: int | None = None) -> torch.Tensor:
    """Expert ``e``'s weight, dequantized to fp32 when FP8 (``rows_split``: gate_up's I)."""
    if scale is None:
        return w[e]
    if rows_split is None:
        return dequantize_fp8_weight(w[e], scale[e], block)
    nbi = cdiv(rows_split, block[0])
    return torch.cat([dequantize_fp8_weight(w[e, :rows_split], scale[e, :nbi], block),
                      dequantize_fp8_weight(w[e, rows_split:], scale[e, nbi:], block)])


def fused_moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu", *,
                        gate_up_scale: torch.Tensor | None = None,
                        down_scale: torch.Tensor | None = None,
                        block: tuple[int, int] | None = None,
                        quantize_input: bool = False, pow2_scale: bool = False) -> torch.Tensor:
    """Loop over the experts hit (syncs with the host). FP8 experts are dequantized and run in
    fp32; plain experts run in their dtype (as the model's original loop). ``quantize_input``
    (FP8 only): pass both GEMMs' activations through the per-tile FP8 quantization the fused
    path applies (the intermediate first rounded to ``x.dtype``, as the fused path stores it)."""
    out = torch.zeros_like(x)
    I = down.shape[-1]
    f = _ACT[act]
    q = quantize_input and gate_up_scale is not None

    def fake_quant(a: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8_act(*quantize_fp8_act(a, block[1], pow2_scale), block[1]) \
            if q else a

    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)
        gu = _expert_weight(gate_up, gate_up_scale, e, block, rows_split=I)
        dn = _expert_weight(down, down_scale, e, block)
        xs = fake_quant(x[tok]).to(gu.dtype)
        gate, up = F.linear(xs, gu).chunk(2, dim=-1)
        h = f(gate) * up
        if q:
            h = fake_quant(h.to(x.dtype)).to(dn.dtype)
        y = F.linear(h, dn) * topk_weights[tok, slot, None].to(dn.dtype)
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu", *,
              gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None, use_triton: bool | None = None,
              pow2_scale: bool = False) -> torch.Tensor:
    """Routed-expert output ``[T, D]`` (see the module doc). Triton on CUDA (or with
    HISPARSE_FORCE_TRITON=1) for ``act="silu"``; the reference loop otherwise."""
    fp8 = gate_up_scale is not None
    if fp8 and (down_scale is None or block is None):
        raise ValueError("fused_moe: FP8 experts need gate_up_scale, down_scale and block")
    if use_triton is None:
        use_triton = want_triton(x)
    if not use_triton or act != "silu" or x.shape[0] == 0:
        return fused_moe_reference(x, topk_ids, topk_weights, gate_up, down, act,
                                   gate_up_scale=gate_up_scale, down_scale=down_scale,
                                   block=block)
    from ._moe_triton import fused_moe_triton
    return fused_moe_triton(x, topk_ids, topk_weights, gate_up, down, gate_up_scale, down_scale,
                            block, pow2_scale)


def fused_moe_graph_safe(act: str) -> bool:
    """Whether :func:`fused_moe` on CUDA runs without a host sync for this activation."""
    return act == "silu"
