"""The whole model with its reductions handed to the next norm (:mod:`hisparse.ops.pending`:
``o_proj``'s split-K partials into the post-attention norm, the MoE combine and the dense
``down_proj``'s partials into the next layer's input norm or the final norm) computes bitwise
what it computes with them launched on their own (``HISPARSE_FUSED_SUMS=0``), MTP layers
included. CPU: a tiny FP8 model through Triton (interpreter); GPU: a small one on CUDA."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.context import DenseReferenceContext
from hisparse.models.loader import load_model
from hisparse.models.random_checkpoint import make_random_checkpoint
from hisparse.ops import _glue_triton, switches


class _LayerShift:
    """A dense reference context seen by a layer whose index is ``offset`` higher (the MTP
    layer's)."""

    def __init__(self, ctx, offset):
        self.ctx, self.offset = ctx, offset

    def attend(self, layer_idx, *args):
        return self.ctx.attend(layer_idx - self.offset, *args)


def _forward(model, cfg, ids, device, hidden_in):
    """The main forward and the MTP layer's (fresh contexts), in one go."""
    ctx = DenseReferenceContext.from_config(cfg)
    with torch.inference_mode():
        h = model(ids, ctx.begin(["s"], [ids.numel()], device=device), ctx)
        mtp_ctx = DenseReferenceContext(1, cfg.index_topk, cfg.kv_lora_rank, [True])
        pos = mtp_ctx.begin(["s"], [ids.numel()], device=device)
        m = model.mtp_forward(ids, hidden_in, pos, _LayerShift(mtp_ctx, cfg.num_layers))
    return h, m


def _both(model, cfg, ids, device, monkeypatch):
    """``(fused, unfused)`` outputs, and how many norms summed a pending sum each time."""
    fused_norms = []
    real = _glue_triton.add_rms_norm_sum_triton

    def counted(*a, **kw):
        fused_norms.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(_glue_triton, "add_rms_norm_sum_triton", counted)
    hidden_in = torch.randn(ids.numel(), cfg.hidden_size, device=device).to(model.dtype)
    got = _forward(model, cfg, ids, device, hidden_in)
    n_fused = len(fused_norms)
    with switches.override(fused_sums=False):
        want = _forward(model, cfg, ids, device, hidden_in)
    assert len(fused_norms) == n_fused, "a norm summed a pending sum with HISPARSE_FUSED_SUMS=0"
    return got, want, n_fused


def _assert_bitwise(got, want):
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    # layer 0 dense, 1-2 MoE (o_proj 96 x 64 and the dense down_proj 96 x 192 run split-K
    # with partial sums up to 16 tokens at 16-blocks), one MTP layer; 4 indexer heads (the
    # interpreter runs a program a token and head of the queries' RoPE: 32 heads took a fifth
    # of the test's time, and no sum goes through them)
    path = make_random_checkpoint(tmp_path_factory.mktemp("fused_sums"), "deepseek_v32", seed=3,
                                  index_topk=8, index_n_heads=4, fp8=True, fp8_block=(16, 16),
                                  num_nextn_predict_layers=1)
    # (an FP8 checkpoint is written without MTP tensors: the dummy format draws them all)
    return load_model(path, torch.bfloat16, load_format="dummy", num_mtp_layers=1)


def test_model_forward_fused_sums_bitwise(tiny_fp8, kernel_switches, monkeypatch):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter test")
    model, cfg = tiny_fp8
    kernel_switches(force_triton=True, fp8_gemm="triton")
    # 4 tokens: every split-K and MoE sum path of 8 (up to 16 tokens), at half the interpreter's
    # programs (the GPU test runs 1 to 96 tokens)
    ids = torch.randint(2, cfg.vocab_size, (4,), generator=torch.Generator().manual_seed(1))
    got, want, n_fused = _both(model, cfg, ids, "cpu", monkeypatch)
    _assert_bitwise(got, want)
    # main: 3 post-attention norms (o_proj), the next layers' 2 input norms and the final norm
    # (dense down_proj, MoE combine, MoE combine); MTP: its post-attention norm
    assert n_fused == 3 + 3 + 1, n_fused


def _small_cuda_model(path, seed: int):
    """A small random DSA model on CUDA (FP8 128-blocks, a dense and two MoE layers, one MTP
    layer), dummy weights."""
    path = make_random_checkpoint(path, "deepseek_v32", seed=seed, hidden_size=512,
                                  num_attention_heads=16, num_key_value_heads=16,
                                  q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
                                  v_head_dim=128, intermediate_size=1024,
                                  moe_intermediate_size=256, n_routed_experts=16, n_group=4,
                                  topk_group=2, num_experts_per_tok=8, num_hidden_layers=3,
                                  first_k_dense_replace=1, index_topk=32, fp8=True,
                                  num_nextn_predict_layers=1)
    return load_model(path, torch.bfloat16, "cuda", load_format="dummy", num_mtp_layers=1)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 33, 96])
