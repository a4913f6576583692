"""The model on CUDA (skipped without a GPU): bf16 with production row geometry."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.context import DenseReferenceContext
from hisparse.models.loader import load_model
from hisparse.models.random_checkpoint import PRODUCTION_GEOMETRY, make_random_checkpoint


@pytest.mark.gpu
def test_cuda_bf16_matches_cpu_fp32(tmp_path):
    pytest.importorskip("transformers")
    path = make_random_checkpoint(tmp_path / "g", "deepseek_v32", seed=4, num_hidden_layers=3,
                                  hidden_size=256, q_lora_rank=128, num_attention_heads=8,
                                  num_key_value_heads=8,
                                  **{**PRODUCTION_GEOMETRY, "index_topk": 64})
    ids = torch.randint(2, 384, (200,), generator=torch.Generator().manual_seed(0))
    outs = {}
    for dev, dt in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        model, cfg = load_model(path, dt, dev)
        assert cfg.kv_row_dim == 576
        ctx = DenseReferenceContext.from_config(cfg)
        with torch.inference_mode():
            h = model(ids.to(dev), ctx.begin([0], [200], device=dev), ctx)
            logits = [model.compute_logits(h[-1:])]
            for _ in range(8):
                nxt = (logits[-1].argmax(-1) if dev == "cpu"
                       else outs["cpu"][len(logits) - 1].argmax(-1).to(dev))
                logits.append(model.compute_logits(model(nxt, ctx.begin([0], [1], device=dev),
                                                         ctx)))
        outs[dev] = [x.cpu() for x in logits]
    for a, b in zip(outs["cpu"], outs["cuda"]):
        assert torch.isfinite(b).all()
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert cos > 0.98, cos
