"""The block-scaled FP8 format of weights and activations (DeepSeek / transformers "fine-grained
FP8"), in plain PyTorch: the spec the FP8 GEMM (:mod:`hisparse.ops.gemm`), the fused MoE and
their Triton kernels share (importing it loads no Triton).

Weights ``w [..., N, K]`` float8_e4m3fn with ``scale_inv [..., ceil(N/bn), ceil(K/bk)]`` fp32
(``W = w * scale_inv`` per ``bn x bk`` block); activations per ``1 x bk`` tile of each row:
``s = max(amax, 1e-12) / 448``, ``q = float8_e4m3fn(x / s)`` (DeepSeek's ``act_quant``); with
``pow2_scale`` (``scale_fmt: ue8m0``) ``s`` is rounded up to a power of two from its exponent bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import cdiv

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``>= s`` for positive normal fp32 ``s`` (from the exponent bits)."""
    bits = s.float().contiguous().view(torch.int32)
    exp = bits & 0x7F800000
    return torch.where((bits & 0x007FFFFF) == 0, exp, exp + 0x00800000).view(torch.float32)


def quantize_fp8_act(x: torch.Tensor, block_k: int = 128, pow2_scale: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per ``1 x block_k`` tile: ``x [M, K]`` -> ``(q [M, K] float8_e4m3fn,
    s [M, ceil(K/bk)] fp32)`` with ``x ~= q * s`` (the last tile may be partial)."""
    M, K = x.shape
    kb = cdiv(K, block_k)
    xf = x.float()
    if kb * block_k != K:
        xf = torch.nn.functional.pad(xf, (0, kb * block_k - K))
    xf = xf.view(M, kb, block_k)
    s = xf.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    if pow2_scale:
        s = pow2_ceil(s)
    q = (xf / s[..., None]).to(FP8_DTYPE).view(M, kb * block_k)[:, :K]
    return q, s


@dataclass(frozen=True, eq=False)
class FP8Rows:
    """Activation rows ``x [M, K]`` already quantized as :func:`quantize_fp8_act` specifies, by
    the kernel that wrote ``x`` (:func:`hisparse.ops.glue.add_rms_norm` with ``fp8_rows``):
    ``q [M, K]`` float8_e4m3fn and ``scale [M, ceil(K / block_k)]`` fp32, both row-contiguous,
    power-of-two scales when ``pow2_scale``. An FP8 linear reading ``x`` takes them instead of
    quantizing ``x`` again (:func:`hisparse.ops.gemm.fp8_block_linear`'s ``x_fp8``): the same
    values, one launch fewer."""

    q: torch.Tensor
    scale: torch.Tensor
    block_k: int
    pow2_scale: bool

    def fits(self, x: torch.Tensor, block_k: int, pow2_scale: bool) -> bool:
        """Whether these rows have ``x``'s shape and device in the format a linear with
        ``block_k`` and ``pow2_scale`` quantizes to (that they were made from ``x`` is the
        producer's word: the shape cannot tell)."""
        return (self.block_k == block_k and self.pow2_scale == pow2_scale and x.dim() == 2
                and tuple(self.q.shape) == tuple(x.shape) and self.q.dtype == FP8_DTYPE
                and self.scale.dtype == torch.float32 and self.q.device == x.device
                and self.scale.device == x.device
                and tuple(self.scale.shape) == (x.shape[0], cdiv(x.shape[1], block_k))
                and self.q.is_contiguous() and self.scale.is_contiguous())


def dequantize_fp8_act(q: torch.Tensor, s: torch.Tensor, block_k: int = 128) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_act` in fp32."""
    return q.float() * s.repeat_interleave(block_k, dim=1)[:, : q.shape[1]]


def quantize_fp8_weight(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(float8_e4m3fn [..., N, K],
    scale_inv fp32 [..., ceil(N/bn), ceil(K/bk)])``: per block
    ``scale_inv = amax / 448`` (1 for an all-zero block), as DeepSeek's checkpoints."""
    bn, bk = block
    *lead, N, K = w.shape
    nb, kb = cdiv(N, bn), cdiv(K, bk)
    wf = w.float()
    wf = torch.nn.functional.pad(wf, (0, kb * bk - K, 0, nb * bn - N))
    wf = wf.reshape(*lead, nb, bn, kb, bk)
    amax = wf.abs().amax(dim=(-3, -1))                                     # [..., nb, kb]
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / s[..., :, None, :, None]).to(FP8_DTYPE).reshape(*lead, nb * bn, kb * bk)
    return q[..., :N, :K].contiguous(), s.contiguous()


def dequantize_fp8_weight(w: torch.Tensor, scale_inv: torch.Tensor,
                          block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """``w [..., N, K]`` FP8 + ``scale_inv [..., nb, kb]`` -> fp32 ``[..., N, K]``."""
    N, K = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return w.float() * s[..., :N, :K]
