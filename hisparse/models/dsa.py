"""DeepSeek-V3.2 / GLM-5 (DSA) causal LM over a flat token batch.

Per layer: RMSNorm -> MLA attention (absorbed form, sparse through the context) -> residual ->
RMSNorm -> dense MLP or MoE (sigmoid router with group-limited top-k and shared experts) ->
residual. Parameter names follow transformers' ``DeepseekV32ForCausalLM`` /
``GlmMoeDsaForCausalLM`` except ``kv_b_proj``, which is stored pre-split as the absorbed
``w_uk [H, qk_nope, kv_lora_rank]`` and ``w_uv [H, v_head, kv_lora_rank]``.

Math conventions reproduced from transformers (see docs in :mod:`hisparse.models.config`):

- MLA RoPE is *interleaved*: pairs ``(x0, x1), (x2, x3), ...`` rotate together, and the rotated
  vector is stored de-interleaved ``[even' | odd']`` (q_pe and k_pe alike, so dot products match).
- Indexer RoPE acts on the first ``qk_rope_head_dim`` dims of q/k (the rest pass through):
  half-split (non-interleaved) for DeepSeek-V3.2, interleaved for GLM.
- cos/sin carry the YaRN ``attention_factor``; the softmax scale carries ``mscale(all_dim)**2``.
- ``score(t,s) = sum_h w[t,h] * relu(q[t,h].k[s])`` with
  ``w = weights_proj(x) * Hi**-0.5 * Di**-0.5``.

FP8 checkpoints (``config.fp8_block``): the linears DeepSeek stores in FP8 -- ``q_a_proj``,
``q_b_proj``, ``kv_a_proj_with_mqa``, ``o_proj``, the indexer's ``wq_b`` and ``wk``, dense and
shared-expert MLPs, routed experts -- are :class:`FP8Linear` / FP8 experts (float8_e4m3fn weight +
fp32 ``*_scale_inv`` per block), run through :func:`hisparse.ops.fp8_block_linear` and
:func:`hisparse.ops.fused_moe`. Embeddings, ``lm_head``, norms, the router, the indexer's
``weights_proj`` stay in the model dtype (fp32 where noted), as in DeepSeek's checkpoints;
``kv_b_proj`` is dequantized once at load into the absorbed ``w_uk`` / ``w_uv`` (as vLLM does).

The MoE layer on CUDA is :func:`hisparse.ops.moe_layer.moe_layer` (router GEMM and routing
kernels, sort-free alignment, the shared expert as an extra expert of the Triton grouped GEMMs,
one combine kernel; no host sync: MoE models decode under CUDA graphs). With
``HISPARSE_FUSED_MOE=0`` (and on CPU) it runs unfused: the router in torch (fp32, as
transformers), the routed experts through :func:`hisparse.ops.fused_moe` (on CUDA a device-side
sort plus the grouped GEMMs; on CPU the reference loop over the experts hit), the shared expert
as its own MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import glue, switches
from ..ops._common import want_triton
from ..ops.block_fp8 import FP8Rows
from ..ops.gemm import FP8_DTYPE, cdiv, fp32_linear
from ..ops.moe import fused_moe, fused_moe_graph_safe
from ..ops.moe_layer import (
    MOE_LAYER_MAX_TOKENS,
    RoutingConfig,
    SharedExpert,
    fused_moe_layer_enabled,
    moe_layer,
)
from ..ops.pending import PendingSum, fuses_sums
from .config import DSAConfig
from .context import IndexerQueries, NewKeys, NewQuery, NewRows, SparseAttentionContext
from .linear import FP8Linear, StackedLinears, apply_linear, fp8_input_format, make_linear

# Parameters loaded in float32 whatever the model dtype (as transformers keeps them); the
# bf16-valued ones below may be stored in bf16 again once the weights are final
FP32_PARAM_SUFFIXES = ("indexer.weights_proj.weight", "mlp.gate.weight",
                       "mlp.gate.e_score_correction_bias")
# Those of them DeepSeek's checkpoints store in bf16 (vLLM and SGLang load both in the model
# dtype): DSAForCausalLM.narrow_fp32_weights_ stores them so again when every value is bf16
BF16_VALUED_FP32_WEIGHTS = ("indexer.weights_proj.weight", "mlp.gate.weight")

_ACT = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def tp_all_reduce(x: Tensor, group) -> Tensor:
    """Sum ``x`` over the ranks of a tensor-parallel ``group`` (in place); identity when
    ``group`` is None (TP=1). Set by :func:`hisparse.models.tp.shard_model_`."""
    if group is None:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=group)
    return x


def project_out(lin: nn.Module, x: Tensor, group, pending: bool) -> Tensor | PendingSum:
    """``lin(x)`` all-reduced over ``group`` (:func:`tp_all_reduce`); with ``pending`` (the
    caller's next op is the fused norm) and no all-reduce between, an FP8 linear's split-K
    partial sums unreduced (:meth:`FP8Linear.forward_pending`: the norm adds them)."""
    if pending and group is None and isinstance(lin, FP8Linear):
        return lin.forward_pending(x)
    return tp_all_reduce(lin(x), group)


class RMSNorm(nn.Module):
    """transformers' RMSNorm (:func:`hisparse.ops.glue.rms_norm_reference`), one fused kernel
    on CUDA; :meth:`add` fuses the residual add in front of it."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y, _ = glue.add_rms_norm(x.reshape(-1, x.shape[-1]), None, self.weight, self.eps)
        return y.view(*lead, y.shape[-1])

    def add(self, x: Tensor | PendingSum, residual: Tensor | None, fp32_copy: bool = False,
            fp8_rows: tuple[int, bool] | None = None) -> tuple[Tensor | FP8Rows | None, ...]:
        """``h = x + residual`` (``x`` when None) -> ``(rms_norm(h), h)``; ``[T, D]``; with
        ``fp32_copy`` also ``rms_norm(h).float()`` (same kernel); with ``fp8_rows = (block_k,
        pow2_scale)`` last the normed rows quantized for an FP8 linear (same kernel; None where
        the norm runs unfused). ``x`` may be a :class:`PendingSum` (its sum done by the norm's
        kernel, the same bits)."""
        return glue.add_rms_norm(x, residual, self.weight, self.eps, fp32_copy, fp8_rows)


class Rotary:
    """cos/sin tables ``[T, qk_rope_head_dim // 2]`` for given positions (not a module: its fp32
    inverse frequencies must survive a cast of the model to bf16)."""

    def __init__(self, cfg: DSAConfig):
        self.inv_freq = cfg.rope_inv_freq()
        self.scale = cfg.rope_attention_factor
        self._by_device: dict[torch.device, Tensor] = {}

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv = self._by_device.get(positions.device)
        if inv is None:
            inv = self._by_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)


