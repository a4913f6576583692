"""The fp32-kept weights stored in bf16 where that loses nothing (:meth:`DSAForCausalLM.
narrow_fp32_weights_`, :meth:`DSAForCausalLM.finalize_weights_`): a router gate or indexer
``weights_proj`` whose fp32 values are all bf16 values (a checkpoint that stores it in bf16, as
DeepSeek's do) becomes bf16 and the model computes the same logits; any other, or a model not
computed in bf16, keeps fp32."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.context import DenseReferenceContext
from hisparse.models.dsa import DSADecoderLayer, DSAIndexer, DSARouter
from hisparse.models.loader import load_model
from hisparse.models.random_checkpoint import make_random_checkpoint


def _weights(model) -> list[torch.nn.Parameter]:
    """The router gates, then the indexers' weights_proj."""
    return ([m.weight for m in model.modules() if isinstance(m, DSARouter)]
            + [m.weights_proj.weight for m in model.modules() if isinstance(m, DSAIndexer)])


def _logits(model, cfg, ids):
    ctx = DenseReferenceContext.from_config(cfg)
    pos = ctx.begin(["s"], [ids.numel()])
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, ctx))


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def bf16_checkpoint(request, tmp_path_factory):
    over = (dict(num_hidden_layers=3) if request.param == "deepseek_v32" else
            dict(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"]))
    return make_random_checkpoint(tmp_path_factory.mktemp(request.param), request.param,
                                  seed=11, index_topk=16, save_dtype="bfloat16", **over)


def test_bf16_stored_weights_are_narrowed_and_compute_the_same(bf16_checkpoint):
    model, cfg = load_model(bf16_checkpoint, torch.bfloat16)
    n_gates = sum(isinstance(m, DSARouter) for m in model.modules())
    weights = _weights(model)
    assert n_gates and len(weights) > n_gates
    assert all(w.dtype == torch.float32 for w in weights)    # widened on load
    layers = [m for m in model.modules() if isinstance(m, DSADecoderLayer)]
    assert any(layer.attn_fp32 for layer in layers)           # the norm's fp32 copy
    before = [w.detach().clone() for w in weights]
    ids = torch.randint(2, cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(2))
    want = _logits(model, cfg, ids)
    names = [n for n, _ in model.named_parameters()]
    stacked, narrowed = model.finalize_weights_()
    assert stacked > 0 and model.stacks()                     # stacked as before
    assert narrowed == len(weights)
    after = _weights(model)
    assert [w.dtype for w in after] == [torch.bfloat16] * len(after)
    assert all(torch.equal(a.float(), b) for a, b in zip(after, before))
    assert [n for n, _ in model.named_parameters()] == names  # the checkpoint's names
    assert not any(layer.attn_fp32 for layer in layers)       # no fp32 copy needed now
    assert torch.equal(_logits(model, cfg, ids), want)        # fp32 products and sums
    assert model.narrow_fp32_weights_() == 0                  # idempotent


def test_a_weight_with_any_other_value_stays_fp32(bf16_checkpoint):
    model, _ = load_model(bf16_checkpoint, torch.bfloat16)
    weights = _weights(model)
    for w in (weights[0], weights[-1]):                       # a gate, a weights_proj
        with torch.no_grad():      # the next fp32 value: never a bf16 one when w is
            w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))
    assert model.narrow_fp32_weights_() == len(weights) - 2
    after = _weights(model)
    assert after[0].dtype == after[-1].dtype == torch.float32
    assert all(w.dtype == torch.bfloat16 for w in after[1:-1])


def test_fp32_models_and_fp32_checkpoints_keep_fp32_weights(bf16_checkpoint, tmp_path):
    model32, _ = load_model(bf16_checkpoint, torch.float32)
    assert model32.narrow_fp32_weights_() == 0               # the model computes in fp32
    path = make_random_checkpoint(tmp_path / "f32", "deepseek_v32", seed=11, index_topk=16,
                                  num_hidden_layers=3)        # random fp32 values
    model, _ = load_model(path, torch.bfloat16)
    assert model.narrow_fp32_weights_() == 0
    assert all(w.dtype == torch.float32 for w in _weights(model))


def test_dummy_weights_draw_them_in_bf16_values(tmp_path):
    path = make_random_checkpoint(tmp_path / "d", "deepseek_v32", seed=1, index_topk=16,
                                  num_hidden_layers=3)
    model, _ = load_model(path, torch.bfloat16, load_format="dummy")
    weights = _weights(model)
    assert weights and all(w.dtype == torch.float32 and w.std() > 0 for w in weights)
    assert model.narrow_fp32_weights_() == len(weights)
