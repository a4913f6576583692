"""Block-scaled FP8 GEMM (DeepSeek / transformers "fine-grained FP8" format).

Weights: ``w [N, K]`` float8_e4m3fn with ``w_scale_inv [ceil(N/bn), ceil(K/bk)]`` float32
(``W = w * scale_inv`` per ``bn x bk`` block; DeepSeek: ``bn = bk = 128``). Activations are
quantized on the fly per ``1 x bk`` tile of each row: ``s = max(amax, 1e-12) / 448``,
``q = float8_e4m3fn(x / s)`` (DeepSeek's ``act_quant``); with ``pow2_scale`` (checkpoints with
``scale_fmt: ue8m0``, e.g. DeepSeek-V3.1/V3.2) ``s`` is rounded up to a power of two exactly as
DeepSeek's kernels do (exponent bits, no log2). ``y = x @ W^T`` accumulated in fp32.

Backends (``backend=`` or the env var ``HISPARSE_FP8_GEMM``; default ``auto``):

- ``reference``: dequantize the weight and matmul in fp32 (activations *not* quantized unless
  ``quantize_input=True``); the spec, any device. CPU models run this.
- ``triton`` (the default on CUDA): up to ``BATCH_INVARIANT_MAX_M`` (512) rows the split-K
  kernel (:func:`_gemm_splitk_triton.fp8_block_linear_splitk`): weight rows on the MMA's tall
  side, tokens on its narrow side; K cut into chunks whose count comes from the weight shape
  only (about 512 programs a launch, several per SM streaming at once), the chunk sums added
  in chunk order (in registers, or by a small reduction launch: no counters, nothing kept
  between calls), so a row's result does not depend on M or on the launch configuration
  chosen from M (batch invariant, the lossless contract). Activations quantized in the K loop
  (the next block's loaded a step ahead), or by one Triton launch first for many rows, bitwise
  the same. Larger M (prefill): the tile kernel.
- ``triton_stream``: the previous decode kernel (:func:`_gemm_triton.fp8_block_linear_stream`;
  about one program per SM, last-arrival split-K reduction through module-global counters),
  batch invariant too; kept as the same-run baseline (``HISPARSE_FP8_GEMM=triton_stream``).
- ``triton_tile``: the tile kernel (:func:`_gemm_triton.fp8_block_linear_triton`) for every
  M, activation quantization fused (bf16 ``x`` read directly); 64-row tiles and K splits fixed
  up to 512 rows (batch invariant too). The engine's kernel before the stream kernel.
- ``scaled_mm``: ``torch._scaled_mm`` with (BlockWise1x128, BlockWise128x128) scaling
  (cuBLAS, SM90, bk = bn = 128 only), activations quantized by :func:`quantize_fp8_act`.
  Probed once per (device, shape class) outside graph capture; falls back to Triton if cuBLAS
  refuses the call. Not batch invariant: cuBLASLt picks its algorithm (tiles, split-K) per M.
- ``auto``: Triton on CUDA (or with HISPARSE_FORCE_TRITON=1), reference otherwise.

Batch invariance up to 512 rows (a row's bits do not depend on the other rows of its step):
``triton``, ``triton_stream`` and ``triton_tile`` keep it (GPU-tested bitwise); ``scaled_mm``
does not promise it (cuBLASLt's algorithm, tiles and split-K follow M), nor does ``reference``
(fp32 BLAS).
DeepGEMM (``sgl-deep-gemm`` 0.2.5, the kernels vLLM and SGLang use) is not a backend: its
wheel's ``_C.so`` is built against torch 2.13 and needs symbols torch 2.11 does not export
(``c10::cuda::c10_cuda_check_implementation`` with an error-log argument,
``torch::Library::_def`` with ``headeronly::Tag``, ...), so it does not load there.

No backend syncs with the host: all are CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from . import switches
from ._common import cdiv, triton_available, want_triton
from .block_fp8 import (
    FP8_DTYPE,
    FP8Rows,
    dequantize_fp8_act,
    dequantize_fp8_weight,
    quantize_fp8_act,
)
from .block_fp8 import pow2_ceil as pow2_ceil  # the format's helpers, public here too
from .block_fp8 import quantize_fp8_weight as quantize_fp8_weight
from .pending import PendingSum


# ----------------------------------------------------------------------------- GEMM
def _splitk_max_m() -> int:
    from ._gemm_triton import BATCH_INVARIANT_MAX_M

    return BATCH_INVARIANT_MAX_M


def fp8_block_linear_reference(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                               block: tuple[int, int] = (128, 128), *,
                               quantize_input: bool = False, pow2_scale: bool = False,
                               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K] @ dequant(w)^T`` in fp32 (``quantize_input``: through the per-tile activation
    quantization the fast paths apply). Returns ``out_dtype`` (default ``x.dtype``)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xf = dequantize_fp8_act(*quantize_fp8_act(x2, block[1], pow2_scale), block[1]) \
        if quantize_input else x2.float()
    y = xf @ dequantize_fp8_weight(w, w_scale_inv, block).t()
    return y.to(out_dtype or x.dtype).reshape(*lead, w.shape[0])


def _backend(backend: str | None) -> str:
    if not backend:
        return switches.current().fp8_gemm
    if backend not in switches.FP8_GEMM_BACKENDS:
        raise ValueError(f"backend={backend!r}: want one of {switches.FP8_GEMM_BACKENDS} (the "
                         "values of HISPARSE_FP8_GEMM)")
    return backend


_SCALED_MM_OK: dict[tuple, bool] = {}


def _scaled_mm_call(x2: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                    out_dtype: torch.dtype, pow2_scale: bool = False) -> torch.Tensor:
    q, s = quantize_fp8_act(x2, 128, pow2_scale)
    # cuBLAS block scaling wants the 1x128 scales M-major ("outer-dim-major") and b column-major.
    s = s.t().contiguous().t()
    return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=w_scale_inv.t(), out_dtype=out_dtype)


def _scaled_mm_usable(x2: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                      block: tuple[int, int], out_dtype: torch.dtype) -> bool:
    if not x2.is_cuda or tuple(block) != (128, 128) or not hasattr(torch, "_scaled_mm"):
        return False
    if x2.shape[0] % 16:
        # cuBLASLt's 1x128 x 128x128 block scaling has no algorithm for M = 1 (H200, CUDA 13:
        # CUBLAS_STATUS_NOT_SUPPORTED); M = 16, 64, 256 ran. Other M go to the Triton kernel.
        return False
    N, K = w.shape
    if N % 128 or K % 128 or out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    key = (x2.device, N, K, out_dtype)
    ok = _SCALED_MM_OK.get(key)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return False  # never probe inside a capture; the eager warm-up probes first
        try:
            probe = torch.randn(16, K, device=x2.device, dtype=torch.bfloat16)
            got = _scaled_mm_call(probe, w, w_scale_inv, torch.float32)
            want = fp8_block_linear_reference(probe, w, w_scale_inv, block, quantize_input=True,
                                              out_dtype=torch.float32)
            ok = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()))
        except (RuntimeError, TypeError, ValueError):
            ok = False
        _SCALED_MM_OK[key] = ok
    return ok


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                     block: tuple[int, int] = (128, 128), *, backend: str | None = None,
                     out_dtype: torch.dtype | None = None, pow2_scale: bool = False,
                     pending: bool = False, x_fp8: FP8Rows | None = None
                     ) -> torch.Tensor | PendingSum:
    """``y = x @ (w * scale_inv)^T`` for ``x [..., K]`` (bf16/fp16/fp32), FP8 block-scaled ``w
    [N, K]``; fp32 accumulation, output ``out_dtype`` (default ``x.dtype``). See the module doc
    for the backends (the fast ones quantize ``x`` per 1 x bk tile). ``pending``: where the
    split-K kernel runs with partial sums, ``y`` as a :class:`~hisparse.ops.pending.PendingSum`
    of them (its reduction not launched: for the fused norm); every other path returns the
    tensor.

    Or ``x [M, G, K // G]`` (3-D, last dim not ``K``): row ``m`` is ``x[m]`` flattened, output
    ``[M, N]``; the attention's per-head output ``[T, H, v_head]`` as the ``w_uv`` product
    leaves it (heads strided). The split-K kernel reads it in place when ``K // G`` is a
    multiple of ``bk`` (bitwise the flattened copy's result); every other path flattens it.

    ``x_fp8``: ``x`` (2-D) already quantized by the kernel that wrote it (:class:`~hisparse.ops.
    block_fp8.FP8Rows`, e.g. the norm before this linear): the split-K kernel reads it instead
    of quantizing ``x`` (the same values: the same bits, one launch fewer where it would have
    quantized first); every other path, or rows in another format, quantize ``x`` as always."""
    if w.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_block_linear: weight must be float8_e4m3fn, got {w.dtype}")
    N, K = w.shape
    split = x.dim() == 3 and x.shape[-1] != K and x.shape[1] * x.shape[2] == K
    if x.shape[-1] != K and not split:
        raise ValueError(f"fp8_block_linear: x has {x.shape[-1]} features, weight expects {K}")
    bn, bk = block
    if tuple(w_scale_inv.shape) != (cdiv(N, bn), cdiv(K, bk)):
        raise ValueError(f"fp8_block_linear: weight_scale_inv shape {tuple(w_scale_inv.shape)} "
                         f"!= ({cdiv(N, bn)}, {cdiv(K, bk)}) for weight {(N, K)} block {block}")
    out_dtype = out_dtype or x.dtype
    b = _backend(backend)
    if b == "auto":
        b = "triton" if want_triton(x) else "reference"
    in_place = split and b == "triton" and 0 < x.shape[0] <= _splitk_max_m()
    if split and not in_place:
        x = x.reshape(x.shape[0], K)
    if b == "reference" or x.numel() == 0:
        return fp8_block_linear_reference(x, w, w_scale_inv, block, out_dtype=out_dtype)
    lead = x.shape[:1] if in_place else x.shape[:-1]
    x2 = x if in_place else x.reshape(-1, K)
    if b == "scaled_mm" and _scaled_mm_usable(x2, w, w_scale_inv, block, out_dtype):
        return _scaled_mm_call(x2, w, w_scale_inv, out_dtype, pow2_scale).reshape(*lead, N)
    from ._gemm_triton import (
        BATCH_INVARIANT_MAX_M,
        fp8_block_linear_stream,
        fp8_block_linear_triton,
    )
    if b in ("triton", "triton_stream") and x2.shape[0] <= BATCH_INVARIANT_MAX_M:
        if b == "triton":
            from ._gemm_splitk_triton import fp8_block_linear_splitk
            pre = x_fp8 if x_fp8 is not None and x_fp8.fits(x2, bk, pow2_scale) else None
            y = fp8_block_linear_splitk(x2, w, w_scale_inv, block, out_dtype,
                                        pow2_scale=pow2_scale,
                                        pending=pending and (x.dim() == 2 or in_place),
                                        x_fp8=pre)
            if isinstance(y, PendingSum):
                return y
        else:
            y = fp8_block_linear_stream(x2, w, w_scale_inv, block, out_dtype,
                                        pow2_scale=pow2_scale)
    else:
        y = fp8_block_linear_triton(x2, w, w_scale_inv, block, out_dtype, pow2_scale=pow2_scale)
    return y.reshape(*lead, N)


def takes_fp8_rows(rows: int, device: torch.device, weight_shape: tuple[int, int],
                   block: tuple[int, int] = (128, 128)) -> bool:
    """Whether an FP8 linear with a weight of ``weight_shape`` on ``rows`` rows on ``device``
    is worth handing :class:`~hisparse.ops.block_fp8.FP8Rows` of its input, made by the norm
    that writes the input: the split-K kernel on CUDA (backend ``triton``, up to the
    batch-invariant M) whose launch for these rows quantizes the input in a kernel of its own
    first (``SplitKConfig.quant == "kernel"``; where it quantizes in its K loop, at few rows,
    the rows would save no launch). (On CPU the interpreter's FP8 cast rounds unlike torch's,
    which quantizes the activations there.)"""
    if not (torch.device(device).type == "cuda" and _backend(None) in ("triton", "auto")
            and triton_available() and 0 < rows <= _splitk_max_m()):
        return False
    from ._gemm_splitk_triton import quantizes_first

    N, K = weight_shape
    return quantizes_first(rows, N, K, block[1])


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, pending: bool = False
                ) -> torch.Tensor | PendingSum:
    """``x [T, K] @ weight [N, K]^T`` in fp32 (the linears transformers keeps in fp32: the
    indexer's ``weights_proj``), output ``[T, N]`` fp32; ``x`` and ``weight`` both fp32, or
    both bf16 (a weight whose values are bf16 stored so: every product exact either way).
    With Triton (CUDA, or forced): fixed K-split partials summed in split order
    (:func:`_gemm_splitk_triton.fp32_linear_splitk`: tf32x3 products on CUDA, one bf16 MMA
    pass for bf16 operands), so a row's result does not depend on the batch; ``pending``
    returns the partials as a :class:`~hisparse.ops.pending.PendingSum` for a consumer that
    sums them (the FP8 indexer query kernel). Otherwise ``F.linear`` over fp32 operands
    (torch's fp32 GEMM)."""
    if (x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype
            or x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]):
        raise ValueError(f"fp32_linear: x [T, K] and weight [N, K] must be both fp32 or both "
                         f"bf16, got {tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if not want_triton(x, weight):
        return torch.nn.functional.linear(x.float(), weight.float())
    from ._gemm_splitk_triton import fp32_linear_splitk
    x = x if x.stride(1) == 1 else x.contiguous()
    return fp32_linear_splitk(x, weight.contiguous(), defer=pending)
