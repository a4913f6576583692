"""Linears that share an input stacked into one GEMM (:class:`hisparse.models.linear.
StackedLinears`, :meth:`DSAForCausalLM.stack_projections_`): the model computes what it did
unstacked, the parameters stay the checkpoint's (views of the stacked tensors), and what cannot
be stacked is refused by reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hisparse.models.context import DenseReferenceContext
from hisparse.models.linear import FP8Linear, StackedLinears
from hisparse.models.loader import load_model
from hisparse.models.random_checkpoint import make_random_checkpoint
from hisparse.ops.gemm import fp8_block_linear_reference, quantize_fp8_weight

BLOCK = (16, 16)


def _fp8_linear(k: int, n: int, seed: int, block=BLOCK, bias: bool = False) -> FP8Linear:
    g = torch.Generator().manual_seed(seed)
    lin = FP8Linear(k, n, bias=bias, block=block)
    w, s = quantize_fp8_weight(torch.randn(n, k, generator=g) * 0.05, block)
    lin.weight.data.copy_(w)
    lin.weight_scale_inv.data.copy_(s)
    if bias:
        lin.bias.data.copy_(torch.randn(n, generator=g))
    return lin


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def fp8_model(request, tmp_path_factory):
    over = (dict(num_hidden_layers=3) if request.param == "deepseek_v32" else
            dict(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"]))
    path = make_random_checkpoint(tmp_path_factory.mktemp(request.param), request.param,
                                  seed=5, index_topk=16, fp8=True, fp8_block=BLOCK, **over)
    model, cfg = load_model(path, torch.float32)
    return model, cfg


def _logits(model, cfg, ids):
    ctx = DenseReferenceContext.from_config(cfg)
    pos = ctx.begin(["s"], [ids.numel()])
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, ctx))


def test_stacked_model_computes_what_the_unstacked_did(fp8_model):
    model, cfg = fp8_model
    ids = torch.randint(2, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(3))
    names = [n for n, _ in model.named_parameters()]
    want = _logits(model, cfg, ids)
    assert model.stack_projections_() > 0
    attn = model.model.layers[0].self_attn
    assert attn.proj_x is not None and attn.proj_q is not None
    assert [n for n, _ in model.named_parameters()] == names     # the checkpoint's names
    got = _logits(model, cfg, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # idempotent: a second call keeps the same stacks (same objects, same storage)
    before = [(id(st), st.weight.data_ptr()) for st in model.stacks()]
    model.stack_projections_()
    assert [(id(st), st.weight.data_ptr()) for st in model.stacks()] == before
    assert all(st.aliased() for st in model.stacks())
    # the weights must be final: casting or sharding a stacked model is refused
    with pytest.raises(RuntimeError, match="stacked already"):
        model.cast(torch.bfloat16)
    from hisparse.models.tp import shard_model_
    with pytest.raises(ValueError, match="stacked already"):
        shard_model_(model, 0, 2)


def test_parts_are_views_of_the_stack():
    parts = [_fp8_linear(64, 32, 1), _fp8_linear(64, 16, 2), _fp8_linear(64, 24, 3)]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    want = [p(x) for p in parts]
    st = StackedLinears(parts)
    got = st(x)
    assert [g.shape[-1] for g in got] == [32, 16, 24]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert st.aliased()
    # the last part ends mid scale block (24 rows of 16-row blocks): scales 2 + 1 + 2 rows
    assert st.scale_inv.shape == (5, 4)
    # writing a part's weight (as a loader does) reaches the stacked GEMM
    fresh = _fp8_linear(64, 16, 9)
    parts[1].weight.data.copy_(fresh.weight)
    parts[1].weight_scale_inv.data.copy_(fresh.weight_scale_inv)
    torch.testing.assert_close(st(x)[1], fresh(x), rtol=1e-5, atol=1e-6)
    ref = fp8_block_linear_reference(x, fresh.weight, fresh.weight_scale_inv, BLOCK)
    torch.testing.assert_close(st(x)[1], ref, rtol=1e-5, atol=1e-6)
    # re-assigning a part's parameter breaks the aliasing, and aliased() says so
    parts[0].weight.data = parts[0].weight.data.clone()
    assert not st.aliased()


def test_plain_linears_and_biases_stack():
    g = torch.Generator().manual_seed(6)
    parts = [nn.Linear(40, n, bias=True) for n in (8, 12)]
    for p in parts:
        p.weight.data.copy_(torch.randn(p.weight.shape, generator=g))
        p.bias.data.copy_(torch.randn(p.bias.shape, generator=g))
    x = torch.randn(3, 40, generator=g)
    want = [p(x) for p in parts]
    for got, w in zip(StackedLinears(parts)(x), want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    fp8 = [_fp8_linear(64, 32, 1, bias=True), _fp8_linear(64, 16, 2, bias=True)]
    x1 = torch.randn(2, 64, generator=g)
    want = [p(x1) for p in fp8]
    st = StackedLinears(fp8)
    for got, w in zip(st(x1), want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    fp8[1].bias.data = fp8[1].bias.data.clone()     # a replaced bias breaks the aliasing too
    assert not st.aliased()


def test_engine_runs_the_stacked_model(tmp_path):
    """Engine start-up stacks every layer's projections, the MTP layer's included, and the
    parameters it loaded are the ones the stacks read."""
    from hisparse.engine.llm import LLM
    from hisparse.engine.sampling import SamplingParams

    path = make_random_checkpoint(tmp_path / "ckpt", "deepseek_v32", seed=3, index_topk=16,
                                  num_hidden_layers=2, num_nextn_predict_layers=1)
    with LLM(str(path), device="cpu", dtype="float32", block_size=8, max_model_len=64,
             max_num_seqs=2, num_speculative_tokens=1, hot_buffer_size=32) as llm:
        model = llm.model
        attns = [layer.self_attn for layer in model.model.layers] + [
            m.layer.self_attn for m in model.mtp]
        assert len(model.mtp) == 1
        assert all(a.proj_x is not None and a.proj_q is not None for a in attns)
        assert all(st.aliased() for st in model.stacks())
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("parts, reason", [
    (lambda: [_fp8_linear(64, 24, 1), _fp8_linear(64, 16, 2)], "scale blocks"),
    (lambda: [_fp8_linear(64, 32, 1), _fp8_linear(48, 16, 2)], "input sizes"),
    (lambda: [_fp8_linear(64, 32, 1, bias=True), _fp8_linear(64, 16, 2)], "bias"),
    (lambda: [_fp8_linear(64, 32, 1), _fp8_linear(64, 32, 2, block=(32, 32))], "blocks"),
    (lambda: [_fp8_linear(64, 32, 1), nn.Linear(64, 16)], "all FP8Linear"),
    (lambda: [_fp8_linear(64, 32, 1)], "fewer than two"),
])
def test_unstackable_linears_are_refused_by_reason(parts, reason):
    lins = parts()
    assert not StackedLinears.can_stack(lins)
    with pytest.raises(ValueError, match=reason):
        StackedLinears(lins)


@pytest.mark.gpu
def test_gpu_stacked_rank_projections_batch_invariant():
    """One TP-8 rank's [q_a | wk | kv_a] (2240 x 7168, kv_a's 576 rows ending mid block) and
    [q_b | wq_b] (11264 x 1536) on the split-K kernel: each part equals its own linear to the
    kernel's rounding, and a row's bits do not depend on the batch it runs in."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    for k, sizes in ((7168, (1536, 128, 576)), (1536, (3072, 8192))):
        parts = [_fp8_linear(k, n, i, block=(128, 128)).to(dev) for i, n in enumerate(sizes)]
        x = torch.randn(96, k, device=dev, dtype=torch.bfloat16)
        want = [fp8_block_linear_reference(x, p.weight, p.weight_scale_inv, (128, 128),
                                           quantize_input=True, out_dtype=torch.float32)
                for p in parts]
        st = StackedLinears(parts)
        full = st(x)
        for got, w in zip(full, want):
            torch.testing.assert_close(got.float(), w, rtol=1e-2,
                                       atol=1e-2 * w.abs().max().item())
        for m in (1, 8, 24):
            for got, ref in zip(st(x[:m]), full):
                assert torch.equal(got, ref[:m]), f"rows depend on the batch (M={m})"
