"""Model configuration for DSA models, parsed from a Hugging Face ``config.json`` dict.

Two architectures are supported; both are MLA + lightning indexer + DeepSeek-style MoE:

- ``DeepseekV32ForCausalLM`` (model_type ``deepseek_v32``): every layer runs its own indexer, whose
  RoPE is *non-interleaved* (half split).
- ``GlmMoeDsaForCausalLM`` (model_type ``glm_moe_dsa``): per-layer ``indexer_types``; a "shared"
  layer has no indexer weights and reuses the top-k of the closest previous "full" layer. Its
  indexer RoPE is *interleaved*, like the MLA RoPE.

The RoPE tables (inverse frequencies, cos/sin scaling, softmax-scale correction) follow the
conventions of transformers' implementation of these models so that our model reproduces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}

# Defaults of the two transformers config classes, used where config.json leaves a field out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        norm_topk_prob=True, hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False,
        attention_bias=False, index_topk=2048, index_head_dim=128, index_n_heads=64,
        first_k_dense_replace=3),
    "glm_moe_dsa": dict(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=78, num_attention_heads=64, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64,
        v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8,
        norm_topk_prob=True, hidden_act="silu", max_position_embeddings=202752, rms_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False,
        attention_bias=False, index_topk=2048, index_head_dim=128, index_n_heads=32,
        first_k_dense_replace=3),
}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


def parse_dtype(value: Any, field_name: str = "dtype") -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    key = str(value).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"{field_name} must be one of {sorted(set(_DTYPES))}, got {value!r}")
    return _DTYPES[key]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class DSAConfig:
    """Everything our DSA model needs, in our own field names."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # Lightning indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]          # per layer: "full" | "shared"
    indexer_rope_interleaved: bool          # GLM: True, DeepSeek-V3.2: False
    # MLP / MoE
    intermediate_size: int
    moe_intermediate_size: int
    mlp_layer_types: tuple[str, ...]        # per layer: "dense" | "sparse"
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    hidden_act: str
    # RoPE: the raw standardized parameters plus what transformers derives from them
    rope_theta: float
    rope_type: str
    rope_parameters: dict = field(hash=False, compare=False)
    rope_attention_factor: float = 1.0      # multiplies cos and sin (YaRN "attention_factor")
    softmax_scale: float = 0.0              # qk_head_dim**-0.5, times mscale**2 under YaRN
    # misc
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: torch.dtype = torch.bfloat16
    num_nextn_predict_layers: int = 0       # MTP layers in the checkpoint (loaded on request)
    quantization_config: dict | None = field(default=None, hash=False, compare=False)

    # ------------------------------------------------------------------ derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        """Width of one cached MLA row ``[c_kv | k_pe]`` (576 for the production models)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """``(bn, bk)`` when the checkpoint is FP8 block-quantized (``quantization_config``
        with ``quant_method: fp8``): the model then keeps its linear and expert weights in
        float8_e4m3fn with per-block scales; None for bf16/fp32 checkpoints."""
        q = self.quantization_config
        if not q or q.get("quant_method") != "fp8":
            return None
        bn, bk = q.get("weight_block_size") or (128, 128)
        return int(bn), int(bk)

    @property
    def fp8_pow2_act_scale(self) -> bool:
        """FP8 activation scales rounded up to powers of two (``scale_fmt: ue8m0``, as
        DeepSeek-V3.1 / V3.2 checkpoints declare)."""
        return self.fp8_block is not None and self.quantization_config.get("scale_fmt") == "ue8m0"

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def layer_has_indexer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` computes its own top-k (False: reuses the previous
        layer's)."""
        if self.num_layers <= layer_idx < self.num_layers + self.num_nextn_predict_layers:
            return True     # an MTP layer: a full DSA decoder layer with its own indexer
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be in [0, {self.num_layers}), got {layer_idx}")
        return self.indexer_types[layer_idx] == "full"

    def rope_inv_freq(self) -> torch.Tensor:
        """fp32 ``[qk_rope_head_dim // 2]`` inverse frequencies, computed as transformers does."""
        dim = self.qk_rope_head_dim
        base = self.rope_theta
        p = self.rope_parameters
        exps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32)
        pos_freqs = base ** (exps / dim)
        if self.rope_type == "default":
            return 1.0 / pos_freqs
        if self.rope_type == "linear":
            return (1.0 / pos_freqs) / float(p["factor"])
        # yarn
        factor = _yarn_factor(p, self.max_position_embeddings)
        orig_max = p["original_max_position_embeddings"]
        beta_fast = p.get("beta_fast") or 32
        beta_slow = p.get("beta_slow") or 1
        truncate = p.get("truncate", True)

        def correction_dim(num_rot: float) -> float:
            return (dim * math.log(orig_max / (num_rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        idx = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
        ramp = torch.clamp((idx - low) / (high - low), 0, 1)
        extrap = 1.0 - ramp
        inv_extra = 1.0 / pos_freqs
        inv_inter = 1.0 / (factor * pos_freqs)
        return inv_inter * (1 - extrap) + inv_extra * extrap

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf(cls, cfg: dict) -> DSAConfig:
        """Parse a transformers ``config.json`` dict (as saved by ``save_pretrained``)."""
        if not isinstance(cfg, dict):
            raise ValueError(f"config must be a dict (parsed config.json), "
                             f"got {type(cfg).__name__}")
        arch, model_type = _resolve_architecture(cfg)
        d = _merged_fields(cfg, model_type)
        n_layers = _pos_int(d, "num_hidden_layers")
        q_lora_rank = d.get("q_lora_rank")
        if q_lora_rank is not None:
            q_lora_rank = _pos_int(d, "q_lora_rank")
        rope_dim = _pos_int(d, "qk_rope_head_dim")
        if rope_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {rope_dim}")
        index_head_dim = _pos_int(d, "index_head_dim")
        if index_head_dim < rope_dim:
            raise ValueError(f"index_head_dim must be >= qk_rope_head_dim ({rope_dim}), "
                             f"got {index_head_dim}")
        indexer_types = _indexer_types(cfg, model_type, n_layers)
        mlp_layer_types, n_experts = _mlp_layer_types(d, n_layers)
        max_pos = _pos_int(d, "max_position_embeddings")
        rope, attention_factor, softmax_scale = _rope_scales(cfg, d, rope_dim, max_pos)
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "gelu", "relu"):
            raise ValueError(f"hidden_act must be one of ['gelu', 'relu', 'silu'], got {act!r}")
        dtype_val = cfg.get("dtype", cfg.get("torch_dtype")) or "bfloat16"
        return cls(
            architecture=arch, model_type=model_type,
            vocab_size=_pos_int(d, "vocab_size"), hidden_size=_pos_int(d, "hidden_size"),
            num_layers=n_layers, num_heads=_pos_int(d, "num_attention_heads"),
            q_lora_rank=q_lora_rank, kv_lora_rank=_pos_int(d, "kv_lora_rank"),
            qk_nope_head_dim=_pos_int(d, "qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim, v_head_dim=_pos_int(d, "v_head_dim"),
            index_n_heads=_pos_int(d, "index_n_heads"), index_head_dim=index_head_dim,
            index_topk=_pos_int(d, "index_topk"), indexer_types=tuple(indexer_types),
            indexer_rope_interleaved=(model_type == "glm_moe_dsa"),
            intermediate_size=_pos_int(d, "intermediate_size"),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            mlp_layer_types=tuple(mlp_layer_types), n_routed_experts=n_experts,
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            num_experts_per_tok=int(d["num_experts_per_tok"]), n_group=int(d["n_group"]),
            topk_group=int(d["topk_group"]), norm_topk_prob=bool(d["norm_topk_prob"]),
            routed_scaling_factor=float(d["routed_scaling_factor"]), hidden_act=act,
            rope_theta=float(rope["rope_theta"]), rope_type=rope["rope_type"],
            rope_parameters=rope, rope_attention_factor=float(attention_factor),
            softmax_scale=float(softmax_scale), rms_norm_eps=float(d["rms_norm_eps"]),
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos, eos_token_ids=_eos_ids(d),
            bos_token_id=d.get("bos_token_id"), pad_token_id=d.get("pad_token_id"),
            dtype=parse_dtype(dtype_val, "dtype"),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
            quantization_config=_quantization_config(cfg.get("quantization_config")),
        )


# ---------------------------------------------------------------------- from_hf sections
def _resolve_architecture(cfg: dict) -> tuple[str, str]:
    """``(architecture, model_type)`` from ``architectures`` (or ``model_type`` alone)."""
    archs = cfg.get("architectures")
    supported = sorted(SUPPORTED_ARCHITECTURES)
    if archs:
        if isinstance(archs, str):
            archs = [archs]
        known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not known:
            raise ValueError(f"architectures must contain one of {supported}, got {archs!r}")
        arch = known[0]
        model_type = SUPPORTED_ARCHITECTURES[arch]
        if cfg.get("model_type", model_type) != model_type:
            raise ValueError(f"model_type must be {model_type!r} for architecture {arch}, "
                             f"got {cfg.get('model_type')!r}")
        return arch, model_type
    model_type = cfg.get("model_type")
    if model_type not in _MODEL_TYPE_TO_ARCH:
        raise ValueError(f"architectures must contain one of {supported} "
                         f"(or model_type one of {sorted(_MODEL_TYPE_TO_ARCH)}), "
                         f"got architectures={archs!r} model_type={model_type!r}")
    return _MODEL_TYPE_TO_ARCH[model_type], model_type


def _merged_fields(cfg: dict, model_type: str) -> dict[str, Any]:
    """The architecture's defaults overlaid with config.json (expert-count aliases mapped)."""
    d = dict(_DEFAULTS[model_type])
    d.update({k: v for k, v in cfg.items()
              if v is not None or k in ("q_lora_rank", "pad_token_id")})
    if "num_local_experts" in cfg and "n_routed_experts" not in cfg:
        d["n_routed_experts"] = cfg["num_local_experts"]
    if cfg.get("num_experts") is not None:
        d["n_routed_experts"] = cfg["num_experts"]
    return d


def _quantization_config(q: Any) -> dict | None:
    """Validate an FP8 block ``quantization_config`` (other methods pass through unchanged:
    the loader dequantizes whatever carries a ``weight_scale_inv``)."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config must be a dict, got {q!r}")
    if q.get("quant_method") != "fp8":
        return q
    block = q.get("weight_block_size")
    if block is None:
        raise ValueError("quantization_config.weight_block_size is required for quant_method "
                         "'fp8' (per-tensor FP8 is not supported)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or any(not isinstance(b, int) or b < 16 or b & (b - 1) for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two powers of two "
                         f">= 16, got {block!r}")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme must be 'dynamic', "
                         f"got {q.get('activation_scheme')!r}")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt must be 'e4m3', got {fmt!r}")
    if q.get("scale_fmt") not in (None, "float", "ue8m0"):
        raise ValueError(f"quantization_config.scale_fmt must be 'float' or 'ue8m0', "
                         f"got {q.get('scale_fmt')!r}")
    return q


def _pos_int(d: dict, name: str) -> int:
    v = d.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


def _indexer_types(cfg: dict, model_type: str, n_layers: int) -> list[str]:
    """Per layer: "full" (own indexer) or "shared" (reuses the previous full layer's top-k)."""
    if model_type == "glm_moe_dsa":
        indexer_types = _glm_indexer_types(cfg, n_layers)
    else:
        indexer_types = ["full"] * n_layers
    if len(indexer_types) != n_layers:
        raise ValueError(f"indexer_types must have num_hidden_layers={n_layers} entries, "
                         f"got {len(indexer_types)}")
    bad = [t for t in indexer_types if t not in ("full", "shared")]
    if bad:
        raise ValueError(f"indexer_types entries must be 'full' or 'shared', got {bad[0]!r}")
    if indexer_types[0] != "full":
        raise ValueError("indexer_types[0] must be 'full' "
                         "(a shared layer reuses a previous layer's top-k)")
    return indexer_types


def _mlp_layer_types(d: dict, n_layers: int) -> tuple[list[str], int]:
    """Per-layer "dense" / "sparse" MLPs and the routed-expert count (checked when used)."""
    types = d.get("mlp_layer_types")
    if types is None:
        n_dense = min(int(d["first_k_dense_replace"]), n_layers)
        types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
    types = list(types)
    if len(types) != n_layers or any(t not in ("dense", "sparse") for t in types):
        raise ValueError(f"mlp_layer_types must be {n_layers} entries of 'dense'/'sparse', "
                         f"got {types!r}")
    if "sparse" not in types:
        return types, int(d["n_routed_experts"])
    n_experts = _pos_int(d, "n_routed_experts")
    n_group = _pos_int(d, "n_group")
    if n_experts % n_group:
        raise ValueError(f"n_group must divide n_routed_experts ({n_experts}), got {n_group}")
    if not 0 < int(d["topk_group"]) <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], "
                         f"got {d['topk_group']!r}")
    if not 0 < int(d["num_experts_per_tok"]) <= n_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {n_experts}], "
                         f"got {d['num_experts_per_tok']!r}")
    return types, n_experts


