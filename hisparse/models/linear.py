"""The model's linears: :class:`FP8Linear` (DeepSeek's block-scaled FP8 weights),
:func:`make_linear` (FP8 or ``nn.Linear`` by the checkpoint), and :class:`StackedLinears`
(linears that read the same input run as one GEMM).

Why stack: at decode sizes a TP-8 rank's linears are short (1-100 tokens) and many (six per
attention layer), so each launch's fixed cost (ramp-up, tail, the split-K reduction launch)
is a large part of its time; ``q_a_proj``, the indexer's ``wk`` and ``kv_a_proj_with_mqa`` all
read the attention norm's output, and ``q_b_proj`` and the indexer's ``wq_b`` both read the
``q_a`` latent, so two launches (plus reductions) do the work of five.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..ops.block_fp8 import FP8Rows
from ..ops.gemm import FP8_DTYPE, cdiv, fp8_block_linear, takes_fp8_rows
from ..ops.pending import PendingSum
from .config import DSAConfig


class FP8Linear(nn.Module):
    """``y = x @ (weight * weight_scale_inv)^T (+ bias)`` with a float8_e4m3fn ``weight
    [out, in]`` and fp32 ``weight_scale_inv [ceil(out/bn), ceil(in/bk)]`` (DeepSeek / transformers
    fine-grained FP8 names); activations quantized per 1 x bk tile by the fast backends."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block: tuple[int, int] = (128, 128), pow2_scale: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, tuple(block)
        self.pow2_scale = pow2_scale
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.ones(cdiv(out_features, block[0]), cdiv(in_features, block[1]),
                       dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: Tensor, x_fp8: FP8Rows | None = None) -> Tensor:
        """``x_fp8``: ``x`` already quantized (:attr:`input_format`), e.g. by the norm that
        wrote it; read where the kernel takes it, else ``x`` is quantized as always."""
        y = fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block,
                             pow2_scale=self.pow2_scale, x_fp8=x_fp8)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @property
    def input_format(self) -> tuple[int, bool]:
        """``(block_k, pow2_scale)``: how this linear quantizes its input (the
        :class:`~hisparse.ops.block_fp8.FP8Rows` it reads)."""
        return self.block[1], self.pow2_scale

    def forward_pending(self, x: Tensor) -> Tensor | PendingSum:
        """:meth:`forward` of ``x [M, in]``, or, where the split-K kernel runs with partial
        sums, its :class:`~hisparse.ops.pending.PendingSum` (bias included): for an RMSNorm
        that does the sum itself (:func:`hisparse.ops.glue.add_rms_norm`). Called directly,
        not through ``nn.Module.__call__``: forward hooks on this linear do not see it."""
        y = fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block,
                             pow2_scale=self.pow2_scale, pending=True)
        if isinstance(y, PendingSum):
            return y.with_bias(self.bias)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={self.block}, bias={self.bias is not None}")


def fp8_input_format(lin: nn.Module | StackedLinears | None, rows: int, device: torch.device
                     ) -> tuple[int, bool] | None:
    """``(block_k, pow2_scale)`` when ``lin`` (an :class:`FP8Linear` or an FP8 stack) would read
    :class:`~hisparse.ops.block_fp8.FP8Rows` of its ``rows``-row input on ``device``
    (:func:`hisparse.ops.gemm.takes_fp8_rows`), for the norm writing that input to make them;
    else None."""
    if isinstance(lin, StackedLinears):
        lin = lin.linear if lin.fp8 else None
    if not isinstance(lin, FP8Linear):
        return None
    if not takes_fp8_rows(rows, device, tuple(lin.weight.shape), lin.block):
        return None
    return lin.input_format


def apply_linear(lin: nn.Module, x: Tensor, x_fp8: FP8Rows | None = None) -> Tensor:
    """``lin(x)``, handing an :class:`FP8Linear` the rows ``x_fp8`` of ``x`` when given."""
    if x_fp8 is not None and isinstance(lin, FP8Linear):
        return lin(x, x_fp8)
    return lin(x)


def make_linear(cfg: DSAConfig, in_features: int, out_features: int, bias: bool = False
                ) -> nn.Module:
    """An :class:`FP8Linear` for FP8 checkpoints, ``nn.Linear`` otherwise."""
    if cfg.fp8_block is not None:
        return FP8Linear(in_features, out_features, bias, cfg.fp8_block, cfg.fp8_pow2_act_scale)
    return nn.Linear(in_features, out_features, bias=bias)


