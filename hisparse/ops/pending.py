"""A ``[T, D]`` activation whose last reduction has not run yet: :class:`PendingSum`.

Two reductions end in a launch of their own and a bf16 store that only the next RMSNorm reads:
the split-K FP8 GEMM's (:mod:`hisparse.ops._gemm_splitk_triton`: fp32 chunk or group sums
added in a fixed order, rounded once) and the fused MoE layer's combine
(:func:`hisparse.ops.moe_layer.combine`: each token's slot rows added in fp32 in slot order,
rounded once). Both are the same shape of computation: row ``t`` of the output is

    total = 0; for each group g: (gsum = 0; gsum += part[g, j] for j in the group's parts in
    order; total += gsum); out[t] = round(total) (then ``round(out[t] + bias)`` with a bias)

over ``count`` parts (``group`` parts a group) that lie at ``base + t * row_stride + p *
part_stride + d``. A producer that knows its consumer can do this sum (the fused
:func:`hisparse.ops.glue.add_rms_norm`, in the norm's own program: one launch fewer and no
store) returns a :class:`PendingSum` instead of the tensor; any other consumer calls
:meth:`PendingSum.materialize`, which runs the producer's own reduction (today's launch, the
same bits). The norm's kernel repeats the same fp32 additions in the same order and the same
rounding, so the fused result is bitwise the unfused one.

Producers make one only when :func:`fuses_sums` holds (``HISPARSE_FUSED_GLUE=1`` and
``HISPARSE_FUSED_SUMS=1``, Triton) and nothing but the norm sits between (no tensor-parallel
all-reduce). The parts are the producer's ordinary temporaries (the split-K partial buffer, the
MoE down GEMM's rows): a pending sum allocates nothing, it only keeps them alive until its
consumer runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import switches
from ._common import want_triton


def fuses_sums(*tensors: Tensor) -> bool:
    """Whether a producer may hand a :class:`PendingSum` to the next norm: the fused glue
    (``HISPARSE_FUSED_GLUE``) and the fused sums (``HISPARSE_FUSED_SUMS``) on, Triton."""
    s = switches.current()
    return s.fused_glue and s.fused_sums and want_triton(*tensors)


@dataclass(frozen=True, eq=False)
class PendingSum:
    """``[rows, cols]`` in ``dtype``, not yet summed (module doc). ``base``: the parts' storage
    (a float tensor, unit stride along ``cols``); part ``p`` of row ``t`` starts ``t *
    row_stride + p * part_stride`` elements into it; ``group`` parts a group (``count`` for
    one group); ``bias`` (``[cols]``) is added after the rounding and rounded again (as
    ``FP8Linear`` adds it); ``reduce``: the producer's own reduction (no bias), returning the
    ``[rows, cols]`` tensor."""

    base: Tensor
    rows: int
    cols: int
    row_stride: int
    part_stride: int
    count: int
    group: int
    dtype: torch.dtype
    reduce: Callable[[], Tensor] = dataclasses.field(repr=False)
    bias: Tensor | None = None

    def __post_init__(self) -> None:
        if self.count < 1 or not 1 <= self.group <= self.count:
            raise ValueError(f"PendingSum: want 1 <= group <= count, got group={self.group}, "
                             f"count={self.count}")
        if self.base.stride(-1) != 1 or not self.base.is_floating_point():
            raise ValueError("PendingSum: the parts must be a float tensor of unit last stride")
        if self.bias is not None and tuple(self.bias.shape) != (self.cols,):
            raise ValueError(f"PendingSum: bias must be [{self.cols}], got "
                             f"{tuple(self.bias.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def device(self) -> torch.device:
        return self.base.device

    def with_bias(self, bias: Tensor | None) -> PendingSum:
        """The same sum with ``bias`` added after it (``out + bias.to(dtype)``)."""
        if bias is None:
            return self
        if self.bias is not None:
            raise ValueError("PendingSum.with_bias: the sum has a bias already")
        return dataclasses.replace(self, bias=bias)

    def parts(self) -> Tensor:
        """The parts as a ``[rows, count, cols]`` view of ``base``."""
        return self.base.as_strided((self.rows, self.count, self.cols),
                                    (self.row_stride, self.part_stride, 1))

    def materialize(self) -> Tensor:
        """The ``[rows, cols]`` tensor, by the producer's own reduction (its launch, its bits)."""
        out = self.reduce()
        return out if self.bias is None else out + self.bias.to(out.dtype)


def summed(x: Tensor | PendingSum) -> Tensor:
    """``x`` as a tensor: a :class:`PendingSum` materialized (its producer's reduction)."""
    return x.materialize() if isinstance(x, PendingSum) else x


def pending_sum_reference(p: PendingSum) -> Tensor:
    """The sum in torch, the same additions in the same order (the spec :meth:`PendingSum.
    materialize` and the fused norm both follow; torch's fp32 -> ``dtype`` cast rounds to
    nearest even, the CPU interpreter's truncates)."""
    parts = p.parts()
    total = torch.zeros(p.rows, p.cols, device=p.device, dtype=torch.float32)
    for g0 in range(0, p.count, p.group):
        gsum = torch.zeros_like(total)
        for j in range(g0, min(p.count, g0 + p.group)):
            gsum += parts[:, j].float()
        total += gsum
    out = total.to(p.dtype)
    return out if p.bias is None else out + p.bias.to(p.dtype)
