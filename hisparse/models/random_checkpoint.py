"""Tiny (or production-shaped) random-weight DSA checkpoints, written by transformers itself.

The checkpoint is an ordinary HF directory (config.json + safetensors) that both
``transformers.AutoModelForCausalLM.from_pretrained`` and :func:`hisparse.models.loader.load_model`
read, which is what the oracle tests need.
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


def make_hf_config(arch: str = "deepseek_v32", **overrides):
    """A transformers config object for ``arch`` with our tiny defaults, then ``overrides``."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    cfg_cls = getattr(transformers, ARCHS[arch][0])
    kw = dict(TINY_DEFAULTS)
    kw.update(overrides)
    return cfg_cls(**kw)


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
                      **config_overrides):
    """An in-memory transformers model (fp32, eval mode) with seeded random weights."""
    import transformers

    cfg = make_hf_config(arch, **config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch][1])(cfg).eval()
    randomize_(model, seed, init_std)
    return model


def make_random_checkpoint(path: str | os.PathLike, arch: str = "deepseek_v32", *, seed: int = 0,
                           init_std: float | None = None, save_dtype: str | torch.dtype = "float32",
                           max_shard_size: str | int | None = None, **config_overrides) -> str:
    """Write a seeded random-weight checkpoint of ``arch`` to ``path`` and return ``path``.

    ``config_overrides`` are transformers config fields (e.g. ``num_hidden_layers=4``,
    ``indexer_types=["full", "shared", ...]``, ``rope_parameters={...}``, or
    ``**PRODUCTION_GEOMETRY``). ``max_shard_size`` (e.g. ``"20KB"``) writes a sharded checkpoint.
    """
    path = str(path)
    model = make_random_model(arch, seed=seed, init_std=init_std, **config_overrides)
    if isinstance(save_dtype, str):
        save_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[save_dtype]
    if save_dtype != torch.float32:
        model = model.to(save_dtype)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, **kw)
    return path
