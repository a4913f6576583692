"""The whole MoE layer of DeepSeek-V3.2 / GLM-5 fused: router, shared expert, routed experts.

Eight kernels per layer on CUDA (FP8 experts; six for plain ones), none of them a general sort
or a host sync (CUDA-graph capturable; every row computed independently of the batch it runs
in):

1. router GEMM (:func:`route`): logits ``x @ gate^T`` as fp32 partials over a K split fixed by
   ``D`` (16-token tiles whatever ``T``). The checkpoints keep the gate in fp32 and transformers
   computes it in fp32 (``_keep_in_fp32_modules_strict``); DeepSeek stores the gate weight in
   bf16, so with bf16 activations every product is exact in fp32. The kernel reads the fp32
   weight and multiplies on the tensor cores in 3xTF32 (exact products for bf16-valued
   operands, about fp32 otherwise), accumulating in fp32: the reference up to summation order;
2. routing (:func:`route`): per token, the partials summed in split order, ``sigmoid``, plus
   ``e_score_correction_bias`` for the choice, group-limited top-k (group score = sum of its two
   best; the ``topk_group`` best groups; the ``top_k`` best experts in them), weights = the
   uncorrected scores of the chosen, divided by their sum + 1e-20 (``norm_topk_prob``), times
   ``routed_scaling_factor``. Ties go to the lower index (:func:`route_reference`: stable sort);
   the shared experts are appended as columns ``E, E+1, ...`` of weight 1;
3. alignment (:func:`align`): assignments into per-expert tiles in token order (the layout of
   :func:`hisparse.ops.moe.moe_align`), from per-expert counts and one-hot prefix sums;
4. / 6. activation quantization (FP8 experts): ``x`` and the intermediate ``silu(g) * u``
   per ``1 x bk``, once each, not in every program of the GEMMs that read them (the same math);
5. / 7. the grouped GEMMs of :mod:`hisparse.ops.moe`, the shared expert served as expert ``E``
   from its own tensors (SGLang's "shared experts fusion", without copying weights); programs
   of unused tiles (the layout is sized for any routing) exit at once;
8. combine (:func:`combine`): each token's ``top_k + n_shared`` rows summed in fp32 in slot
   order, rounded once to ``x.dtype``.

``HISPARSE_FUSED_MOE=0`` runs the unfused layer (torch router, sort-based alignment, the shared
expert as its own MLP): the baseline the benchmark and kernel counts compare against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import cdiv, interpreted, next_pow2, want_triton
from .block_fp8 import quantize_fp8_act
from .moe_tiles import moe_align_reference, moe_max_tiles

FUSED_MOE_ENV = "HISPARSE_FUSED_MOE"
# Steps of up to this many tokens run fused (decode and the lossless contract's batch-invariant
# sizes): the alignment is one program and the router GEMM re-reads its weight per 16 tokens,
# both fine here, both worse than the unfused path for prefill-sized steps.
MOE_LAYER_MAX_TOKENS = 512
ROUTER_K_SPLIT = 512      # K per router partial: the split count depends on D only
_ROUTER_BLOCK_T = 16      # fixed token tile: a row's MMA shape does not depend on T
FUSED_BLOCK_M = 16        # grouped-GEMM tile height of the fused layer, whatever T


def fused_moe_layer_enabled() -> bool:
    """False when ``HISPARSE_FUSED_MOE=0``: the MoE layer runs unfused."""
    return os.environ.get(FUSED_MOE_ENV, "1") != "0"


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
          n_shared: int = 0, use_triton: bool | None = None) -> tuple[Tensor, Tensor]:
    """:func:`route_reference` in two kernels (router GEMM, routing). ``x [T, D]`` (the normed
    hidden, any float dtype), ``weight [E, D]`` (fp32), ``bias [E]`` fp32 or None."""
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
        return route_reference(x, weight, bias, cfg, n_shared)
    from ._moe_layer_triton import _moe_route_kernel, _moe_router_gemm_kernel

    splits = cdiv(D, ROUTER_K_SPLIT)
    part = torch.empty(splits, T, E, device=x.device, dtype=torch.float32)
    x, weight = x.contiguous(), weight.contiguous()
    block_e = 32
    _moe_router_gemm_kernel[(cdiv(T, _ROUTER_BLOCK_T), cdiv(E, block_e), splits)](
        x, weight, part, T, E, D, x.stride(0), weight.stride(0), part.stride(0),
        K_SPLIT=ROUTER_K_SPLIT, BLOCK_T=_ROUTER_BLOCK_T, BLOCK_E=block_e, BLOCK_K=64,
        PRECISION="ieee" if interpreted() or not x.is_cuda else "tf32x3")
    k_out = cfg.top_k + n_shared
    ids = torch.empty(T, k_out, device=x.device, dtype=torch.int32)
    w = torch.empty(T, k_out, device=x.device, dtype=torch.float32)
    epg = E // G
    block_t = 4 if x.is_cuda else 16   # the interpreter's cost is per program
    _moe_route_kernel[(cdiv(T, block_t),)](
        part, bias if bias is not None else part, ids, w, T, part.stride(0),
        float(cfg.routed_scaling_factor), E,
        E=E, SPLITS=splits, G=G, GP=next_pow2(G), EPG=epg, EPGP=next_pow2(epg),
        TOPK_GROUP=cfg.topk_group, TOPK=cfg.top_k, KP=max(2, next_pow2(k_out)),
        N_SHARED=n_shared, NORM=bool(cfg.norm_topk_prob), HAS_BIAS=bias is not None,
        LIBDEVICE=x.is_cuda and not interpreted(), BLOCK_T=block_t)
    return ids, w


def align(ids: Tensor, num_experts: int, block_m: int, use_triton: bool | None = None
          ) -> tuple[Tensor, Tensor]:
    """:func:`hisparse.ops.moe.moe_align`'s layout for routing whose ``k`` ids per token are
    distinct (as :func:`route` makes them), in one kernel without a sort."""
    if use_triton is None:
        use_triton = want_triton(ids)
    if not use_triton:
        s, e = moe_align_reference(ids.cpu(), num_experts, block_m)
        return s.to(ids.device), e.to(ids.device)
    from ._moe_layer_triton import _moe_align_kernel

    T, k = ids.shape
    max_tiles = moe_max_tiles(T * k, num_experts, block_m)
    sorted_ids = torch.empty(max_tiles * block_m, device=ids.device, dtype=torch.int32)
    tile_expert = torch.empty(max_tiles, device=ids.device, dtype=torch.int32)
    _moe_align_kernel[(1,)](ids.contiguous(), sorted_ids, tile_expert, T, sorted_ids.numel(),
                        max_tiles, K=k, E=num_experts, EP=next_pow2(num_experts), BLOCK_T=16,
                        BLOCK_M=block_m, FILL=1024, num_warps=8)
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
              prequant: bool = True) -> Tensor:
    """Routed experts (+ the shared one) of ``x [T, D]`` -> ``[T, D]`` in ``x.dtype``, on Triton
    (the kernels of the module doc); experts as :func:`hisparse.ops.moe.fused_moe` takes them.
    ``prequant`` (FP8): quantize ``x`` and the intermediate once each instead of in every GEMM
    tile (the grouped GEMMs' programs of one tile each redo it ``I / 64`` resp. ``D / 128``
    times)."""
    from ._moe_triton import grouped_moe

    T = x.shape[0]
    E = gate_up.shape[0]
    n_shared = int(shared is not None)
    ids, w = route(x, router_weight, router_bias, cfg, n_shared, use_triton=True)
    # one tile height for every batch size: a row's GEMM (and so its bits) must not depend on
    # T (moe_block_m grows with tokens per expert; 16 is what it picks for 256 experts here)
    block_m = FUSED_BLOCK_M
    sorted_ids, tile_expert = align(ids, E + n_shared, block_m, use_triton=True)
    y = grouped_moe(x, sorted_ids, tile_expert, block_m, w, gate_up, down, gate_up_scale,
                    down_scale, block, pow2_scale, shared=shared,
                    quantize=quantize_act if prequant else None, skip_empty=True)
    return combine(y, T, x.dtype, use_triton=True)
