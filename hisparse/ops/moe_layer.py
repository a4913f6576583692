"""The whole MoE layer of DeepSeek-V3.2 / GLM-5 fused: router, shared expert, routed experts.

Seven kernels per layer on CUDA (six with ``HISPARSE_MOE_QUANT=fused``, eight with ``=kernel``),
none of them a general sort or a host sync (CUDA-graph capturable; every row computed independently
of the batch it runs in):

1. router GEMM (:func:`route`): logits ``x @ gate^T`` as fp32 partials over a K split fixed by
   ``D`` (token tiles of ``RouterConfig.block_t`` whatever ``T``). The model loads the gate
   in fp32 and transformers computes it in fp32 (``_keep_in_fp32_modules_strict``);
   DeepSeek stores the gate weight in bf16, so with bf16 activations every product is exact in
   fp32. The model keeps such a gate in bf16 (:meth:`hisparse.models.dsa.DSAForCausalLM.
   narrow_fp32_weights_`: only when every value is a bf16 value) and the kernel multiplies in
   one bf16 MMA pass; an fp32 gate is multiplied in 3xTF32 (exact products for bf16-valued
   operands, about fp32 otherwise); both accumulate in fp32: the reference up to summation
   order.
   FP8 experts: its programs of the first expert block also quantize ``x`` (step 4);
2. routing (:func:`route`): per token, the partials summed in split order, ``sigmoid``, plus
   ``e_score_correction_bias`` for the choice, group-limited top-k (group score = sum of its two
   best; the ``topk_group`` best groups; the ``top_k`` best experts in them), weights = the
   uncorrected scores of the chosen, divided by their sum + 1e-20 (``norm_topk_prob``), times
   ``routed_scaling_factor``. Ties go to the lower index (:func:`route_reference`: stable sort);
   the shared experts are appended as columns ``E, E+1, ...`` of weight 1;
3. alignment (:func:`align`): assignments into per-expert tiles in token order (the layout of
   :func:`hisparse.ops.moe.moe_align`), one program per 8 experts, each from a histogram of
   every assignment (the tile prefix) and one-hot prefix sums over its own experts
   (``HISPARSE_MOE_ALIGN=single``: the one-program kernel, the baseline). The layout is a
   function of the routing alone (deterministic), and a row's GEMM result does not depend on
   its place in a tile (each output element is its own K-ordered dot product);
4. / 6. activation quantization (FP8 experts): ``x`` and the intermediate ``silu(g) * u``
   per ``1 x bk`` with the GEMM tiles' math (the same bits wherever it runs): ``x`` in the
   router GEMM, the intermediate by its own kernel (default, ``HISPARSE_MOE_QUANT=router``);
   ``=fused`` quantizes the intermediate in the down GEMM's tiles (its K is only ``I``; one
   kernel fewer, but inside the real rank's step the down GEMM then took 1.7x as long: 7.0 vs
   4.1 ms a step at 24 tokens on the H200), ``=gate_up`` in the gate-up GEMM's epilogue (N
   tile = the FP8 block), ``=kernel`` both in their own kernels (the baseline);
5. / 7. the grouped GEMMs of :mod:`hisparse.ops.moe`, the shared expert served as expert ``E``
   from its own tensors (SGLang's "shared experts fusion", without copying weights); programs
   of unused tiles (the layout is sized for any routing) exit at once;
8. combine (:func:`combine`): each token's ``top_k + n_shared`` rows summed in fp32 in slot
   order, rounded once to ``x.dtype``; with ``pending`` not launched: the next layer's input
   norm does the same sum (:func:`pending_combine`, :mod:`hisparse.ops.pending`).

``HISPARSE_FUSED_MOE=0`` runs the unfused layer (torch router, sort-based alignment, the shared
expert as its own MLP): the baseline the benchmark and kernel counts compare against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import switches
from ._common import cdiv, interpreted, next_pow2, want_triton
from .block_fp8 import quantize_fp8_act
from .moe_tiles import FUSED_BLOCK_M, moe_align_reference, moe_max_tiles
from .pending import PendingSum

# Steps of up to this many tokens run fused (decode and the lossless contract's batch-invariant
# sizes): every alignment program histograms all assignments and the router GEMM re-reads its
# weight per token tile, both fine here, both worse than the unfused path for prefill-sized steps.
MOE_LAYER_MAX_TOKENS = 512


@dataclass(frozen=True)
class RouterConfig:
    """Launches of the router GEMM and the routing kernel, the same for every ``T`` (so a
    row's bits do not depend on its batch). ``k_split``: K per fp32 partial (the split count
    depends on ``D`` only; a power of two, a multiple of ``block_k`` and of the FP8 block);
    ``block_t`` tokens per GEMM program (fixed whatever ``T``: a row's MMA shape does not
    depend on its batch; wider tiles re-read the fp32 weight less), ``block_e`` experts per
    GEMM program, ``block_k`` its K step, ``gemm_warps``;
    ``route_tokens`` per routing program and ``route_warps`` (one warp per token: its
    top-k reductions stay in the warp). ``k_split`` and ``block_k`` change the logits'
    summation order (a few fp32 ulps), ``block_t`` may (another MMA shape); the rest never
    changes a bit."""
    k_split: int = 512
    block_t: int = 16
    block_e: int = 64
    block_k: int = 64
    gemm_warps: int = 4
    route_tokens: int = 1
    route_warps: int = 1


# Defaults: the fastest bit-neutral launch of the router sweep (H100, 2026-12-06, `bench_moe.py
# --router-sweep --moe-batches 8,24,96`): 13.2 / 13.6 / 20.5 us at 8 / 24 / 96 tokens against
# 13.9 / 15.6 / 26.0 for the former 32 experts a program and 4 tokens of 4 warps a route program
ROUTER_CONFIG = RouterConfig()


def fused_moe_layer_enabled() -> bool:
    """False when ``HISPARSE_FUSED_MOE=0`` (:mod:`hisparse.ops.switches`): the MoE layer runs
    unfused."""
    return switches.current().fused_moe


@dataclass(frozen=True)
class RoutingConfig:
    """DeepSeek's ``noaux_tc`` routing (config names as transformers')."""
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


@dataclass
class SharedExpert:
    """A shared expert with the routed experts' intermediate size ``I``: ``gate``, ``up``
    ``[I, D]`` and ``down [D, I]`` (FP8: fp32 ``*_scale`` in the routed experts' blocks)."""
    gate: Tensor
    up: Tensor
    down: Tensor
    gate_scale: Tensor | None = None
    up_scale: Tensor | None = None
    down_scale: Tensor | None = None

    def check(self, gate_up: Tensor, down: Tensor, gate_up_scale: Tensor | None,
              down_scale: Tensor | None) -> None:
        """The kernels address the shared tensors with the routed experts' strides."""
        I, D = down.shape[2], down.shape[1]
        for name, t, shape, like in (("gate", self.gate, (I, D), gate_up[0]),
                                     ("up", self.up, (I, D), gate_up[0]),
                                     ("down", self.down, (D, I), down[0])):
            if tuple(t.shape) != shape or t.dtype != like.dtype or t.stride() != like.stride():
                raise ValueError(f"shared expert {name}: want {shape} {like.dtype} with strides "
                                 f"{like.stride()}, got {tuple(t.shape)} {t.dtype} {t.stride()}")
        if gate_up_scale is None:
            return
        nbi = gate_up_scale.shape[1] // 2
        for name, t, like in (("gate_scale", self.gate_scale, gate_up_scale[0, :nbi]),
                              ("up_scale", self.up_scale, gate_up_scale[0, nbi:]),
                              ("down_scale", self.down_scale, down_scale[0])):
            if (t is None or t.shape != like.shape or t.dtype != torch.float32
                    or t.stride() != like.stride()):
                raise ValueError(f"shared expert {name}: want {tuple(like.shape)} fp32 with "
                                 f"strides {like.stride()}")


# ----------------------------------------------------------------------------- references
def route_reference(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: RoutingConfig,
                    n_shared: int = 0) -> tuple[Tensor, Tensor]:
    """``(ids int32 [T, top_k + n_shared], weights fp32)``, chosen in descending choice score
    (ties: lower index first), then the shared columns ``E..E+n_shared-1`` with weight 1."""
    T, E = x.shape[0], weight.shape[0]
    G = cfg.n_group
    scores = F.linear(x.float(), weight.float()).sigmoid()
    choice = scores if bias is None else scores + bias.float()

    def best(v: Tensor, k: int) -> Tensor:
        return torch.sort(v, dim=-1, descending=True, stable=True).indices[..., :k]

    grouped = choice.view(T, G, E // G)
    group_scores = grouped.gather(-1, best(grouped, 2)).sum(-1)
    group_mask = torch.zeros(T, G, dtype=torch.bool, device=x.device)
    group_mask.scatter_(1, best(group_scores, cfg.topk_group), True)
    masked = choice.masked_fill(~group_mask.repeat_interleave(E // G, dim=1), float("-inf"))
    idx = best(masked, cfg.top_k)
    w = scores.gather(1, idx)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    shared = torch.arange(E, E + n_shared, device=x.device).expand(T, n_shared)
    return (torch.cat([idx, shared], 1).to(torch.int32),
            torch.cat([w, w.new_ones(T, n_shared)], 1))


def combine_reference(y: Tensor, T: int, dtype: torch.dtype) -> Tensor:
    """``y [T * K, D]`` -> ``[T, D]``: ``((y0 + y1) + y2) + ...`` in fp32, rounded once."""
    rows = y.view(T, -1, y.shape[-1])
    acc = torch.zeros(T, y.shape[-1], device=y.device, dtype=torch.float32)
    for j in range(rows.shape[1]):
        acc += rows[:, j].float()
    return acc.to(dtype)


# ----------------------------------------------------------------------------- dispatch
def route(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: RoutingConfig,
          n_shared: int = 0, use_triton: bool | None = None, config: RouterConfig | None = None
          ) -> tuple[Tensor, Tensor]:
    """:func:`route_reference` in two kernels (router GEMM, routing). ``x [T, D]`` (the normed
    hidden, any float dtype), ``weight [E, D]`` (fp32, or bf16 with a bf16 ``x``: one bf16
    MMA pass, :func:`hisparse.ops._gemm_splitk_triton.fp32_precision`), ``bias [E]`` fp32 or
    None; launches ``config`` (:data:`ROUTER_CONFIG` when None)."""
    ids, w, _ = _route(x, weight, bias, cfg, n_shared, use_triton, None,
                       config or ROUTER_CONFIG)
    return ids, w


def route_quantized(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: RoutingConfig,
                    n_shared: int, block_k: int, pow2_scale: bool,
                    config: RouterConfig | None = None
                    ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """:func:`route` on Triton whose router GEMM also quantizes ``x`` per ``1 x block_k``:
    ``(ids, weights, (xq float8_e4m3fn [T, D], scales fp32 [T, cdiv(D, block_k)]))``, the
    values of :func:`quantize_act` (bitwise on CUDA; the interpreter's fp8 cast is not
    torch's). ``block_k`` must divide ``config.k_split`` (:data:`ROUTER_CONFIG` when None)."""
    c = config or ROUTER_CONFIG
    if c.k_split % block_k:
        raise ValueError(f"route_quantized: block_k={block_k} must divide the router's "
                         f"k_split={c.k_split}")
    ids, w, q = _route(x, weight, bias, cfg, n_shared, True, (block_k, pow2_scale), c)
    return ids, w, q


def _route(x, weight, bias, cfg, n_shared, use_triton, quant, c: RouterConfig):
    T, D = x.shape
    E = weight.shape[0]
    G = cfg.n_group
    if (E % G or E // G < 2 or not 1 <= cfg.topk_group <= G
            or cfg.top_k > cfg.topk_group * (E // G)):
        raise ValueError(f"routing: n_routed_experts={E} must split into n_group={G} groups of "
                         f">= 2, 1 <= topk_group={cfg.topk_group} <= n_group, top_k={cfg.top_k} "
                         f"<= the experts of topk_group groups ({cfg.topk_group * (E // G)})")
    if use_triton is None:
        use_triton = want_triton(x)
    if not use_triton or T == 0:
        q = quantize_act(x, quant[0], quant[1], use_triton=False) if quant else None
        return (*route_reference(x, weight, bias, cfg, n_shared), q)
    from ._gemm_splitk_triton import fp32_precision
    from ._moe_layer_triton import _moe_route_kernel, _moe_router_gemm_kernel

    if (c.k_split & (c.k_split - 1) or c.block_k & (c.block_k - 1) or c.k_split % c.block_k
            or c.block_e & (c.block_e - 1) or c.route_tokens & (c.route_tokens - 1)
            or c.block_t & (c.block_t - 1) or c.block_t < 16):
        raise ValueError(f"{c}: k_split, block_k, block_e, block_t and route_tokens must be "
                         f"powers of two, block_t >= 16, k_split a multiple of block_k")
    splits = cdiv(D, c.k_split)
    part = torch.empty(splits, T, E, device=x.device, dtype=torch.float32)
    x, weight = x.contiguous(), weight.contiguous()
    if quant:
        qbk, pow2 = quant
        kb = cdiv(D, qbk)
        xq = torch.empty(T, D, device=x.device, dtype=torch.float8_e4m3fn)
        xs = torch.empty(T, kb, device=x.device, dtype=torch.float32)
    else:
        qbk, pow2, kb, xq, xs = c.k_split, False, 1, part, part
    _moe_router_gemm_kernel[(cdiv(T, c.block_t), cdiv(E, c.block_e), splits)](
        x, weight, part, xq, xs, T, E, D, kb, x.stride(0), weight.stride(0), part.stride(0),
        xq.stride(0), xs.stride(0),
        K_SPLIT=c.k_split, BLOCK_T=c.block_t, BLOCK_E=c.block_e, BLOCK_K=c.block_k,
        PRECISION=fp32_precision(x, weight), QUANT=quant is not None, QBK=qbk, POW2=pow2,
        num_warps=c.gemm_warps)
    k_out = cfg.top_k + n_shared
    ids = torch.empty(T, k_out, device=x.device, dtype=torch.int32)
    w = torch.empty(T, k_out, device=x.device, dtype=torch.float32)
    epg = E // G
    block_t = c.route_tokens if x.is_cuda else 16   # the interpreter's cost is per program
    _moe_route_kernel[(cdiv(T, block_t),)](
        part, bias if bias is not None else part, ids, w, T, part.stride(0),
        float(cfg.routed_scaling_factor), E,
        E=E, SPLITS=splits, G=G, GP=next_pow2(G), EPG=epg, EPGP=next_pow2(epg),
        TOPK_GROUP=cfg.topk_group, TOPK=cfg.top_k, KP=max(2, next_pow2(k_out)),
        N_SHARED=n_shared, NORM=bool(cfg.norm_topk_prob), HAS_BIAS=bias is not None,
        LIBDEVICE=x.is_cuda and not interpreted(), BLOCK_T=block_t,
        num_warps=c.route_warps)
    return ids, w, ((xq, xs) if quant else None)


@dataclass(frozen=True)
class AlignConfig:
    """Launch of the parallel alignment (any choice gives the same layout, bit for bit):
    ``experts`` per program (a power of two), assignments per ``chunk`` at most (a call's
    block is no wider than its ``T * k`` assignments), ``num_warps``."""
    experts: int = 8
    chunk: int = 1024
    num_warps: int = 4


ALIGN_CONFIG = AlignConfig()


def align_mode() -> str:
    """``HISPARSE_MOE_ALIGN``: ``experts`` (default: one program per few experts) or
    ``single`` (the one-program kernel: the baseline)."""
    return switches.current().moe_align


def quant_mode() -> str:
    """``HISPARSE_MOE_QUANT`` (FP8 experts, CUDA): where the layer quantizes its activations:
    ``router`` (default: ``x`` in the router GEMM's programs, the intermediate by its own
    kernel), ``fused`` (the intermediate in the down GEMM's tiles), ``gate_up`` (the
    intermediate in the gate-up GEMM's epilogue, whose N tile becomes the FP8 block) or
    ``kernel`` (two quantization kernels: the baseline). The same bits in every mode."""
    return switches.current().moe_quant


def align(ids: Tensor, num_experts: int, block_m: int, use_triton: bool | None = None,
          mode: str | None = None, config: AlignConfig | None = None,
          out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """:func:`hisparse.ops.moe.moe_align`'s layout for routing whose ``k`` ids per token are
    distinct (as :func:`route` makes them), in one kernel without a sort: ``mode``
    (:func:`align_mode` when None) ``experts`` runs ``cdiv(num_experts, config.experts)``
    programs, ``single`` one. Every element is written (no host sync, shapes fixed by ``T, k``),
    into ``out`` when given (int32 of the returned shapes)."""
    mode = mode or align_mode()
    if mode not in switches.MOE_ALIGN_MODES:
        raise ValueError(f"align: mode={mode!r}: want one of {switches.MOE_ALIGN_MODES}")
    if use_triton is None:
        use_triton = want_triton(ids)
    if not use_triton:
        s, e = moe_align_reference(ids.cpu(), num_experts, block_m)
        return s.to(ids.device), e.to(ids.device)
    from ._moe_layer_triton import _moe_align_experts_kernel, _moe_align_kernel

    T, k = ids.shape
    max_tiles = moe_max_tiles(T * k, num_experts, block_m)
    if out is None:
        out = (torch.empty(max_tiles * block_m, device=ids.device, dtype=torch.int32),
               torch.empty(max_tiles, device=ids.device, dtype=torch.int32))
    sorted_ids, tile_expert = out
    if (sorted_ids.shape != (max_tiles * block_m,) or tile_expert.shape != (max_tiles,)
            or sorted_ids.dtype != torch.int32 or tile_expert.dtype != torch.int32
            or not sorted_ids.is_contiguous() or not tile_expert.is_contiguous()):
        raise ValueError(f"align out: want contiguous int32 [{max_tiles * block_m}] and "
                         f"[{max_tiles}], got {tuple(sorted_ids.shape)} {sorted_ids.dtype} and "
                         f"{tuple(tile_expert.shape)} {tile_expert.dtype}")
    ids = ids.contiguous()
    if mode == "single":
        _moe_align_kernel[(1,)](ids, sorted_ids, tile_expert, T, sorted_ids.numel(),
                                max_tiles, K=k, E=num_experts, EP=next_pow2(num_experts),
                                BLOCK_T=16, BLOCK_M=block_m, FILL=1024, num_warps=8)
        return sorted_ids, tile_expert
    c = config or ALIGN_CONFIG
    if c.experts < 1 or c.experts & (c.experts - 1) or c.chunk < 16 or c.chunk & (c.chunk - 1):
        raise ValueError(f"AlignConfig: experts={c.experts} and chunk={c.chunk} must be powers "
                         f"of two (chunk >= 16)")
    programs = cdiv(num_experts, c.experts)
    # no wider than the assignments: the counts' histogram costs per element of the block
    # (at decode's 8 tokens x 9 ids a 1024-wide block is 14x the work)
    chunk = max(16, min(c.chunk, next_pow2(T * k)))
    _moe_align_experts_kernel[(programs,)](
        ids, sorted_ids, tile_expert, T * k, sorted_ids.numel(), max_tiles,
        cdiv(T, block_m), cdiv(sorted_ids.numel(), programs), cdiv(max_tiles, programs),
        E=num_experts, EP=next_pow2(num_experts + 1), EB=c.experts, CHUNK=chunk,
        BLOCK_M=block_m, TB=32, FILL=256, num_warps=c.num_warps)
    return sorted_ids, tile_expert


def quantize_act(x: Tensor, block_k: int, pow2_scale: bool, use_triton: bool | None = None
                 ) -> tuple[Tensor, Tensor]:
    """:func:`hisparse.ops.block_fp8.quantize_fp8_act` in one kernel on CUDA (the interpreter's
    fp32 -> fp8 cast does not round like torch's: on CPU the reference runs by default)."""
    if not (x.is_cuda if use_triton is None else use_triton):
        q, s = quantize_fp8_act(x, block_k, pow2_scale)
        return q.contiguous(), s
    from ._moe_layer_triton import _moe_quant_act_kernel

    T, K = x.shape
    kb = cdiv(K, block_k)
    q = torch.empty(T, K, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(T, kb, device=x.device, dtype=torch.float32)
    if T:
        _moe_quant_act_kernel[(cdiv(T, 16), kb)](x, q, s, T, K, x.stride(0), q.stride(0),
                                                 s.stride(0), BLOCK_R=16, BLOCK_K=block_k,
                                                 POW2=pow2_scale)
    return q, s


def combine(y: Tensor, T: int, dtype: torch.dtype, use_triton: bool | None = None) -> Tensor:
    """``y [T * K, D]`` -> ``[T, D]``: each token's K rows summed in fp32 in slot order."""
    if use_triton is None:
        use_triton = want_triton(y)
    if not use_triton or T == 0:
        return combine_reference(y, T, dtype)
    from ._moe_layer_triton import _moe_token_sum_kernel

    D = y.shape[1]
    out = torch.empty(T, D, device=y.device, dtype=dtype)
    block_d = 512
    _moe_token_sum_kernel[(T, cdiv(D, block_d))](y, out, D, y.stride(0), out.stride(0),
                                           K=y.shape[0] // T, BLOCK_D=block_d)
    return out


def moe_layer(x: Tensor, router_weight: Tensor, router_bias: Tensor | None, cfg: RoutingConfig,
              gate_up: Tensor, down: Tensor, *, gate_up_scale: Tensor | None = None,
              down_scale: Tensor | None = None, block: tuple[int, int] | None = None,
              pow2_scale: bool = False, shared: SharedExpert | None = None,
              prequant: bool = True, tile_n: tuple[int, int] | None = None,
              pending: bool = False) -> Tensor | PendingSum:
    """Routed experts (+ the shared one) of ``x [T, D]`` -> ``[T, D]`` in ``x.dtype``, on Triton
    (the kernels of the module doc); experts as :func:`hisparse.ops.moe.fused_moe` takes them.
    ``prequant`` (FP8): quantize ``x`` and the intermediate once each (where
    :func:`quant_mode` says) instead of in every GEMM tile (the grouped GEMMs' programs of one
    tile each redo it ``I / 64`` resp. ``D / 128`` times); the same bits either way.
    ``tile_n``: the grouped GEMMs' N tile caps (:func:`hisparse.ops._moe_triton.grouped_moe`;
    bit-neutral). ``pending``: return the combine as a :class:`~hisparse.ops.pending.
    PendingSum` of the slot rows (not launched: for the next fused norm; its ``materialize``
    is :func:`combine`)."""
    from ._moe_triton import grouped_moe

    T = x.shape[0]
    E = gate_up.shape[0]
    n_shared = int(shared is not None)
    fp8 = gate_up_scale is not None
    qmode = quant_mode() if fp8 else "kernel"
    if not (prequant and x.is_cuda):   # in the tiles, or the interpreter (torch's fp8 cast)
        qmode = "kernel"
    elif qmode != "kernel" and ROUTER_CONFIG.k_split % block[1]:
        qmode = "kernel"               # the router's K split must hold whole FP8 blocks
    elif qmode == "gate_up" and (down.shape[2] % block[1] or tile_n):
        qmode = "fused"                # the epilogue needs whole blocks and its own N tile
    x_quant = None
    if qmode == "kernel":
        ids, w = route(x, router_weight, router_bias, cfg, n_shared, use_triton=True)
    else:
        ids, w, x_quant = route_quantized(x, router_weight, router_bias, cfg, n_shared,
                                          block[1], pow2_scale)
    # one tile height for every batch size: a row's GEMM (and so its bits) must not depend on
    # T (moe_block_m grows with tokens per expert; 16 is what it picks for 256 experts here)
    block_m = FUSED_BLOCK_M
    sorted_ids, tile_expert = align(ids, E + n_shared, block_m, use_triton=True)
    y = grouped_moe(x, sorted_ids, tile_expert, block_m, w, gate_up, down, gate_up_scale,
                    down_scale, block, pow2_scale, shared=shared,
                    quantize=quantize_act if prequant else None, skip_empty=True,
                    x_quant=x_quant, tile_n=tile_n,
                    h_quant={"fused": "tile", "gate_up": "epilogue"}.get(qmode))
    if pending:
        return pending_combine(y, T, x.dtype)
    return combine(y, T, x.dtype, use_triton=True)


def pending_combine(y: Tensor, T: int, dtype: torch.dtype) -> PendingSum:
    """:func:`combine` (Triton) of ``y [T * K, D]`` not launched yet: token ``t``'s ``K`` slot
    rows as one group of a :class:`~hisparse.ops.pending.PendingSum` (the same fp32 additions
    in slot order, one rounding)."""
    if T < 1 or y.dim() != 2 or y.shape[0] % T or y.stride(1) != 1:
        raise ValueError(f"pending_combine: want y [T * K, D] with unit column stride for "
                         f"T={T}, got {tuple(y.shape)}")
    k = y.shape[0] // T
    return PendingSum(y, rows=T, cols=y.shape[1], row_stride=k * y.stride(0),
                      part_stride=y.stride(0), count=k, group=k, dtype=dtype,
                      reduce=functools.partial(combine, y, T, dtype, use_triton=True))