class DSAIndexer(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = (cfg.index_n_heads, cfg.index_head_dim,
                                                      cfg.qk_rope_head_dim)
        self.wq_b = make_linear(cfg, cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = make_linear(cfg, cfg.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)  # fp32
        self.interleaved = cfg.indexer_rope_interleaved
        # relu(q.k * Di^-0.5) = Di^-0.5 * relu(q.k): both scales fold into the per-head weights.
        self.weight_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5

    def forward(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor,
                x32: Tensor | None = None, q_raw: Tensor | None = None,
                k_raw: Tensor | None = None
                ) -> tuple[Tensor | IndexerQueries, Tensor | None, NewKeys]:
        """``(q [T, Hi, Di] roped, w [T, Hi] fp32, the new keys)``; with the glue fused (CUDA,
        or forced Triton; not ``HISPARSE_FUSED_GLUE=0``) ``(IndexerQueries, None, the new
        keys)`` instead: the context runs their RoPE and weight scale, in the FP8 query kernel
        where it can (:func:`hisparse.ops.indexer.indexer_topk`), else as
        :meth:`IndexerQueries.materialize`, the two ops this ran before. ``weights_proj`` runs
        in fp32 products and sums as transformers' reference keeps it
        (``_keep_in_fp32_modules``): an fp32 weight on ``x32`` (``x.float()``, made by the norm
        kernel) when given, a bf16 one (:meth:`DSAForCausalLM.narrow_fp32_weights_`) on the
        bf16 ``x``; with the glue fused as :func:`hisparse.ops.fp32_linear` (batch invariant;
        its partials pending with the fused sums, for the query kernel to add). ``q_raw`` /
        ``k_raw``: ``wq_b``'s / ``wk``'s outputs when the attention computed them in its
        stacked GEMMs."""
        T = x.shape[0]
        q_raw = self.wq_b(q_resid) if q_raw is None else q_raw
        k = NewKeys(self.wk(x) if k_raw is None else k_raw, self.k_norm.weight,
                    self.k_norm.bias, self.k_norm.eps, cos, sin, self.rope_dim, self.interleaved)
        wp = self.weights_proj.weight
        # the operands in one dtype, never narrower than either: x itself where wp has its
        # dtype (both bf16: a narrowed wp; both fp32), else both in fp32
        if wp.dtype == x.dtype:
            xw = x
        else:
            xw, wp = (x32 if x32 is not None else x.float()), wp.float()
        if glue.fused(xw):
            # batch invariant fp32 (cuBLAS picks its sgemm by shape), and with the fused sums
            # its K-split partials are added by the FP8 query kernel: no reduction launch
            w = fp32_linear(xw, wp, pending=fuses_sums(xw))
        else:
            w = F.linear(xw.float(), wp.float())
        q = IndexerQueries(q_raw.view(T, self.n_heads, self.head_dim), cos, sin, self.rope_dim,
                           self.interleaved, w, self.weight_scale)
        if glue.fused(q.q):
            return q, None, k
        return (*q.materialize(), k)


class DSAAttention(nn.Module):
    def __init__(self, cfg: DSAConfig, layer_idx: int):
        super().__init__()
        if cfg.q_lora_rank is None:
            raise ValueError("q_lora_rank must be set: the DSA indexer reads the q_lora latent "
                             "(transformers' DSA models have no q_lora_rank=None path either)")
        self.layer_idx = layer_idx
        self.num_heads = H = cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                cfg.v_head_dim)
        self.kv_lora_rank = R = cfg.kv_lora_rank
        self.sm_scale = cfg.softmax_scale
        bias = cfg.attention_bias
        self.q_a_proj = make_linear(cfg, cfg.hidden_size, cfg.q_lora_rank, bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)          # eps 1e-6, as in transformers
        self.q_b_proj = make_linear(cfg, cfg.q_lora_rank, H * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = make_linear(cfg, cfg.hidden_size, R + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(R)
        # kv_b_proj.weight.view(H, nope + v, R) split: k_nope = w_uk @ c, v = w_uv @ c.
        self.w_uk = nn.Parameter(torch.empty(H, self.nope, R))
        self.w_uv = nn.Parameter(torch.empty(H, self.v_dim, R))
        self.o_proj = make_linear(cfg, H * self.v_dim, cfg.hidden_size, bias)
        self.indexer = DSAIndexer(cfg) if cfg.layer_has_indexer(layer_idx) else None
        self.tp_group = None     # tensor parallelism: all-reduce after o_proj
        # set by stack_projections_(): [q_a | wk | kv_a] on x, [q_b | wq_b] on the q_a latent
        self.proj_x: StackedLinears | None = None
        self.proj_q: StackedLinears | None = None

    def stack_projections_(self) -> bool:
        """Run the linears that share an input as one GEMM each (:class:`StackedLinears`):
        ``q_a_proj``, the indexer's ``wk`` and ``kv_a_proj_with_mqa`` (last: its 576 rows end
        mid scale block) on the layer input; ``q_b_proj`` and the indexer's ``wq_b`` on the
        ``q_a`` latent. Call once the weights are final. Returns whether anything was stacked
        (linears of different kinds, biases or blocks stay apart)."""
        ix = self.indexer
        on_x = [self.q_a_proj] + ([ix.wk] if ix is not None else []) + [self.kv_a_proj_with_mqa]
        if self.proj_x is None and StackedLinears.can_stack(on_x):
            self.proj_x = StackedLinears(on_x)
        if ix is not None and self.proj_q is None and StackedLinears.can_stack(
                [self.q_b_proj, ix.wq_b]):
            self.proj_q = StackedLinears([self.q_b_proj, ix.wq_b])
        return bool(self.stacks())

    def stacks(self) -> list[StackedLinears]:
        return [st for st in (self.proj_x, self.proj_q) if st is not None]

    def input_format(self, rows: int, device: torch.device) -> tuple[int, bool] | None:
        """``(block_k, pow2_scale)`` when the projections of the layer input read it as
        :class:`FP8Rows` (:func:`fp8_input_format`): for the input norm to make them."""
        first = self.proj_x if self.proj_x is not None else self.q_a_proj
        return fp8_input_format(first, rows, device)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: SparseAttentionContext,
                x32: Tensor | None = None, pending: bool = False,
                x_fp8: FP8Rows | None = None) -> Tensor | PendingSum:
        """``x32``: ``x.float()`` when the caller has it (the indexer's fp32 weights).
        ``pending``: the output may be ``o_proj``'s :class:`PendingSum` (:meth:`out_proj`).
        ``x_fp8``: ``x`` quantized in :meth:`input_format` by the norm that wrote it."""
        T, H = x.shape[0], self.num_heads
        k_raw = q_raw = None        # the indexer's wk / wq_b outputs, when stacked here
        if self.proj_x is not None:
            q_a, *k_raw, kv = self.proj_x(x, x_fp8)
            k_raw = k_raw[0] if k_raw else None
        else:
            q_a, kv = (apply_linear(self.q_a_proj, x, x_fp8),
                       apply_linear(self.kv_a_proj_with_mqa, x, x_fp8))
        # the q_a norm quantizes its output for the q projections in the same kernel
        on_q = self.proj_q if self.proj_q is not None else self.q_b_proj
        q_format = fp8_input_format(on_q, T, x.device)
        q_resid, _, *q_fp8 = self.q_a_layernorm.add(q_a, None, fp8_rows=q_format)
        q_fp8 = q_fp8[0] if q_fp8 else None
        if self.proj_q is not None:
            q, q_raw = self.proj_q(q_resid, q_fp8)
        else:
            q = apply_linear(self.q_b_proj, q_resid, q_fp8)
        q = q.view(T, H, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope:]
        norm = self.kv_a_layernorm
        # the rows [kv_a_layernorm(c_kv) | roped k_pe], written by the context in one kernel
        kv_new = NewRows(kv, norm.weight, norm.eps, cos, sin, self.kv_lora_rank)
        q_abs = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)                     # [T, H, R]
        # [q_abs | roped q_pe] [T, H, R + rope], made by the context in the rows' launch
        q_latent = NewQuery(q_abs, q_pe, cos, sin)
        if self.indexer is not None:
            index_q, index_w, index_k = self.indexer(x, q_resid, cos, sin, x32, q_raw, k_raw)
        else:
            index_q = index_w = index_k = None
        out = ctx.attend(self.layer_idx, q_latent, kv_new, index_q, index_w, index_k, self.sm_scale)
        v = torch.einsum("thr,hvr->thv", out, self.w_uv)                            # [T, H, v]
        if not self._o_proj_reads_heads():
            v = v.reshape(T, H * self.v_dim)        # heads strided (the bmm's [H, T, v]): a copy
        return self.out_proj(v, pending)

    def _o_proj_reads_heads(self) -> bool:
        """Whether ``o_proj`` takes the per-head output ``[T, H, v_head]`` as it lies (an FP8
        linear whose split-K kernel loads each head's block in place, no flattening copy:
        :func:`hisparse.ops.fp8_block_linear`), unless ``HISPARSE_FUSED_GLUE=0``."""
        return (isinstance(self.o_proj, FP8Linear) and self.num_heads > 1
                and switches.current().fused_glue)

    def out_proj(self, v: Tensor, pending: bool = False) -> Tensor | PendingSum:
        """``o_proj`` of the heads' values ``[T, H * v_head]`` (or ``[T, H, v_head]``, heads
        strided, when :meth:`_o_proj_reads_heads`), all-reduced under tensor
        parallelism. ``pending`` (the caller's next op is the fused norm): without an
        all-reduce between, an FP8 split-K ``o_proj``'s partial sums are returned unreduced
        (:class:`PendingSum`: the norm adds them, one launch fewer)."""
        return project_out(self.o_proj, v, self.tp_group, pending)


class DSAMLP(nn.Module):
    def __init__(self, cfg: DSAConfig, inter: int):
        super().__init__()
        hidden = cfg.hidden_size
        self.gate_proj = make_linear(cfg, hidden, inter)
        self.up_proj = make_linear(cfg, hidden, inter)
        self.down_proj = make_linear(cfg, inter, hidden)
        self.act = _ACT[cfg.hidden_act]
        self.tp_group = None     # tensor parallelism (dense layers): all-reduce after down_proj
        self.gate_up: StackedLinears | None = None    # stack_projections_()

    def stack_projections_(self) -> bool:
        """``gate_proj`` and ``up_proj`` as one GEMM (:class:`StackedLinears`); call once the
        weights are final. Returns whether they were stacked."""
        if self.gate_up is None and StackedLinears.can_stack([self.gate_proj, self.up_proj]):
            self.gate_up = StackedLinears([self.gate_proj, self.up_proj])
        return bool(self.stacks())

    def stacks(self) -> list[StackedLinears]:
        return [] if self.gate_up is None else [self.gate_up]

    def forward(self, x: Tensor, pending: bool = False) -> Tensor | PendingSum:
        """``pending``: the output may be ``down_proj``'s :class:`PendingSum` (no all-reduce,
        FP8 split-K), for the next fused norm."""
        if self.gate_up is not None:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return project_out(self.down_proj, self.act(gate) * up, self.tp_group, pending)


class DSARouter(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k, weights from the uncorrected scores."""

    def __init__(self, cfg: DSAConfig):
        super().__init__()
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size))                 # fp32
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E), requires_grad=False)  # fp32
        self.top_k, self.n_group, self.topk_group = (cfg.num_experts_per_tok, cfg.n_group,
                                                     cfg.topk_group)
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.routing = RoutingConfig(self.top_k, self.n_group, self.topk_group,
                                     bool(self.norm_topk_prob), float(self.scaling))

    def forward(self, x: Tensor, x32: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Computed in fp32 as transformers' reference (``_keep_in_fp32_modules_strict``:
        ``gate.weight``), on ``x32`` (``x.float()``) when given."""
        T, E, G = x.shape[0], self.weight.shape[0], self.n_group
        x32 = x.float() if x32 is None else x32
        scores = F.linear(x32, self.weight.float()).sigmoid()                       # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)    # [T, G]
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand(T, G, E // G).reshape(T, E)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False).indices                 # [T, k]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling


class DSAExperts(nn.Module):
    """Routed experts, fused: ``gate_up_proj [E, 2I, D]`` (rows ``[gate; up]``) and ``down_proj
    [E, D, I]``; FP8 checkpoints add ``gate_up_proj_scale_inv [E, 2*ceil(I/bn), ceil(D/bk)]``
    (gate blocks then up blocks) and ``down_proj_scale_inv [E, ceil(D/bn), ceil(I/bk)]``."""

    def __init__(self, cfg: DSAConfig):
        super().__init__()
        E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.block = cfg.fp8_block
        self.pow2_scale = cfg.fp8_pow2_act_scale
        self.act_name = cfg.hidden_act
        if self.block is None:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
            self.down_proj = nn.Parameter(torch.empty(E, D, I))
            self.gate_up_proj_scale_inv = self.down_proj_scale_inv = None
        else:
            bn, bk = self.block
            fp8 = dict(dtype=FP8_DTYPE)
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D, **fp8), requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(E, D, I, **fp8), requires_grad=False)
            self.gate_up_proj_scale_inv = nn.Parameter(
                torch.ones(E, 2 * cdiv(I, bn), cdiv(D, bk)), requires_grad=False)
            self.down_proj_scale_inv = nn.Parameter(
                torch.ones(E, cdiv(D, bn), cdiv(I, bk)), requires_grad=False)

    def forward(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        return fused_moe(x, idx, w, self.gate_up_proj, self.down_proj, self.act_name,
                         gate_up_scale=self.gate_up_proj_scale_inv,
                         down_scale=self.down_proj_scale_inv, block=self.block,
                         pow2_scale=self.pow2_scale)


class DSAMoE(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.gate = DSARouter(cfg)
        self.experts = DSAExperts(cfg)
        self.shared_experts = (DSAMLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts > 0 else None)
        self.tp_group = None     # tensor parallelism: one all-reduce of routed + shared

    def fused(self, x: Tensor) -> bool:
        """Whether :meth:`forward` runs the fused layer (:func:`hisparse.ops.moe_layer.
        moe_layer`: Triton, SiLU experts, 1 to ``MOE_LAYER_MAX_TOKENS`` tokens, unless
        ``HISPARSE_FUSED_MOE=0``); it reads ``x`` itself, not an fp32 copy."""
        return (fused_moe_layer_enabled() and self.experts.act_name == "silu"
                and want_triton(x) and 0 < x.shape[0] <= MOE_LAYER_MAX_TOKENS)

    def _fusable_shared(self) -> SharedExpert | None:
        """The shared expert as the grouped GEMMs' extra expert, when it has the routed
        experts' form (one expert's intermediate size, no biases, same dtype and layout)."""
        m, ex = self.shared_experts, self.experts
        if m is None or m.act is not F.silu:
            return None
        lins = (m.gate_proj, m.up_proj, m.down_proj)
        if any(getattr(lin, "bias", None) is not None for lin in lins):
            return None
        fp8 = ex.block is not None
        if fp8 and not all(isinstance(lin, FP8Linear) and lin.block == ex.block for lin in lins):
            return None
        sh = SharedExpert(*(lin.weight for lin in lins),
                          *((lin.weight_scale_inv for lin in lins) if fp8 else ()))
        try:
            sh.check(ex.gate_up_proj, ex.down_proj, ex.gate_up_proj_scale_inv,
                     ex.down_proj_scale_inv)
        except ValueError:
            return None
        return sh

    def forward(self, x: Tensor, x32: Tensor | None = None, pending: bool = False
                ) -> Tensor | PendingSum:
        """``pending`` (the caller's next op is the fused norm): the fused layer's combine may
        come back as a :class:`PendingSum` (no all-reduce, the shared expert inside it)."""
        if self.fused(x):
            ex = self.experts
            shared = self._fusable_shared()
            defer = pending and self.tp_group is None and (shared is not None
                                                           or self.shared_experts is None)
            y = moe_layer(x, self.gate.weight, self.gate.e_score_correction_bias,
                          self.gate.routing, ex.gate_up_proj, ex.down_proj,
                          gate_up_scale=ex.gate_up_proj_scale_inv,
                          down_scale=ex.down_proj_scale_inv, block=ex.block,
                          pow2_scale=ex.pow2_scale, shared=shared, pending=defer)
            if defer:
                return y
            if shared is None and self.shared_experts is not None:
                y = y + self.shared_experts(x)
            return tp_all_reduce(y, self.tp_group)
        idx, w = self.gate(x, x32)
        y = self.experts(x, idx, w)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return tp_all_reduce(y, self.tp_group)


class DSADecoderLayer(nn.Module):
    def __init__(self, cfg: DSAConfig, layer_idx: int, mlp_type: str | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSAAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        mlp_type = mlp_type or cfg.mlp_layer_types[layer_idx]
        self.mlp = (DSAMoE(cfg) if mlp_type == "sparse"
                    else DSAMLP(cfg, cfg.intermediate_size))
        # the fp32 copy of the normed input the MoE's unfused fp32 router reads
        self.mlp_fp32 = mlp_type == "sparse"

    @property
    def attn_fp32(self) -> bool:
        """The input norm also writes an fp32 copy: for an indexer whose ``weights_proj`` is
        fp32 in a model computed in another dtype (none once narrowed to bf16,
        :meth:`DSAForCausalLM.narrow_fp32_weights_`, nor in an fp32 model)."""
        ix = self.self_attn.indexer
        return (ix is not None
                and ix.weights_proj.weight.dtype != self.input_layernorm.weight.dtype)

    def forward(self, h: Tensor | PendingSum, cos: Tensor, sin: Tensor,
                ctx: SparseAttentionContext, residual: Tensor | None = None,
                pending: bool = False) -> tuple[Tensor | PendingSum, Tensor]:
        """Returns ``(out, residual)``: the layer's output hidden is ``out + residual`` (the
        next norm adds them, fused). The input hidden is ``h + residual`` (``h`` alone when
        ``residual`` is None). ``pending``: the caller feeds ``out`` to an :meth:`RMSNorm.add`
        (the next layer's, the final norm), so ``out`` may be a :class:`PendingSum` (the MoE
        combine or the dense ``down_proj``'s split-K partials, summed by that norm); ``h`` may
        be one (the previous layer's). Inside the layer ``o_proj``'s partials go to the
        post-attention norm the same way. Both when :func:`fuses_sums` (bit-neutral)."""
        x_format = self.self_attn.input_format(h.shape[0], h.device)
        fp32 = self.attn_fp32
        x, residual, *extra = self.input_layernorm.add(h, residual, fp32, x_format)
        x32 = extra[:1] if fp32 else []
        x_fp8 = extra[-1] if x_format is not None else None
        fuse = fuses_sums(x)
        a = self.self_attn(x, cos, sin, ctx, *x32, pending=fuse, x_fp8=x_fp8)
        fp32 = self.mlp_fp32 and not self.mlp.fused(x)   # x: `a` may be a PendingSum
        x, residual, *x32 = self.post_attention_layernorm.add(a, residual, fp32)
        return self.mlp(x, *x32, pending=pending and fuse), residual


class DSAMTPLayer(nn.Module):
    """DeepSeek-V3's multi-token-prediction module (checkpoint ``model.layers.{L + i}.*`` with
    ``L = num_hidden_layers``): ``h = eh_proj([enorm(embed(t_{q+1})) | hnorm(hidden_q)])``, one
    full DSA decoder layer (attention index ``L + i``, its own indexer and KV cache layer), then
    ``shared_head.norm``; the logits use the main model's ``lm_head`` and embedding (DeepSeek
    stores copies of both in the MTP layer: ``embed_tokens`` / ``shared_head.head``, equal to
    the main ones; the loader checks nothing about them and uses the main tensors)."""

    def __init__(self, cfg: DSAConfig, layer_idx: int):
        super().__init__()
        H = cfg.hidden_size
        self.layer_idx = layer_idx
        self.enorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = DSADecoderLayer(cfg, layer_idx, mlp_type=cfg.mlp_layer_types[-1])
        self.shared_head_norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor,
                ctx: SparseAttentionContext) -> Tensor:
        """``embeds``: embeddings of the *next* tokens ``[T, H]``; ``hidden``: the previous
        hidden states ``[T, H]`` (main model's final-normed output, or this layer's output for
        a chained draft). Returns the pre-head hidden ``[T, H]`` (before ``shared_head.norm``)."""
        x = torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1)
        out, residual = self.layer(self.eh_proj(x), cos, sin, ctx)
        return out + residual


class DSAModel(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DSADecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _fill_fp8_normal_(p: Tensor, scale: float, chunk_elems: int = 1 << 26) -> None:
    """``p`` (FP8) <- ``N(0, 1) * scale`` generated in bf16 one chunk of the leading dim at a
    time (transient memory ~``2 * chunk_elems`` bytes)."""
    flat = p.view(p.shape[0], -1) if p.dim() > 1 else p.view(-1, 1)
    rows = max(1, chunk_elems // max(1, flat.shape[1]))
    for i in range(0, flat.shape[0], rows):
        part = flat[i:i + rows]
        part.copy_((torch.randn(part.shape, device=p.device, dtype=torch.bfloat16) * scale)
                   .clamp_(-448.0, 448.0))


class DSAForCausalLM(nn.Module):
    """DSA causal LM. ``forward`` returns final-normed hidden states of all tokens; logits are
    computed separately (usually only for the last token of each sequence)."""

    def __init__(self, config: DSAConfig, dtype: torch.dtype | None = None, init_std: float = 0.02,
                 num_mtp_layers: int = 0):
        super().__init__()
        if not 0 <= num_mtp_layers <= config.num_nextn_predict_layers:
            raise ValueError(f"num_mtp_layers must be in [0, num_nextn_predict_layers="
                             f"{config.num_nextn_predict_layers}], got {num_mtp_layers}")
        self.config = config
        self.model = DSAModel(config)
        L = config.num_layers
        # MTP (next-n prediction) layers: drafts for speculative decoding (engine/spec.py)
        self.mtp = nn.ModuleList(DSAMTPLayer(config, L + i) for i in range(num_mtp_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights(init_std)
        self.cast(dtype or config.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def cuda_graph_safe(self) -> bool:
        """The forward has no host synchronisation on CUDA (the fused MoE sorts on device;
        only activations the fused kernels lack fall back to the syncing loop)."""
        return ("sparse" not in self.config.mlp_layer_types
                or fused_moe_graph_safe(self.config.hidden_act))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random init (benchmarks without a checkpoint); norms to 1, biases to 0. FP8 weights
        are drawn directly in FP8 (chunk by chunk: a production rank never holds them in bf16)
        as ``N(0, 1) * 32`` with every block scale ``std / 32``."""
        for name, p in self.named_parameters():
            if name.endswith("_scale_inv"):
                p.fill_(std / 32.0)
            elif p.dtype == FP8_DTYPE:
                _fill_fp8_normal_(p, 32.0)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif name.endswith(BF16_VALUED_FP32_WEIGHTS):  # bf16 values, as the checkpoints
                p.copy_(torch.randn_like(p).mul_(std).bfloat16())
            else:
                p.normal_(0.0, std)

    def cast(self, dtype: torch.dtype) -> DSAForCausalLM:
        """Cast to ``dtype``, keeping the router and indexer head weights in float32 and FP8
        weights with their fp32 scales as they are. Refused once projections are stacked
        (the stacks would keep the old dtype)."""
        if self.stacks():
            raise RuntimeError("cast: the model's projections are stacked already "
                               "(stack_projections_ comes after every cast)")
        for name, p in self.named_parameters():
            if p.dtype == FP8_DTYPE or name.endswith("_scale_inv"):
                continue
            want = torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype
            if p.dtype != want:
                p.data = p.data.to(want)
        return self

    def stack_projections_(self) -> int:
        """Stack the linears that share an input (:meth:`DSAAttention.stack_projections_`,
        :meth:`DSAMLP.stack_projections_`) in every layer, the MTP layers' included: fewer,
        larger GEMM launches at decode sizes. Call once the weights are final (after loading,
        sharding and casting; engine start-up does, before it sizes the KV cache, and so does
        the model runner); the parameters keep their names. Returns the number of modules
        that run stacked."""
        before = len(self.stacks())
        n = sum(m.stack_projections_() for m in self._stackable())
        if len(self.stacks()) > before and self.model.embed_tokens.weight.is_cuda:
            torch.cuda.empty_cache()   # the parts' former storage goes back to the device
        return n

    def narrow_fp32_weights_(self) -> int:
        """Store each of :data:`BF16_VALUED_FP32_WEIGHTS` (the MoE router gates, the indexer's
        ``weights_proj``: kept in fp32, loaded from bf16) in bf16 where every one of its values
        is a bf16 value and the model computes in bf16. Their GEMMs then multiply the bf16
        activations in one bf16 MMA pass instead of 3xTF32, with the same exact products and
        fp32 sums (:func:`hisparse.ops._gemm_splitk_triton.fp32_precision`), and the indexer
        needs no fp32 copy of its input. Call once the weights are final
        (:meth:`finalize_weights_`). Returns the number narrowed; a weight with any other
        value stays fp32."""
        if self.dtype != torch.bfloat16:
            return 0
        owners = [mod for name, mod in self.named_modules()
                  if (name + ".weight").endswith(BF16_VALUED_FP32_WEIGHTS)
                  and mod.weight.dtype == torch.float32]
        exact = [bool(torch.equal(m.weight, m.weight.bfloat16().float())) for m in owners]
        for m, ok in zip(owners, exact):
            if ok:
                m.weight = nn.Parameter(m.weight.detach().bfloat16(),
                                        requires_grad=m.weight.requires_grad)
        return sum(exact)

    def finalize_weights_(self) -> tuple[int, int]:
        """Once the weights are final (loaded, sharded, cast) and before the KV cache takes
        the memory or a graph is captured: :meth:`stack_projections_`, then
        :meth:`narrow_fp32_weights_`. Returns both counts."""
        stacked = self.stack_projections_()
        narrowed = self.narrow_fp32_weights_()
        if narrowed and self.model.embed_tokens.weight.is_cuda:
            torch.cuda.empty_cache()   # the fp32 copies' storage goes back to the device
        return stacked, narrowed

    def stacks(self) -> list[StackedLinears]:
        """The :class:`StackedLinears` the layers run (empty before :meth:`stack_projections_`)."""
        return [st for m in self._stackable() for st in m.stacks()]

    def _stackable(self) -> list[DSAAttention | DSAMLP]:
        return [m for m in self.modules() if isinstance(m, (DSAAttention, DSAMLP))]

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: SparseAttentionContext) -> Tensor:
        """``input_ids``/``positions``: ``[T]`` int64 (flat batch). Returns ``[T, hidden]``."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must be 1-D of the same length, got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, cos, sin, ctx, residual, pending=True)
        return self.model.norm.add(h, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32."""
        return self.lm_head(hidden).float()

    def mtp_forward(self, input_ids: Tensor, hidden: Tensor, positions: Tensor,
                    ctx: SparseAttentionContext, index: int = 0,
                    rope_positions: Tensor | None = None) -> Tensor:
        """MTP layer ``index`` over a flat batch: token ``t`` at ``positions[t]`` combines the
        previous hidden ``hidden[t]`` with the embedding of ``input_ids[t]`` (the token *after*
        position ``positions[t]``). ``rope_positions`` (default ``positions``): the RoPE
        positions, when the owner of ``ctx`` places the tokens elsewhere. Returns the layer's
        output hidden ``[T, H]`` (feed it back for a chained draft; :meth:`mtp_logits` for the
        draft logits)."""
        rp = positions if rope_positions is None else rope_positions
        cos, sin = self.rotary(rp, hidden.dtype)
        return self.mtp[index](self.model.embed_tokens(input_ids), hidden, cos, sin, ctx)

    def mtp_logits(self, mtp_hidden: Tensor, index: int = 0) -> Tensor:
        """Draft logits ``[n, vocab]`` float32 of MTP layer ``index``'s output hidden."""
        return self.lm_head(self.mtp[index].shared_head_norm(mtp_hidden)).float()
