"""The real-rank model shapes of ``hisparse bench --model-shape`` (built on the meta device)."""

import pytest
import torch

pytest.importorskip("transformers")

from hisparse.bench.decode import model_shape_config, touched_weight_bytes  # noqa: E402
from hisparse.models.config import DSAConfig  # noqa: E402
from hisparse.models.dsa import DSAForCausalLM  # noqa: E402


def test_deepseek_v32_tp8_rank_shape():
    cfg = DSAConfig.from_hf(model_shape_config("deepseek-v3.2-tp8-rank"))
    assert cfg.num_layers == 61 and cfg.mlp_layer_types[:4] == ("dense",) * 3 + ("sparse",)
    assert (cfg.num_heads, cfg.index_n_heads, cfg.moe_intermediate_size) == (16, 64, 256)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == \
        (256, 8, 8, 4)
    assert cfg.intermediate_size == 18432 // 8 and cfg.hidden_size == 7168
    assert cfg.fp8_block == (128, 128) and cfg.kv_row_dim == 576
    with torch.device("meta"):
        m = DSAForCausalLM(cfg, dtype=torch.bfloat16)
    experts = sum(p.numel() * p.element_size() for n, p in m.named_parameters()
                  if ".experts." in n)
    assert m.model.layers[3].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert abs(experts / 58 / 1e9 - 1.41) < 0.01       # ~1.4 GB of FP8 experts per MoE layer
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    assert 85e9 < total < 92e9                          # fits an H200 with ~45 GB to spare
    assert m.cuda_graph_safe
    assert touched_weight_bytes(cfg, 1) < touched_weight_bytes(cfg, 64) < total


def test_glm5_tp8_rank_shape():
    cfg = DSAConfig.from_hf(model_shape_config("glm-5-tp8-rank"))
    assert cfg.num_layers == 78 and cfg.num_heads == 8 and cfg.fp8_block == (128, 128)