def _stack_reason(parts: Sequence[nn.Module]) -> str | None:
    """Why ``parts`` cannot be stacked (None: they can)."""
    if len(parts) < 2:
        return "fewer than two linears"
    first = parts[0]
    kind = type(first)
    if kind not in (FP8Linear, nn.Linear) or any(type(p) is not kind for p in parts):
        return "not all FP8Linear or all nn.Linear"
    if any(p.in_features != first.in_features for p in parts):
        return "different input sizes"
    if len({p.weight.dtype for p in parts}) > 1 or len({p.weight.device for p in parts}) > 1:
        return "different weight dtypes or devices"
    if len({p.bias is None for p in parts}) > 1:
        return "some with a bias, some without"
    if kind is FP8Linear:
        if len({(p.block, p.pow2_scale) for p in parts}) > 1:
            return "different FP8 blocks or activation scale formats"
        if any(p.out_features % p.block[0] for p in parts[:-1]):
            return "an output size off the scale blocks (only the last part may end mid block)"
    return None


class StackedLinears:
    """Linears ``parts`` that read the same input, run as one GEMM over their weights stacked
    along the output dim (FP8: the block scales stacked too, so every part but the last must
    end on a scale block). ``__call__(x [..., K])`` returns one view per part, ``[..., N_i]``
    (rows strided by ``sum N_i``).

    Numerics: the same math as the separate linears, not the same bits: the FP8 split-K
    kernel's K plan follows the weight shape (``splitk_plan(N, K)``), so a stacked part sums
    its K chunks in another grouping than it would alone. Rows stay batch invariant (the
    plan never depends on M). Under ``HISPARSE_FP8_GEMM=scaled_mm`` a stack whose N is not a
    multiple of 128 (``[q_a | wk | kv_a]``: 2240) runs the Triton kernel, where its parts
    alone might have used cuBLAS.

    The parts' parameters become views of the stacked tensors: they keep their names and
    loading into them (``copy_``) still reaches the GEMM. Build it once the weights are final
    (loaded, sharded, cast): a later ``.to()``, cast or re-assignment of a part's parameter
    breaks the aliasing (:meth:`aliased` says whether it holds; the model runner checks it,
    and sharding or casting a stacked model is refused). Not an ``nn.Module``: the stacked
    tensors are not registered, so ``state_dict`` names stay the checkpoint's."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        reason = _stack_reason(parts)
        if reason is not None:
            raise ValueError(f"StackedLinears: cannot stack {len(parts)} linears: {reason}")
        first = parts[0]
        self.sizes = tuple(p.out_features for p in parts)
        self.fp8 = isinstance(first, FP8Linear)
        # one linear of the parts' kind over the stacked tensors runs the GEMM (its forward,
        # bias included); built on meta, so nothing is allocated twice
        with torch.device("meta"):
            self.linear = (FP8Linear(first.in_features, sum(self.sizes), first.bias is not None,
                                     first.block, first.pow2_scale) if self.fp8
                           else nn.Linear(first.in_features, sum(self.sizes),
                                          first.bias is not None))
        names = ("weight", "bias") + (("weight_scale_inv",) if self.fp8 else ())
        for name in names:
            if getattr(first, name) is None:
                continue
            stacked = torch.cat([getattr(p, name).data for p in parts])
            setattr(self.linear, name, nn.Parameter(stacked, requires_grad=False))
            row = 0
            for p in parts:
                t = getattr(p, name)
                t.data = stacked[row:row + t.shape[0]]
                row += t.shape[0]
        self._parts = list(parts)

    @property
    def weight(self) -> Tensor:
        return self.linear.weight

    @property
    def bias(self) -> Tensor | None:
        return self.linear.bias

    @property
    def scale_inv(self) -> Tensor | None:
        return self.linear.weight_scale_inv if self.fp8 else None

    @staticmethod
    def can_stack(parts: Sequence[nn.Module]) -> bool:
        return _stack_reason(parts) is None

    def aliased(self) -> bool:
        """Every part's parameters (weight, FP8 scales, bias) are still views of the stacked
        tensors."""
        def same(t: Tensor | None, stacked: Tensor | None) -> bool:
            if stacked is None:
                return t is None
            return t is not None and (t.untyped_storage().data_ptr()
                                      == stacked.untyped_storage().data_ptr())

        return all(same(p.weight, self.weight) and same(p.bias, self.bias)
                   and (not self.fp8 or same(p.weight_scale_inv, self.scale_inv))
                   for p in self._parts)

    def __call__(self, x: Tensor, x_fp8: FP8Rows | None = None) -> tuple[Tensor, ...]:
        """``x_fp8`` (FP8 stacks): ``x`` already quantized, as :meth:`FP8Linear.forward`."""
        y = self.linear(x, x_fp8) if self.fp8 else self.linear(x)
        return y.split(self.sizes, dim=-1)
