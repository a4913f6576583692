"""Sparse MLA attention (absorbed form, MQA over 576-d latent rows).

For each query token ``t`` and head ``h``, over the valid rows
``R_t = {kv[i] : i in indices[t], i >= 0}``::

    logits = sm_scale * q[t, h] . kv[i]                (576-d dot, fp32 accumulation)
    out[t, h] = softmax(logits) @ kv[i][:d_v]           (d_v = 512: the latent c_kv part)
    lse[t, h] = logsumexp(logits)                       (natural log)

A token with no valid index gives ``out = 0`` and ``lse = -inf`` (the FlashMLA backends return
FlashMLA's own ``lse = +inf`` there: the wrapper adds no per-call op; ``out`` is 0 either way).
Same contract as FlashMLA's ``flash_mla_sparse_fwd`` (the same natural-log lse; see ``_flashmla``).

**FP8 rows**: ``kv`` may be the FP8 byte rows of :mod:`hisparse.ops.quant` (``[N, 656]`` uint8 for
576-d rows); attention is then defined over the dequantized rows
(:func:`sparse_mla_attention_fp8_reference`), the Triton kernel dequantizes in registers, and
FlashMLA's FP8 sparse decode (``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``)
is the optional backend.
"""

from __future__ import annotations

import functools

import torch

from . import switches
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
        # a -1 pad reads row 0, which may be garbage (a block another request has not written
        # yet, NaN): zero it, as the kernels' masked loads do (0 * NaN would poison the sum)
        rows = rows.masked_fill(~valid[..., None], 0.0)
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


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _is_sm90(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] == 9


@functools.cache
def _takes_use_legacy(fn) -> bool:
    import inspect
    try:
        return "use_legacy" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _flashmla_supported(q, kv, indices, d_v) -> bool:
    # FlashMLA pads heads to 64: at <= 32 heads the Triton kernel is faster (2.5x at 16 heads on
    # the H200), so "auto" only takes FlashMLA from 33 heads up.
    return (q.is_cuda and q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16
            and q.shape[-1] == 576 and d_v == 512 and 32 < q.shape[1] <= 128
            and _capability(q.device.index if q.device.index is not None
                            else torch.cuda.current_device())[0] in (9, 10))


def _flashmla(q, kv, indices, sm_scale, d_v):
    """FlashMLA ``flash_mla_sparse_fwd``: no per-call op when heads are 64 or 128 and top-k a
    multiple of 128 (production shapes: pad at allocation); otherwise pads heads to 64/128 and
    top-k to a multiple of 128 (its kernels need both). Legacy (SM90) kernels on Hopper. Rows
    with no valid index: ``out = 0`` and FlashMLA's ``lse = +inf`` (not rewritten per call)."""
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
    legacy = _is_sm90(q.device)
    out, _max_logits, lse = fm.flash_mla_sparse_fwd(
        qp, kv.view(kv.shape[0], 1, D), idx.view(T, 1, kp).contiguous(), sm_scale, d_v,
        use_legacy=legacy)
    if hp != H:
        out, lse = out[:, :H], lse[:, :H]
    return out, lse


def sparse_mla_attention_fp8_reference(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                                       sm_scale: float, d_v: int = 512):
    """Spec of attention over FP8 byte rows ``kv [N, row_bytes]`` uint8: the bf16/fp32
    reference over the dequantized rows (only the referenced rows are dequantized)."""
    from .quant import dequantize_mla_rows_reference

    d_pe = q.shape[-1] - d_v
    n = kv.shape[0]
    valid = (indices >= 0) & (indices < n)
    used, inv = torch.unique(torch.where(valid, indices.long(), -1), return_inverse=True)
    rows = dequantize_mla_rows_reference(kv[used.clamp(min=0)], d_v, d_pe, dtype=q.dtype)
    local = torch.where(valid, inv, -1).to(torch.int32)
    return sparse_mla_attention_reference(q, rows, local, sm_scale, d_v)


def flashmla_sched_meta():
    """A fresh FlashMLA scheduler-metadata object (``get_mla_metadata()[0]``) for
    :func:`sparse_mla_attention_fp8`'s ``sched_meta``: reuse one across the calls of one shape
    (e.g. every layer of a step), as engines do; ``None`` when flash_mla does not import."""
    fm = _flashmla_module()
    return None if fm is None else fm.get_mla_metadata()[0]