def test_gpu_model_forward_fused_sums_bitwise(tmp_path_factory, monkeypatch, T):
    """A small random DSA model on CUDA (FP8, 128-blocks, dense + MoE layers, MTP): both switch
    settings give the same bits."""
    model, cfg = _small_cuda_model(tmp_path_factory.mktemp("fused_sums_gpu"), seed=4)
    assert model.finalize_weights_()[1] > 0    # the production path: bf16-pass gates too
    ids = torch.randint(2, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
    got, want, n_fused = _both(model, cfg, ids.cuda(), "cuda", monkeypatch)
    _assert_bitwise(got, want)
    assert n_fused > 0


# ------------------------------------------------------------------ the norms' FP8 rows
def _with_and_without_norm_rows(model, cfg, ids, device, monkeypatch, kernel_launches):
    """``(with, without)`` outputs of the main and MTP forwards: the input and ``q_a`` norms
    quantizing for the projections after them, then not; and how many norm launches made rows
    (``QUANT``)."""
    from hisparse.models import linear

    launches = kernel_launches(_glue_triton, "_add_rms_norm_kernel", "QUANT")
    hidden_in = torch.randn(ids.numel(), cfg.hidden_size, device=device).to(model.dtype)
    got = _forward(model, cfg, ids, device, hidden_in)
    n_rows = sum(launches)
    monkeypatch.setattr(linear, "takes_fp8_rows", lambda *_: False)
    launches.clear()
    want = _forward(model, cfg, ids, device, hidden_in)
    assert not any(launches)
    return got, want, n_rows


def test_model_forward_norm_rows_bitwise(tiny_fp8, kernel_switches, monkeypatch,
                                         kernel_launches):
    """CPU: the wiring (which norm quantizes for which linear, the rows reaching the stacked
    GEMMs). The interpreter's FP8 cast rounds unlike torch's, so here the split-K kernel
    quantizes through its own quantizer both times (``quant="kernel"``, what CUDA runs)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter test")
    from hisparse.models import linear
    from hisparse.ops import _gemm_splitk_triton

    model, cfg = tiny_fp8
    kernel_switches(force_triton=True, fp8_gemm="triton")
    real = _gemm_splitk_triton.fp8_block_linear_splitk
    read = []

    def splitk(*a, quant=None, **kw):
        read.append(kw.get("x_fp8") is not None)
        return real(*a, quant=quant or "kernel", **kw)

    monkeypatch.setattr(_gemm_splitk_triton, "fp8_block_linear_splitk", splitk)
    monkeypatch.setattr(linear, "takes_fp8_rows", lambda rows, *_: 0 < rows <= 512)
    ids = torch.randint(2, cfg.vocab_size, (2,), generator=torch.Generator().manual_seed(2))
    got, want, n_rows = _with_and_without_norm_rows(model, cfg, ids, "cpu", monkeypatch,
                                                    kernel_launches)
    _assert_bitwise(got, want)
    # the input norm and the q_a norm of each of the 3 main layers and the MTP layer; unstacked,
    # q_a_proj and kv_a_proj read the first, q_b_proj the second (wq_b takes the bf16 latent)
    layers = cfg.num_layers + 1
    assert n_rows == 2 * layers, n_rows
    assert sum(read) == 3 * layers, sum(read)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 96])
def test_gpu_model_forward_norm_rows_bitwise(tmp_path_factory, monkeypatch, kernel_launches, T):
    """CUDA: the norms' FP8 rows (the production path) give the bits of the linears
    quantizing their inputs themselves."""
    model, cfg = _small_cuda_model(tmp_path_factory.mktemp("norm_rows_gpu"), seed=5)
    model.finalize_weights_()
    ids = torch.randint(2, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
    got, want, n_rows = _with_and_without_norm_rows(model, cfg, ids.cuda(), "cuda", monkeypatch,
                                                    kernel_launches)
    _assert_bitwise(got, want)
    # each read by one stacked GEMM, where its launch quantizes first (this model's shapes:
    # above 64 rows, splitk_config)
    assert n_rows == (2 * (cfg.num_layers + 1) if T > 64 else 0), n_rows
