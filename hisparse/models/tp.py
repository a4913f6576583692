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

- the vocabulary, as vLLM's ``VocabParallelEmbedding`` / ``ParallelLMHead`` split it: rank ``r``
  keeps rows ``[r*Vr, (r+1)*Vr)`` of the embedding and of ``lm_head``, ``Vr = ceil(V/N)`` (the
  last shard zero-padded to ``Vr`` rows, so every rank holds the same shapes). The embedding
  reads zeros for ids outside its rows and is **all-reduced** (one rank contributes each row:
  the sum is that row, bit for bit); ``lm_head``'s ``[n, Vr]`` logits are **all-gathered** into
  ``[n, V]`` on every rank (every rank runs the head; rank 0 alone samples).

Replicated on every rank: ``q_a_proj``, ``kv_a_proj_with_mqa`` (so the MLA latent row written to
the KV cache is whole and identical on every rank), the **indexer** (``wq_b``, ``wk``,
``weights_proj``: all ``index_n_heads`` heads, so every rank selects the same top-k), norms and
the router.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dsa import DSAMLP, DSAForCausalLM, DSAMoE, tp_all_reduce
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


def vocab_shard_rows(vocab_size: int, world: int) -> int:
    """Rows of the embedding / ``lm_head`` one rank of TP-``world`` holds: ``ceil(V / world)``."""
    return -(-vocab_size // world)


def _vocab_rows(weight: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s ``[Vr, H]`` rows of a ``[V, H]`` table, zero-padded past ``V``."""
    rows = vocab_shard_rows(weight.shape[0], world)
    part = weight.new_zeros(rows, weight.shape[1])
    mine = weight[rank * rows:(rank + 1) * rows]
    part[:mine.shape[0]] = mine
    return part


class VocabShardEmbedding(nn.Module):
    """One rank's rows ``[start, start + Vr)`` of the token embedding. ``forward(ids [T])`` ->
    ``[T, H]``: the rows of the ids this rank holds, zeros for the others, summed over
    ``tp_group`` (the whole table's rows). Needs its group (RuntimeError). Ids are checked
    against the vocabulary upstream (the input processor): one past it would read zeros on
    every rank, not fail."""

    def __init__(self, weight: Tensor, start: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.tp_group = None

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp_group is None:
            raise RuntimeError("VocabShardEmbedding: the other ranks' rows are missing; "
                               "set_tp_group first")
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return tp_all_reduce(h.masked_fill_(outside[:, None], 0), self.tp_group)


class VocabShardHead(nn.Module):
    """One rank's rows of ``lm_head`` (:class:`VocabShardEmbedding`'s rows). ``forward(x [n,
    H])`` -> ``[n, vocab_size]`` in ``x``'s dtype: this rank's ``[n, Vr]`` logits all-gathered
    over ``tp_group`` in rank order, the padding rows dropped. Needs its group (RuntimeError)."""

    def __init__(self, weight: Tensor | nn.Parameter, vocab_size: int, world: int):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else \
            nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.world = vocab_size, world
        self.tp_group = None

    def forward(self, x: Tensor) -> Tensor:
        if self.tp_group is None:
            raise RuntimeError("VocabShardHead: the logits need the other ranks' rows; "
                               "set_tp_group first")
        import torch.distributed as dist

        local = F.linear(x, self.weight)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.tp_group)
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]


def _shard_vocab(model: DSAForCausalLM, rank: int, world: int) -> None:
    emb = model.model.embed_tokens
    vocab = emb.weight.shape[0]
    rows = vocab_shard_rows(vocab, world)
    model.model.embed_tokens = VocabShardEmbedding(_vocab_rows(emb.weight.data, rank, world),
                                                   rank * rows)
    if model.config.tie_word_embeddings:
        head_weight = model.model.embed_tokens.weight
    else:
        head_weight = _vocab_rows(model.lm_head.weight.data, rank, world)
    model.lm_head = VocabShardHead(head_weight, vocab, world)


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
    _shard_vocab(model, rank, world)
    set_tp_group(model, group)
    return model


def set_tp_group(model: DSAForCausalLM, group) -> None:
    """Where the all-reduces after ``o_proj``, after the (dense or MoE) MLP and of a sharded
    embedding run, and a sharded ``lm_head``'s all-gather."""
    for layer in model.model.layers:
        layer.self_attn.tp_group = group
        layer.mlp.tp_group = group     # a MoE's shared experts (a DSAMLP inside it) stay None
    for m in (model.model.embed_tokens, model.lm_head):
        if isinstance(m, (VocabShardEmbedding, VocabShardHead)):
            m.tp_group = group
