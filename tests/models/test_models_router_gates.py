"""MoE router gates stored in bf16 where that loses nothing (:meth:`DSAForCausalLM.
narrow_router_gates_`, :meth:`DSAForCausalLM.finalize_weights_`): a gate whose fp32 values are
all bf16 values (a checkpoint that stores it in bf16, as DeepSeek's do) becomes bf16 and the
model computes the same logits; any other gate, or a model not computed in bf16, keeps fp32."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.context import DenseReferenceContext
from hisparse.models.dsa import DSARouter
from hisparse.models.loader import load_model
from hisparse.models.random_checkpoint import make_random_checkpoint


def _gates(model) -> list[DSARouter]:
    return [m for m in model.modules() if isinstance(m, DSARouter)]


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


def test_bf16_stored_gates_are_narrowed_and_compute_the_same(bf16_checkpoint):
    model, cfg = load_model(bf16_checkpoint, torch.bfloat16)
    gates = _gates(model)
    assert gates and all(g.weight.dtype == torch.float32 for g in gates)   # widened on load
    before = [g.weight.detach().clone() for g in gates]
    ids = torch.randint(2, cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(2))
    want = _logits(model, cfg, ids)
    names = [n for n, _ in model.named_parameters()]
    model.finalize_weights_()
    assert model.stacks()                                   # stacked as before
    assert [g.weight.dtype for g in gates] == [torch.bfloat16] * len(gates)
    assert all(torch.equal(g.weight.float(), b) for g, b in zip(gates, before))
    assert [n for n, _ in model.named_parameters()] == names  # the checkpoint's names
    assert torch.equal(_logits(model, cfg, ids), want)      # the reference computes in fp32
    assert model.narrow_router_gates_() == 0                # idempotent


def test_a_gate_with_any_other_value_stays_fp32(bf16_checkpoint):
    model, _ = load_model(bf16_checkpoint, torch.bfloat16)
    gates = _gates(model)
    with torch.no_grad():
        gates[0].weight[3, 5] += 2.0 ** -20 * gates[0].weight[3, 5].abs().clamp(min=1.0)
    assert model.narrow_router_gates_() == len(gates) - 1
    assert gates[0].weight.dtype == torch.float32
    assert all(g.weight.dtype == torch.bfloat16 for g in gates[1:])


def test_fp32_models_and_fp32_checkpoints_keep_fp32_gates(bf16_checkpoint, tmp_path):
    model32, _ = load_model(bf16_checkpoint, torch.float32)
    assert model32.narrow_router_gates_() == 0             # the model computes in fp32
    path = make_random_checkpoint(tmp_path / "f32", "deepseek_v32", seed=11, index_topk=16,
                                  num_hidden_layers=3)      # random fp32 gate values
    model, _ = load_model(path, torch.bfloat16)
    assert model.narrow_router_gates_() == 0
    assert all(g.weight.dtype == torch.float32 for g in _gates(model))


def test_dummy_weights_draw_the_gate_in_bf16_values(tmp_path):
    path = make_random_checkpoint(tmp_path / "d", "deepseek_v32", seed=1, index_topk=16,
                                  num_hidden_layers=3)
    model, _ = load_model(path, torch.bfloat16, load_format="dummy")
    gates = _gates(model)
    assert gates and all(g.weight.dtype == torch.float32 for g in gates)
    assert all(g.weight.std() > 0 for g in gates)
    assert model.narrow_router_gates_() == len(gates)