def _flashmla_fp8(q, kv, indices, sm_scale, d_v, sched_meta=None):
    """FlashMLA's FP8 sparse decode over 656-B rows: ``flash_mla_with_kvcache(q [T,1,h,576],
    cache [N/64, 64, 1, 656] e4m3 view, None, None, 512, sched, indices=[T,1,K],
    is_fp8_kvcache=True, use_legacy=<SM90>)``; one decode "batch" row per token. Views only when
    heads are 64/128 (else heads are padded to 64/128 per call). ``sched_meta``: a
    ``get_mla_metadata()[0]`` reused across calls of one shape (default: a fresh one)."""
    fm = _flashmla_module()
    T, H, D = q.shape
    hp = 64 if H <= 64 else 128
    if hp != H:
        qp = q.new_zeros((T, hp, D))
        qp[:, :H] = q
    else:
        qp = q if q.is_contiguous() else q.contiguous()
    N, rb = kv.shape
    page = 64 if N % 64 == 0 else 1
    cache = kv.view(torch.float8_e4m3fn).view(N // page, page, 1, rb)
    idx = indices if indices.dtype == torch.int32 else indices.to(torch.int32)
    K = idx.shape[1]
    meta = sched_meta if sched_meta is not None else fm.get_mla_metadata()[0]
    kw = {"use_legacy": _is_sm90(q.device)} if _takes_use_legacy(fm.flash_mla_with_kvcache) else {}
    out, lse = fm.flash_mla_with_kvcache(qp.view(T, 1, hp, D), cache, None, None, d_v, meta,
                                         softmax_scale=sm_scale, is_fp8_kvcache=True,
                                         indices=idx.contiguous().view(T, 1, K), **kw)
    out = out.view(T, hp, d_v)
    lse = lse.view(T, hp)
    if hp != H:
        out, lse = out[:, :H], lse[:, :H]
    return out, lse


def _finish(o, l, out, lse):
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(l)
        l = lse
    return o, l


def sparse_mla_attention_fp8(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                             sm_scale: float, d_v: int = 512, backend: str = "auto",
                             out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                             sched_meta=None):
    """Sparse MLA attention over FP8 byte rows ``kv [N, row_bytes]`` uint8 (quant.py layout).

    ``backend``: "auto" (Triton on CUDA or with HISPARSE_FORCE_TRITON=1, else the reference),
    "triton", "flashmla", "reference". "auto" never picks FlashMLA's FP8 decode: its split
    schedule follows the batch size, so a token's output depends on the batch it runs in
    (measured on the H200: a token alone and inside a batch of 8 or 24 differ), which breaks
    the lossless contract (a run that spills batches differently). The Triton kernel's
    chunking depends on the head and index counts only.
    """
    return _dispatch(q, kv, indices, sm_scale, d_v, backend, out, lse,
                     flashmla_ok=None,
                     triton="sparse_mla_attention_fp8_triton",
                     reference=sparse_mla_attention_fp8_reference,
                     flashmla=lambda *a: _flashmla_fp8(*a, sched_meta))


def sparse_mla_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                         sm_scale: float, d_v: int = 512, backend: str = "auto",
                         out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """Sparse MLA attention: ``q [T,H,576]``, ``kv [N,576]``, ``indices [T,K]`` int32 (-1 skip).

    Returns ``out [T, H, d_v]`` (q.dtype) and ``lse [T, H]`` fp32 natural log.
    ``backend``: "auto" (FlashMLA if importable, CUDA, bf16 and 33..128 heads; else Triton on CUDA
    or with HISPARSE_FORCE_TRITON=1; else the reference), "triton", "flashmla", "reference".
    ``out``/``lse``: optional preallocated results (written in place and returned).
    ``kv`` uint8: FP8 byte rows, dispatched to :func:`sparse_mla_attention_fp8`.
    """
    if kv.dtype == torch.uint8:
        return sparse_mla_attention_fp8(q, kv, indices, sm_scale, d_v, backend, out, lse)
    return _dispatch(q, kv, indices, sm_scale, d_v, backend, out, lse,
                     flashmla_ok=_flashmla_supported, triton="sparse_mla_attention_triton",
                     triton_ok=_triton_supported, reference=sparse_mla_attention_reference,
                     flashmla=_flashmla)


def _triton_supported(q, d_v) -> bool:
    """The bf16 Triton kernel is written for DeepSeek's latent: d_qk = 576, d_v = 512."""
    return q.shape[-1] == 576 and d_v == 512


def _auto_override(q) -> str:
    """``HISPARSE_ATTENTION`` (CUDA calls with ``backend="auto"``, what the engine passes):
    ``triton`` or ``flashmla`` forces that backend (e.g. FlashMLA at 16 heads, padded to 64
    per call), ``auto`` (default) keeps the automatic choice. Read at engine start like the
    other ``HISPARSE_*`` switches (:mod:`hisparse.ops.switches`).

    ``flashmla`` is a measurement switch, not a serving one. Its FP8 decode is not batch
    invariant (the H200 diagnostic of docs/BENCHMARKS.md, "Batch-invariant sparse attention":
    bitwise equal when rows move or the cache view changes, unequal when the batch size
    changes or ``-1`` holes move), which is why the engine's FP8 lossless tests failed with it;
    it also reads out of bounds for indices >= N where Triton skips them, and asserts on
    top-k sizes that are not a multiple of its block."""
    return switches.current().attention if q.is_cuda else "auto"


def _dispatch(q, kv, indices, sm_scale, d_v, backend, out, lse, *, flashmla_ok, triton,
              reference, flashmla, triton_ok=None):
    """Pick the backend ("auto": ``HISPARSE_ATTENTION`` if set, else FlashMLA when importable
    and ``flashmla_ok`` (``None``: never), else Triton where it applies (``triton_ok(q, d_v)``,
    default any shape), else the reference) and run one row format's implementation of it.
    ``triton`` names the function in ``_attention_triton`` (imported only when used: Triton is
    optional)."""
    if backend == "auto":
        backend = _auto_override(q)
    if backend == "auto":
        if (q.is_cuda and flashmla_ok is not None and flashmla_available()
                and flashmla_ok(q, kv, indices, d_v)):
            backend = "flashmla"
        elif want_triton(q, kv) and (triton_ok is None or triton_ok(q, d_v)):
            backend = "triton"
        else:
            backend = "reference"
    if backend == "triton":
        from . import _attention_triton
        return getattr(_attention_triton, triton)(q, kv, indices, sm_scale, d_v, out=out,
                                                  lse=lse)
    if backend == "reference":
        o, l = reference(q, kv, indices, sm_scale, d_v)
    elif backend == "flashmla":
        if not flashmla_available():
            raise RuntimeError("backend='flashmla' but flash_mla (wheel sgl-flash-mla) does "
                               "not import")
        o, l = flashmla(q, kv, indices, sm_scale, d_v)
    else:
        raise ValueError(f"unknown backend {backend!r}")
    return _finish(o, l, out, lse)
