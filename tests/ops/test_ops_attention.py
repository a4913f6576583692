
import pytest
import torch

from hisparse.ops import (
    flashmla_available,
    sparse_mla_attention,
    sparse_mla_attention_reference,
    switches,
)


def make(T, H, K, N, dtype, device="cpu", seed=0, empty_rows=(), poison_unused=True):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, 576, generator=g)).to(dtype).to(device)
    kv = torch.randn(N, 576, generator=g).to(dtype)
    idx = torch.randint(0, N // 2, (T, K), generator=g).to(torch.int32)   # rows [0, N/2) only
    idx[torch.rand(T, K, generator=g) < 0.25] = -1
    for t in empty_rows:
        idx[t] = -1
    if poison_unused:
        kv[N // 2:] = float("nan")          # never referenced: must not leak into outputs
    return q, kv.to(device), idx.to(device)


def dense64(q, kv, idx, scale):
    T, H, _ = q.shape
    out = torch.zeros(T, H, 512, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for t in range(T):
        rows = [int(i) for i in idx[t] if i >= 0]
        if not rows:
            continue
        kvr = kv[rows].double().cpu()
        logits = q[t].double().cpu() @ kvr.T * scale             # [H, n]
        m = logits.max(dim=1, keepdim=True).values
        e = torch.exp(logits - m)
        lse[t] = (m.squeeze(1) + torch.log(e.sum(1)))
        out[t] = (e / e.sum(1, keepdim=True)) @ kvr[:, :512]
    return out, lse


def test_reference_matches_float64_dense():
    q, kv, idx = make(4, 6, 50, 200, torch.float32, empty_rows=(2,))
    out, lse = sparse_mla_attention_reference(q, kv, idx, 0.07)
    o64, l64 = dense64(q, kv, idx, 0.07)
    assert out.shape == (4, 6, 512) and lse.dtype == torch.float32
    assert torch.allclose(out.double(), o64, atol=1e-5, rtol=1e-4)
    fin = torch.isfinite(l64)
    assert torch.allclose(lse.double()[fin], l64[fin], atol=1e-5)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()


def test_padding_indices_read_nothing():
    """A -1 pad must contribute nothing even when the row it clamps to holds NaN (a block of
    another request not written yet): the engine's greedy outputs turned into non-finite
    logits errors when a reused block 0 held garbage."""
    q, kv, idx = make(4, 6, 50, 200, torch.float32, empty_rows=(2,))
    idx[idx == 0] = 1
    kv[0] = float("nan")
    out, lse = sparse_mla_attention_reference(q, kv, idx, 0.07)
    o64, _ = dense64(q, kv, idx, 0.07)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), o64, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype,T,H,K", [(torch.float32, 3, 20, 100), (torch.bfloat16, 2, 16, 70),
                                         (torch.float32, 1, 3, 300)])
def test_triton_interpreter_matches_reference(triton_cpu, dtype, T, H, K):
    q, kv, idx = make(T, H, K, 256, dtype, seed=K, empty_rows=(T - 1,) if T > 1 else ())
    out = torch.full((T, H, 512), float("nan"), dtype=dtype)
    lse = torch.full((T, H), float("nan"))
    o, l = sparse_mla_attention(q, kv, idx, 0.05, backend="triton", out=out, lse=lse)
    assert o.data_ptr() == out.data_ptr() and l.data_ptr() == lse.data_ptr()
    assert not torch.isnan(o).any() and not torch.isnan(l).any()
    ro, rl = sparse_mla_attention_reference(q, kv, idx, 0.05)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(o.float(), ro.float(), atol=tol, rtol=tol)
    assert torch.equal(torch.isneginf(l), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert torch.allclose(l[fin], rl[fin], atol=1e-4)


def test_dispatch_cpu_uses_reference(no_force):
    q, kv, idx = make(2, 4, 10, 64, torch.float32)
    o, l = sparse_mla_attention(q, kv, idx, 0.1)
    ro, rl = sparse_mla_attention_reference(q, kv, idx, 0.1)
    assert torch.equal(o, ro) and torch.equal(l, rl)


def _check_close(o, l, ro, rl, flashmla=False):
    assert not torch.isnan(o).any()
    err = (o.float() - ro.float()).abs().max().item()
    assert err < 2e-2, err
    if flashmla:   # FlashMLA's lse of a token with no valid index is +inf (not rewritten)
        assert torch.equal(torch.isinf(l), torch.isinf(rl))
    else:
        assert torch.equal(torch.isneginf(l), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert (l[fin] - rl[fin]).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(64, 16), (64, 128), (3, 16), (257, 64)])
def test_gpu_triton_production_shapes(T, H):
    K, N = 2048, 64 * 2048
    q, kv, idx = make(T, H, K, N, torch.bfloat16, device="cuda", seed=H, empty_rows=(1,))
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((T, H), float("nan"), device="cuda")
    o, l = sparse_mla_attention(q, kv, idx, 576 ** -0.5, backend="triton", out=out, lse=lse)
    ro, rl = sparse_mla_attention_reference(q, kv, idx, 576 ** -0.5)
    _check_close(o, l, ro, rl)


@pytest.mark.gpu
@pytest.mark.skipif(not flashmla_available(), reason="flash_mla not importable")
@pytest.mark.parametrize("T,H", [(64, 16), (64, 128)])
def test_gpu_flashmla_matches_reference(T, H):
    K, N = 2048, 64 * 2048
    q, kv, idx = make(T, H, K, N, torch.bfloat16, device="cuda", seed=H + 1, empty_rows=(1,))
    o, l = sparse_mla_attention(q, kv, idx, 576 ** -0.5, backend="flashmla")
    ro, rl = sparse_mla_attention_reference(q, kv, idx, 576 ** -0.5)
    _check_close(o, l, ro, rl, flashmla=True)


def test_backend_env_is_validated(monkeypatch):
    """``HISPARSE_ATTENTION`` only takes a backend name; anything else is refused, naming it."""
    monkeypatch.setenv("HISPARSE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="HISPARSE_ATTENTION='flash'"):
        switches.reload()


@pytest.mark.gpu
@pytest.mark.skipif(not flashmla_available(), reason="flash_mla not importable")
@pytest.mark.parametrize("T", [8, 42])
def test_gpu_backend_env_forces_flashmla_at_16_heads(T, kernel_switches):
    """At 16 heads "auto" picks Triton; ``HISPARSE_ATTENTION=flashmla`` runs FlashMLA's FP8
    decode (heads padded to 64 per call) with the engine's call (``backend="auto"``), within
    FP8 rounding of the Triton kernel, and ``=triton`` gives the Triton kernel's bits."""
    from hisparse.ops import quantize_mla_rows_reference, sparse_mla_attention_fp8

    K, N = 2048, 64 * 2048
    q, kv, idx = make(T, 16, K, N, torch.bfloat16, device="cuda", seed=T, empty_rows=(1,),
                      poison_unused=False)
    kv8 = quantize_mla_rows_reference(kv, 512)
    scale = 576 ** -0.5
    tri, tri_l = sparse_mla_attention_fp8(q, kv8, idx, scale, backend="triton")
    kernel_switches(attention="flashmla")
    fm, _ = sparse_mla_attention_fp8(q, kv8, idx, scale)
    kernel_switches(attention="triton")
    again, again_l = sparse_mla_attention_fp8(q, kv8, idx, scale)
    assert torch.equal(again, tri) and torch.equal(again_l, tri_l)
    keep = torch.arange(T, device="cuda") != 1                   # row 1 selects nothing
    err = (fm[keep].float() - tri[keep].float()).abs().max().item()
    assert err < 2e-2, err
