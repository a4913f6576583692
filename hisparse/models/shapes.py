"""Built-in model shapes (config.json dicts) that ``hisparse bench`` and ``hisparse plan``
accept as ``--model-shape``: ``tp8-stand-in`` (DeepSeek-V3.2's attention and indexer geometry as
one TP-8 rank sees it, dense MLP layers), ``deepseek-v3.2-tp8-rank`` and ``glm-5-tp8-rank`` (one
TP-8 rank of the real models: all layers, MoE, FP8 weights). Imports no torch until a shape is
built."""

from __future__ import annotations

TP8_GEOMETRY = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432 // 8, q_lora_rank=1536,
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    num_attention_heads=16, num_key_value_heads=16, index_n_heads=64, index_head_dim=128,
    index_topk=2048, max_position_embeddings=163840, first_k_dense_replace=1000,
    n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
)


MODEL_SHAPES = ("tp8-stand-in", "deepseek-v3.2-tp8-rank", "glm-5-tp8-rank")


def model_shape_config(shape: str, layers: int | None = None) -> dict:
    """The config.json dict of ``shape`` (see the module doc); ``layers`` overrides the depth."""
    from hisparse.models.random_checkpoint import (
        DEEPSEEK_V32_SHAPE,
        GLM5_SHAPE,
        fp8_quantization_config,
        make_hf_config,
    )

    if shape == "tp8-stand-in":
        cfg = make_hf_config("deepseek_v32", num_hidden_layers=layers or 8,
                             **TP8_GEOMETRY).to_dict()
        cfg["architectures"] = ["DeepseekV32ForCausalLM"]
        return cfg
    if shape == "deepseek-v3.2-tp8-rank":
        arch, full, name = "deepseek_v32", DEEPSEEK_V32_SHAPE, "DeepseekV32ForCausalLM"
    elif shape == "glm-5-tp8-rank":
        arch, full, name = "glm_moe_dsa", GLM5_SHAPE, "GlmMoeDsaForCausalLM"
    else:
        raise ValueError(f"--model-shape must be one of {list(MODEL_SHAPES)}, got {shape!r}")
    over = dict(full)
    if layers:
        over["num_hidden_layers"] = layers
    cfg = make_hf_config(arch, tp_rank_of=8, **over).to_dict()
    cfg["architectures"] = [name]
    cfg["quantization_config"] = fp8_quantization_config((128, 128))
    return cfg
