"""DSAConfig parsing, the safetensors loader, RoPE scaling, bf16 and production geometry."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from hisparse.models.config import DSAConfig  # noqa: E402
from hisparse.models.context import DenseReferenceContext, SparseAttentionContext  # noqa: E402
from hisparse.models.dsa import DSAForCausalLM  # noqa: E402
from hisparse.models.loader import CheckpointError, load_model  # noqa: E402
from hisparse.models.random_checkpoint import (  # noqa: E402
    PRODUCTION_GEOMETRY,
    make_hf_config,
    make_random_checkpoint,
)


def _prompt(n, vocab, seed=0):
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _ours(model, cfg, ids):
    ctx = DenseReferenceContext.from_config(cfg)
    pos = ctx.begin([0], [ids.numel()])
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, ctx))


def _hf_logits(path, ids, dtype=torch.float32):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0].float(), hf


@pytest.fixture(scope="module")
def ds_ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("ds"), "deepseek_v32", seed=3,
                                  num_hidden_layers=2)


# ----------------------------------------------------------------------------- config

def test_config_fields_deepseek(ds_ckpt):
    with open(os.path.join(ds_ckpt, "config.json")) as f:
        raw = json.load(f)
    cfg = DSAConfig.from_hf(raw)
    assert cfg.architecture == "DeepseekV32ForCausalLM" and cfg.model_type == "deepseek_v32"
    assert cfg.num_layers == 2 and cfg.num_heads == 4 and cfg.kv_lora_rank == 32
    assert cfg.kv_row_dim == 32 + 16
    assert cfg.indexer_types == ("full", "full") and cfg.layer_has_indexer(1)
    assert cfg.mlp_layer_types == ("dense", "sparse")
    assert not cfg.indexer_rope_interleaved
    assert cfg.softmax_scale == pytest.approx((16 + 16) ** -0.5)
    assert cfg.eos_token_ids == (1,) and cfg.dtype == torch.float32
    with pytest.raises(ValueError, match="layer_idx"):
        cfg.layer_has_indexer(2)


@pytest.mark.parametrize("extra", [
    dict(index_topk_freq=2),
    dict(index_topk_freq=3, index_skip_topk_offset=1),
    dict(index_topk_pattern="FFSSFS"),
    dict(indexer_types=["full", "shared", "shared", "full", "full", "shared"]),
])
def test_glm_indexer_types_match_transformers(extra):
    hf_cfg = make_hf_config("glm_moe_dsa", num_hidden_layers=6, **extra)
    raw = hf_cfg.to_dict()
    raw.update(extra)  # index_topk_* are read from config.json by transformers' __post_init__
    ours = DSAConfig.from_hf(raw)
    assert list(ours.indexer_types) == list(hf_cfg.indexer_types)
    assert ours.indexer_rope_interleaved
    assert ([ours.layer_has_indexer(i) for i in range(6)]
            == [t == "full" for t in hf_cfg.indexer_types])


def test_production_defaults_and_eos_list():
    cfg = DSAConfig.from_hf({"architectures": ["DeepseekV32ForCausalLM"], "eos_token_id": [1, 2],
                             "torch_dtype": "bfloat16"})
    assert cfg.kv_row_dim == 576 and cfg.index_topk == 2048 and cfg.index_n_heads == 64
    assert cfg.eos_token_ids == (1, 2) and cfg.dtype == torch.bfloat16
    glm = DSAConfig.from_hf({"model_type": "glm_moe_dsa"})
    assert glm.architecture == "GlmMoeDsaForCausalLM" and glm.kv_row_dim == 576


def test_unknown_architecture_raises():
    with pytest.raises(ValueError, match="architectures") as e:
        DSAConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert "DeepseekV32ForCausalLM" in str(e.value) and "GlmMoeDsaForCausalLM" in str(e.value)
    with pytest.raises(ValueError, match="architectures"):
        DSAConfig.from_hf({"model_type": "llama"})


def test_invalid_fields_are_named():
    base = {"architectures": ["DeepseekV32ForCausalLM"]}
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DSAConfig.from_hf({**base, "kv_lora_rank": 0})
    with pytest.raises(ValueError, match="rope_type"):
        DSAConfig.from_hf({**base, "rope_scaling": {"type": "longrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="indexer_types"):
        DSAConfig.from_hf({"architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 2,
                           "indexer_types": ["shared", "full"]})


# ----------------------------------------------------------------------------- rope scaling

def test_yarn_rope_scaling_matches_transformers(tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.8,
            "beta_fast": 32, "beta_slow": 1}
    path = make_random_checkpoint(tmp_path / "yarn", "deepseek_v32", seed=5, num_hidden_layers=2,
                                  max_position_embeddings=128, rope_parameters=rope)
    ids = _prompt(70, 384, seed=1)
    ref, hf = _hf_logits(path, ids)
    model, cfg = load_model(path, torch.float32)
    # the derived quantities are transformers' own
    rot = hf.model.rotary_emb
    torch.testing.assert_close(cfg.rope_inv_freq(), rot.inv_freq.float(), rtol=0, atol=0)
    assert cfg.rope_attention_factor == pytest.approx(rot.attention_scaling)
    assert cfg.rope_attention_factor != pytest.approx(1.0)
    assert cfg.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling)
    assert cfg.softmax_scale != pytest.approx(32 ** -0.5)
    torch.testing.assert_close(_ours(model, cfg, ids), ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- loader

def test_sharded_checkpoint_loads_identically(tmp_path, ds_ckpt):
    sharded = make_random_checkpoint(tmp_path / "sharded", "deepseek_v32", seed=3,
                                     num_hidden_layers=2, max_shard_size="100KB")
    files = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert len(files) > 2 and os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    m1, _ = load_model(ds_ckpt, torch.float32)
    m2, cfg = load_model(sharded, "float32")
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    ids = _prompt(40, cfg.vocab_size)
    ref, _ = _hf_logits(sharded, ids)
    torch.testing.assert_close(_ours(m2, cfg, ids), ref, rtol=1e-4, atol=1e-4)


def test_missing_tensor_is_named_and_mtp_ignored(tmp_path, ds_ckpt):
    sd = load_file(os.path.join(ds_ckpt, "model.safetensors"))
    with open(os.path.join(ds_ckpt, "config.json")) as f:
        raw = json.load(f)

    def write(d, tensors, cfg=raw):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        save_file(tensors, os.path.join(d, "model.safetensors"))
        return str(d)

    gone = "model.layers.1.self_attn.indexer.wk.weight"
    broken = write(tmp_path / "broken", {k: v for k, v in sd.items() if k != gone})
    with pytest.raises(CheckpointError, match="indexer.wk.weight"):
        load_model(broken)
    gone_e = "model.layers.1.mlp.experts.3.up_proj.weight"
    broken_e = write(tmp_path / "broken_e", {k: v for k, v in sd.items() if k != gone_e})
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj"):
        load_model(broken_e)

    # An MTP layer (index num_hidden_layers) as DeepSeek ships it: present in the files, ignored.
    mtp = dict(sd)
    for k, v in sd.items():
        if k.startswith("model.layers.1."):
            mtp[k.replace("model.layers.1.", "model.layers.2.")] = v.clone()
    mtp["model.layers.2.eh_proj.weight"] = torch.zeros(4, 4)
    with_mtp = write(tmp_path / "mtp", mtp, {**raw, "num_nextn_predict_layers": 1})
    m, cfg = load_model(with_mtp, torch.float32)
    assert cfg.num_nextn_predict_layers == 1 and len(m.model.layers) == 2


def test_fp8_block_weights_stay_fp8(tmp_path, ds_ckpt):
    """An FP8 tensor with its scales is kept as stored; the bf16/fp32 tensors of layers the model
    keeps in FP8 are block-quantized at load; an FP8 kv_b_proj is dequantized into w_uk/w_uv."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 dtype in this torch")
    sd = load_file(os.path.join(ds_ckpt, "model.safetensors"))
    name = "model.layers.1.self_attn.q_b_proj.weight"            # [128, 48]
    w = sd[name]
    block = 32
    scale = torch.rand(-(-w.shape[0] // block), -(-w.shape[1] // block)) + 0.5
    full_scale = (scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
                  [: w.shape[0], : w.shape[1]])
    q = (w / full_scale).to(torch.float8_e4m3fn)
    sd[name], sd[name + "_scale_inv"] = q, scale
    from hisparse.ops.gemm import dequantize_fp8_weight, quantize_fp8_weight
    kvb = "model.layers.1.self_attn.kv_b_proj.weight"
    kv_w = sd[kvb]
    sd[kvb], sd[kvb + "_scale_inv"] = quantize_fp8_weight(kv_w, (block, block))
    with open(os.path.join(ds_ckpt, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    os.makedirs(tmp_path / "fp8")
    with open(tmp_path / "fp8" / "config.json", "w") as f:
        json.dump(raw, f)
    save_file(sd, str(tmp_path / "fp8" / "model.safetensors"))
    m, cfg = load_model(str(tmp_path / "fp8"), torch.float32)
    lin = m.model.layers[1].self_attn.q_b_proj
    assert lin.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(lin.weight.float(), q.float()) and torch.equal(lin.weight_scale_inv, scale)
    other = m.model.layers[1].self_attn.o_proj      # fp32 in the file: quantized at load
    assert other.weight.dtype == torch.float8_e4m3fn
    ow = sd["model.layers.1.self_attn.o_proj.weight"]
    back = dequantize_fp8_weight(other.weight, other.weight_scale_inv, (block, block))
    assert (back - ow).abs().max() < 0.07 * ow.abs().max()
    attn = m.model.layers[1].self_attn
    assert attn.w_uk.dtype == torch.float32
    kv_deq = dequantize_fp8_weight(sd[kvb], sd[kvb + "_scale_inv"], (block, block))
    kv_deq = kv_deq.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    torch.testing.assert_close(attn.w_uk, kv_deq[:, : cfg.qk_nope_head_dim])
    assert (kv_deq.reshape(kv_w.shape) - kv_w).abs().max() < 0.1 * kv_w.abs().max()


# ----------------------------------------------------------------------------- dtypes / geometry

def test_bf16_smoke(ds_ckpt):
    m32, cfg = load_model(ds_ckpt, torch.float32)
    m16, _ = load_model(ds_ckpt, torch.bfloat16)
    assert m16.model.layers[0].self_attn.w_uk.dtype == torch.bfloat16
    assert m16.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert m16.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    ids = _prompt(48, cfg.vocab_size, seed=9)
    ctx = DenseReferenceContext.from_config(cfg)
    pos = ctx.begin([0], [48])
    with torch.no_grad():
        h = m16(ids, pos, ctx)
        assert h.dtype == torch.bfloat16
        logits = m16.compute_logits(h)
        for _ in range(4):  # incremental decode in bf16
            nxt = logits[-1:].argmax(-1)
            logits = m16.compute_logits(m16(nxt, ctx.begin([0], [1]), ctx))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    l32 = _ours(m32, cfg, ids)
    l16 = _ours(m16, cfg, ids)
    agree = (l32.argmax(-1) == l16.argmax(-1)).float().mean()
    assert agree > 0.7, agree


def test_production_row_geometry(tmp_path):
    """kv_lora_rank 512 + rope 64 -> 576-d rows; the context sees exactly that."""
    path = make_random_checkpoint(tmp_path / "prod", "glm_moe_dsa", seed=1, num_hidden_layers=2,
                                  hidden_size=64, q_lora_rank=32, num_attention_heads=2,
                                  num_key_value_heads=2, indexer_types=["full", "shared"],
                                  **{**PRODUCTION_GEOMETRY, "index_n_heads": 32, "index_topk": 8})
    model, cfg = load_model(path, torch.float32)
    assert cfg.kv_row_dim == 576

    seen = []

    class Spy(DenseReferenceContext):
        def attend(self, layer_idx, q_latent, kv_new, index_q, index_weights, index_k_new,
                   sm_scale):
            seen.append((layer_idx, tuple(q_latent.shape), tuple(kv_new.shape),
                         None if index_q is None else tuple(index_q.shape),
                         None if index_weights is None else index_weights.dtype,
                         None if index_k_new is None else tuple(index_k_new.shape)))
            out = super().attend(layer_idx, q_latent, kv_new, index_q, index_weights,
                                 index_k_new, sm_scale)
            assert out.shape == (q_latent.shape[0], q_latent.shape[1], 512)
            return out

    ctx = Spy.from_config(cfg)
    assert isinstance(ctx, SparseAttentionContext)
    ids = _prompt(20, cfg.vocab_size)
    with torch.no_grad():
        out = model.compute_logits(model(ids, ctx.begin([0], [20]), ctx))
    assert seen == [(0, (20, 2, 576), (20, 576), (20, 32, 128), torch.float32, (20, 128)),
                    (1, (20, 2, 576), (20, 576), None, None, None)]
    ref, _ = _hf_logits(path, ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_random_init_without_checkpoint():
    cfg = DSAConfig.from_hf(make_hf_config("deepseek_v32", num_hidden_layers=2).to_dict())
    model = DSAForCausalLM(cfg, dtype=torch.float32)
    ctx = DenseReferenceContext.from_config(cfg)
    with torch.no_grad():
        h = model(_prompt(10, cfg.vocab_size), ctx.begin(["x"], [10]), ctx)
    assert h.shape == (10, cfg.hidden_size) and torch.isfinite(h).all()
    with pytest.raises(RuntimeError, match="expected layer"):
        ctx.begin(["x"], [1])
        ctx.attend(1, *([None] * 6))


@pytest.mark.parametrize("extra", [
    dict(tie_word_embeddings=True),
    dict(attention_bias=True),
    dict(n_shared_experts=2, norm_topk_prob=False, n_group=4, topk_group=2, num_experts_per_tok=3),
], ids=["tied", "attn_bias", "moe_variant"])
def test_config_variants_match_transformers(tmp_path, extra):
    path = make_random_checkpoint(tmp_path / "v", "deepseek_v32", seed=2, num_hidden_layers=2,
                                  **extra)
    ids = _prompt(40, 384, seed=3)
    ref, _ = _hf_logits(path, ids)
    model, cfg = load_model(path, torch.float32)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(_ours(model, cfg, ids), ref, rtol=1e-4,
                               atol=1e-4 * ref.abs().max().item())


def test_deepseek_v32_release_rope_matches_transformers():
    """The rope block of DeepSeek-V3.2's config.json (legacy `rope_scaling` + `type`)."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as mod

    raw = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
           "num_hidden_layers": 2, "max_position_embeddings": 163840, "rope_theta": 10000,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                            "type": "yarn"}}
    ours = DSAConfig.from_hf(raw)
    hf_cfg = transformers.DeepseekV32Config(**{k: v for k, v in raw.items()
                                               if k != "architectures"})
    rot = mod.DeepseekV32RotaryEmbedding(hf_cfg)
    assert torch.equal(ours.rope_inv_freq(), rot.inv_freq)
    assert ours.rope_attention_factor == pytest.approx(rot.attention_scaling)
    assert ours.softmax_scale == pytest.approx(mod.yarn_apply_mscale(hf_cfg.rope_parameters,
                                                                     192 ** -0.5))
    assert ours.softmax_scale > 192 ** -0.5 * 1.5  # mscale(40, 1)^2 ~ 1.87
