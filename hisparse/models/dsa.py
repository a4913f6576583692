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
- ``score(t,s) = sum_h w[t,h] * relu(q[t,h].k[s])`` with ``w = weights_proj(x) * Hi**-0.5 * Di**-0.5``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import DSAConfig
from .context import SparseAttentionContext

# Parameters kept in float32 whatever the model dtype (as transformers does).
FP32_PARAM_SUFFIXES = ("indexer.weights_proj.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias")

_ACT = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(x[2i], x[2i+1])``; output laid out ``[rotated evens | rotated odds]``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(x[i], x[i + d/2])`` (non-interleaved, "rotate_half" convention)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


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
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)  # fp32
        self.rope = rope_interleaved if cfg.indexer_rope_interleaved else rope_half
        # relu(q.k * Di^-0.5) = Di^-0.5 * relu(q.k): both scales fold into the per-head weights.
        self.weight_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5

    def forward(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        T, r = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(T, self.n_heads, self.head_dim)
        q = torch.cat([self.rope(q[..., :r], cos[:, None], sin[:, None]), q[..., r:]], dim=-1)
        k = self.k_norm(self.wk(x))
        k = torch.cat([self.rope(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.weight_scale
        return q, w, k


class DSAAttention(nn.Module):
    def __init__(self, cfg: DSAConfig, layer_idx: int):
        super().__init__()
        if cfg.q_lora_rank is None:
            raise ValueError("q_lora_rank must be set: the DSA indexer reads the q_lora latent "
                             "(transformers' DSA models have no q_lora_rank=None path either)")
        self.layer_idx = layer_idx
        self.num_heads = H = cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = R = cfg.kv_lora_rank
        self.sm_scale = cfg.softmax_scale
        bias = cfg.attention_bias
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)          # eps 1e-6, as in transformers
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, R + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(R)
        # kv_b_proj.weight.view(H, nope + v, R) split: k_nope = w_uk @ c, v = w_uv @ c.
        self.w_uk = nn.Parameter(torch.empty(H, self.nope, R))
        self.w_uv = nn.Parameter(torch.empty(H, self.v_dim, R))
        self.o_proj = nn.Linear(H * self.v_dim, cfg.hidden_size, bias=bias)
        self.indexer = DSAIndexer(cfg) if cfg.layer_has_indexer(layer_idx) else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: SparseAttentionContext) -> Tensor:
        T, H = x.shape[0], self.num_heads
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(T, H, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope:]
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])
        k_pe = rope_interleaved(kv[:, self.kv_lora_rank:], cos, sin)
        q_pe = rope_interleaved(q_pe, cos[:, None], sin[:, None])

        kv_new = torch.cat([c_kv, k_pe], dim=-1)                                    # [T, R + rope]
        q_abs = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)                     # [T, H, R]
        q_latent = torch.cat([q_abs, q_pe], dim=-1)                                 # [T, H, R + rope]
        if self.indexer is not None:
            index_q, index_w, index_k = self.indexer(x, q_resid, cos, sin)
        else:
            index_q = index_w = index_k = None
        out = ctx.attend(self.layer_idx, q_latent, kv_new, index_q, index_w, index_k, self.sm_scale)
        v = torch.einsum("thr,hvr->thv", out, self.w_uv)                            # [T, H, v]
        return self.o_proj(v.reshape(T, H * self.v_dim))


class DSAMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = _ACT[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DSARouter(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k, weights from the uncorrected scores."""

    def __init__(self, cfg: DSAConfig):
        super().__init__()
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size))                 # fp32
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E), requires_grad=False)  # fp32
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        T, E, G = x.shape[0], self.weight.shape[0], self.n_group
        scores = F.linear(x.float(), self.weight.float()).sigmoid()                 # [T, E]
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
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))                  # [gate; up]
        self.down_proj = nn.Parameter(torch.empty(E, D, I))
        self.act = _ACT[cfg.hidden_act]

    def forward(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e]) * w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class DSAMoE(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.gate = DSARouter(cfg)
        self.experts = DSAExperts(cfg)
        self.shared_experts = (DSAMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                      cfg.hidden_act) if cfg.n_shared_experts > 0 else None)

    def forward(self, x: Tensor) -> Tensor:
        idx, w = self.gate(x)
        y = self.experts(x, idx, w)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class DSADecoderLayer(nn.Module):
    def __init__(self, cfg: DSAConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSAAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (DSAMoE(cfg) if cfg.mlp_layer_types[layer_idx] == "sparse"
                    else DSAMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act))

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, ctx: SparseAttentionContext) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DSAModel(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DSADecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DSAForCausalLM(nn.Module):
    """DSA causal LM. ``forward`` returns final-normed hidden states of all tokens; logits are
    computed separately (usually only for the last token of each sequence)."""

    def __init__(self, config: DSAConfig, dtype: torch.dtype | None = None, init_std: float = 0.02):
        super().__init__()
        self.config = config
        self.model = DSAModel(config)
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
        """The forward has no host synchronisation (the MoE's expert dispatch has one)."""
        return "sparse" not in self.config.mlp_layer_types

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random init (benchmarks without a checkpoint); norms to 1, biases to 0."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)

    def cast(self, dtype: torch.dtype) -> "DSAForCausalLM":
        """Cast to ``dtype``, keeping the router and indexer head weights in float32."""
        for name, p in self.named_parameters():
            want = torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype
            if p.dtype != want:
                p.data = p.data.to(want)
        return self

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: SparseAttentionContext) -> Tensor:
        """``input_ids``/``positions``: ``[T]`` int64 (flat batch). Returns ``[T, hidden]``."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must be 1-D of the same length, got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, ctx)
        return self.model.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32."""
        return self.lm_head(hidden).float()
