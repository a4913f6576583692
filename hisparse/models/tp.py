"""Tensor-parallel sharding of a loaded :class:`~hisparse.models.dsa.DSAForCausalLM`.

One rank of TP-N keeps (as vLLM / SGLang shard DeepSeek-V3.2; the same split as
``random_checkpoint.make_hf_config(tp_rank_of=N)``):

- attention heads ``[r*H/N, (r+1)*H/N)``: rows of ``q_b_proj``, the absorbed ``w_uk`` / ``w_uv``,
  the matching input columns of ``o_proj`` (its bias on rank 0 only), then an **all-reduce**;
- dense MLP: rows of ``gate_proj`` / ``up_proj``, columns of ``down_proj``, then an all-reduce;
- MoE: every routed expert and the shared experts keep a ``1/N`` slice of their intermediate dim
  (rows of ``gate_up_proj``'s gate and up halves, columns of ``down_proj``); routed + shared are
  summed locally and **all-reduced once**. Experts are **TP-split, not expert-parallel**: every
  rank runs the same router over the same tokens and the same kernels on the same shapes, so
  every rank's step is identical (one StepPlan, no all-to-all, no load imbalance across ranks);
  EP would save weight bandwidth per token at large batch but needs token dispatch.

Replicated on every rank: ``q_a_proj``, ``kv_a_proj_with_mqa`` (so the MLA latent row written to
the KV cache is whole and identical on every rank), the **indexer** (``wq_b``, ``wk``,
``weights_proj``: all ``index_n_heads`` heads, so every rank selects the same top-k), norms,
router, embeddings and ``lm_head`` (logits are computed whole; only rank 0 samples).
"""

from __future__ import annotations

import torch
from torch import nn

from .dsa import DSAMLP, DSAForCausalLM, DSAMoE
from .linear import FP8Linear


def check_tp_divisible(cfg, world: int) -> None:
    """ValueError naming the config field that ``world`` does not divide (or FP8 weights)."""
    if cfg.fp8_block is not None and world > 1:
        raise ValueError("tensor_parallel_size > 1 does not support FP8 checkpoints yet "
                         "(block scales are not sliced); use a bf16 checkpoint")
    for name in ("num_heads", "intermediate_size", "moe_intermediate_size"):
        v = getattr(cfg, name, None)
        if v and v % world:
            raise ValueError(f"tensor_parallel_size ({world}) must divide {name} ({v})")


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


def _rows(lin: nn.Module, sl: slice, groups: int) -> None:
    """Keep output rows ``sl`` of each of ``groups`` equal row blocks (heads) of ``lin``."""
    w = lin.weight.data
    out, inp = w.shape
    w = w.view(groups, out // groups, inp)[sl].reshape(-1, inp)
    lin.weight = _param(w)
    lin.out_features = w.shape[0]
    if getattr(lin, "bias", None) is not None:
        lin.bias = _param(lin.bias.data.view(groups, -1)[sl].reshape(-1))


def _cols(lin: nn.Module, sl: slice, groups: int, keep_bias: bool) -> None:
    """Keep input columns ``sl`` of ``groups`` equal column blocks; bias on one rank only."""
    w = lin.weight.data
    out, inp = w.shape
    w = w.view(out, groups, inp // groups)[:, sl].reshape(out, -1)
    lin.weight = _param(w)
    lin.in_features = w.shape[1]
    if getattr(lin, "bias", None) is not None and not keep_bias:
        lin.bias.data.zero_()


def _shard_mlp(mlp: DSAMLP, rank: int, world: int) -> None:
    sl = slice(rank, rank + 1)
    _rows(mlp.gate_proj, sl, world)
    _rows(mlp.up_proj, sl, world)
    _cols(mlp.down_proj, sl, world, keep_bias=rank == 0)


@torch.no_grad()
def shard_model_(model: DSAForCausalLM, rank: int, world: int, group=None) -> DSAForCausalLM:
    """Shard ``model`` in place to rank ``rank`` of TP-``world`` (see the module doc); ``group``:
    the process group the all-reduces run over (None: set later with :func:`set_tp_group`)."""
    if world == 1:
        return model
    if model.stacks():
        raise ValueError("shard_model_: the model's projections are stacked already "
                         "(stack_projections_ comes after sharding)")
    check_tp_divisible(model.config, world)
    if any(isinstance(m, FP8Linear) for m in model.modules()):
        raise ValueError("tensor_parallel_size > 1 does not support FP8 checkpoints yet")
    for layer in model.model.layers:
        a = layer.self_attn
        H = a.num_heads
        h = H // world
        heads = slice(rank * h, (rank + 1) * h)
        _rows(a.q_b_proj, heads, H)
        a.w_uk = _param(a.w_uk.data[heads])
        a.w_uv = _param(a.w_uv.data[heads])
        _cols(a.o_proj, heads, H, keep_bias=rank == 0)
        a.num_heads = h
        mlp = layer.mlp
        if isinstance(mlp, DSAMoE):
            ex = mlp.experts
            E, two_i, D = ex.gate_up_proj.shape
            i = two_i // 2 // world
            gu = ex.gate_up_proj.data.view(E, 2, world, i, D)[:, :, rank].reshape(E, 2 * i, D)
            ex.gate_up_proj = _param(gu)
            ex.down_proj = _param(ex.down_proj.data.view(E, D, world, i)[:, :, rank])
            if mlp.shared_experts is not None:
                _shard_mlp(mlp.shared_experts, rank, world)
        else:
            _shard_mlp(mlp, rank, world)
    set_tp_group(model, group)
    return model


def set_tp_group(model: DSAForCausalLM, group) -> None:
    """Where the all-reduces after ``o_proj`` and after the (dense or MoE) MLP run."""
    for layer in model.model.layers:
        layer.self_attn.tp_group = group
        layer.mlp.tp_group = group     # a MoE's shared experts (a DSAMLP inside it) stay None