def _rope_scales(cfg: dict, d: dict, rope_dim: int, max_pos: int) -> tuple[dict, float, float]:
    """Standardized RoPE parameters, the cos/sin attention factor and the softmax scale."""
    rope = _standardize_rope(cfg, max_pos)
    rope_type = rope["rope_type"]
    softmax_scale = (int(d["qk_nope_head_dim"]) + rope_dim) ** -0.5
    attention_factor = 1.0
    if rope_type == "yarn":
        factor = _yarn_factor(rope, max_pos)
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
            if ms and ms_all:
                attention_factor = float(yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all))
            else:
                attention_factor = yarn_mscale(factor)
    if rope_type != "default":
        # transformers' MLA multiplies the softmax scale by mscale(factor, mscale_all_dim)**2.
        ms_all = rope.get("mscale_all_dim", 0)
        if ms_all:
            m = yarn_mscale(_yarn_factor(rope, max_pos), ms_all)
            softmax_scale = softmax_scale * m * m
    return rope, attention_factor, softmax_scale


def _eos_ids(d: dict) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        return tuple(int(e) for e in eos)
    return () if eos is None else (int(eos),)


def _yarn_factor(rope: dict, max_pos: int) -> float:
    factor = rope.get("factor")
    if factor is None:
        factor = max_pos / rope["original_max_position_embeddings"]
    return float(factor)


