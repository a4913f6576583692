"""Sparse MLA attention (absorbed form, MQA over 576-d latent rows).

For each query token ``t`` and head ``h``, over the valid rows
``R_t = {kv[i] : i in indices[t], i >= 0}``::

    logits = sm_scale * q[t, h] . kv[i]                (576-d dot, fp32 accumulation)
    out[t, h] = softmax(logits) @ kv[i][:d_v]           (d_v = 512: the latent c_kv part)
    lse[t, h] = logsumexp(logits)                       (natural log)

A token with no valid index gives ``out = 0`` and ``lse = -inf``. Same contract as FlashMLA's
``flash_mla_sparse_fwd`` (which returns the same natural-log lse; see ``_flashmla``).
"""

from __future__ import annotations

import functools

import torch

from ._common import want_triton


def sparse_mla_attention_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                                   sm_scale: float, d_v: int = 512):
    """Plain PyTorch spec (fp32 math; any device).
    Returns ``(out [T,H,d_v] q.dtype, lse [T,H] fp32)``."""
    T, H, D = q.shape
    out = torch.zeros((T, H, d_v), dtype=q.dtype, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or indices.shape[1] == 0:
        return out, lse
    n = kv.shape[0]
    step = max(1, (1 << 22) // max(1, indices.shape[1] * D))
    for a in range(0, T, step):
        b = min(T, a + step)
        idx = indices[a:b].long()
        valid = (idx >= 0) & (idx < n)
        rows = kv[idx.clamp(0, max(n - 1, 0))].float()                   # [g, K, D]
        logits = torch.einsum("ghd,gkd->ghk", q[a:b].float(), rows) * sm_scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        l = torch.logsumexp(logits, dim=-1)                                # [g, H]
        empty = ~valid.any(dim=1)                                          # [g]
        p = torch.exp(logits - torch.where(torch.isinf(l), torch.zeros_like(l), l)[..., None])
        o = torch.einsum("ghk,gkd->ghd", p, rows[..., :d_v])
        o = torch.where(empty[:, None, None], torch.zeros_like(o), o)
        out[a:b] = o.to(q.dtype)
        lse[a:b] = torch.where(empty[:, None], torch.full_like(l, float("-inf")), l)
    return out, lse


@functools.cache
def _flashmla_module():
    try:
        import flash_mla  # noqa: F401
        return flash_mla
    except Exception:
        return None


def flashmla_available() -> bool:
    return _flashmla_module() is not None


def _flashmla_supported(q, kv, indices, d_v) -> bool:
    # FlashMLA pads heads to 64: at <= 32 heads the Triton kernel is faster (2.5x at 16 heads on
    # the H200), so "auto" only takes FlashMLA from 33 heads up.
    return (q.is_cuda and q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16
            and q.shape[-1] == 576 and d_v == 512 and 32 < q.shape[1] <= 128
            and torch.cuda.get_device_capability(q.device)[0] in (9, 10))


def _flashmla(q, kv, indices, sm_scale, d_v):
    """FlashMLA ``flash_mla_sparse_fwd``. Pads heads to 64/128 and top-k to a multiple of 128
    (its kernels need both), uses the legacy (SM90) kernels on Hopper, and maps rows with no
    valid index to ``out = 0, lse = -inf`` (FlashMLA's own value there is not our contract)."""
    fm = _flashmla_module()
    T, H, D = q.shape
    hp = 64 if H <= 64 else 128
    if hp != H:
        qp = q.new_zeros((T, hp, D))
        qp[:, :H] = q
    else:
        qp = q.contiguous()
    K = indices.shape[1]
    kp = max(128, -(-K // 128) * 128)
    idx = indices.to(torch.int32)
    if kp != K:
        idx = torch.cat([idx, idx.new_full((T, kp - K), -1)], dim=1)
    legacy = torch.cuda.get_device_capability(q.device)[0] == 9
    out, _max_logits, lse = fm.flash_mla_sparse_fwd(
        qp, kv.view(kv.shape[0], 1, D), idx.view(T, 1, kp).contiguous(), sm_scale, d_v,
        use_legacy=legacy)
    out = out[:, :H]
    lse = lse[:, :H].float()
    empty = ~(indices >= 0).any(dim=1)
    out = torch.where(empty[:, None, None], torch.zeros_like(out), out)
    lse = torch.where(empty[:, None], torch.full_like(lse, float("-inf")), lse)
    return out, lse


def sparse_mla_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                         sm_scale: float, d_v: int = 512, backend: str = "auto",
                         out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """Sparse MLA attention: ``q [T,H,576]``, ``kv [N,576]``, ``indices [T,K]`` int32 (-1 skip).

    Returns ``out [T, H, d_v]`` (q.dtype) and ``lse [T, H]`` fp32 natural log.
    ``backend``: "auto" (FlashMLA if importable, CUDA, bf16 and 33..128 heads; else Triton on CUDA
    or with HISPARSE_FORCE_TRITON=1; else the reference), "triton", "flashmla", "reference".
    ``out``/``lse``: optional preallocated results (written in place and returned).
    """
    if backend == "auto":
        if q.is_cuda and flashmla_available() and _flashmla_supported(q, kv, indices, d_v):
            backend = "flashmla"
        elif want_triton(q, kv):
            backend = "triton"
        else:
            backend = "reference"
    if backend == "triton":
        from ._attention_triton import sparse_mla_attention_triton
        return sparse_mla_attention_triton(q, kv, indices, sm_scale, d_v, out=out, lse=lse)
    if backend == "reference":
        o, l = sparse_mla_attention_reference(q, kv, indices, sm_scale, d_v)
    elif backend == "flashmla":
        if not flashmla_available():
            raise RuntimeError("backend='flashmla' but flash_mla (wheel sgl-flash-mla) does "
                               "not import")
        o, l = _flashmla(q, kv, indices, sm_scale, d_v)
    else:
        raise ValueError(f"unknown backend {backend!r}")
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(l)
        l = lse
    return o, l