def _standardize_rope(cfg: dict, max_pos: int) -> dict:
    """``rope_parameters`` (or legacy ``rope_scaling`` + ``rope_theta``) as one flat dict."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters must be a dict, got {rope!r}")
    rope = dict(rope)
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope_type = rope["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type must be one of {list(SUPPORTED_ROPE_TYPES)}, "
                         f"got {rope_type!r}")
    prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if prf not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor must be 1.0 for MLA models, got {prf!r}")
    if rope_type == "yarn":
        if "original_max_position_embeddings" in cfg:
            rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", max_pos)
    if rope_type == "linear" and rope.get("factor") is None:
        raise ValueError("rope_parameters.factor is required for rope_type 'linear'")
    return rope


def _glm_indexer_types(cfg: dict, n_layers: int) -> list[str]:
    """Same derivation as transformers' GlmMoeDsaConfig."""
    types = cfg.get("indexer_types")
    if types is not None:
        return list(types)
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            try:
                return [{"F": "full", "S": "shared"}[c] for c in pattern]
            except KeyError as e:
                raise ValueError(f"index_topk_pattern must consist of 'F'/'S', "
                                 f"got {pattern!r}") from e
        return list(pattern)
    freq = max(int(cfg.get("index_topk_freq", 1) or 1), 1)
    offset = int(cfg.get("index_skip_topk_offset", 2))
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n_layers)]
