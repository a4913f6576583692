"""The two formats of the KV caches (``kv_cache_dtype``), one object each, picked once from the
cache geometry (:func:`kv_format`): how a forward's new MLA rows and indexer keys given as
tensors are written, and which sparse attention reads the rows.

``D`` = kv_lora_rank + rope (576 in production), ``R`` = kv_lora_rank (512). Writes take flat
row ids int64 ``[T]``; attention takes ``rows [T, K]`` int32 (``-1`` skipped) and queries
``q [T, H, D]`` and returns ``[T, H, R]``. Rows given as
:class:`~hisparse.models.context.NewRows` / ``NewKeys`` write themselves (one fused kernel
serves both formats) and never come here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from hisparse import ops
from hisparse.ops import switches
from hisparse.ops.attention import flashmla_sched_meta


class KVFormat(ABC):
    """One cache format. ``attention`` runs on the device's backend (``"auto"`` on CUDA, the
    reference elsewhere); ``dtype`` is the compute (model) dtype."""

    def __init__(self, kv_lora_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.dtype = dtype
        self.cuda = device.type == "cuda"
        self.backend = "auto" if self.cuda else "reference"

    @abstractmethod
    def write_rows(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        """Row ``rows[t]`` of ``dst`` (one layer's rows) = ``new[t]`` (``new [T, D]`` float)."""

    @abstractmethod
    def write_keys(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        """Key of flat row ``rows[t]`` of ``dst`` (one layer's keys) = ``new[t]`` (``[T, Di]``)."""

    @abstractmethod
    def attention(self, q: Tensor, kv: Tensor, rows: Tensor, sm_scale: float,
                  sched_meta=None) -> Tensor:
        """Sparse MLA attention of ``q`` over ``rows`` of ``kv`` (one layer's rows, or the
        staging area); ``sched_meta``: from :meth:`sched_meta`, shared by calls of one shape."""

    def sched_meta(self):
        """Attention scheduler metadata to share across the calls of one shape (every layer of
        a forward); ``None``: nothing to share."""
        return None


class BF16Format(KVFormat):
    """``"bf16"``: rows ``[N, D]`` and keys ``[N, Di]`` in the model dtype (bf16 on CUDA, fp32
    in CPU tests), written by an indexed copy; attention in ``kv.dtype``."""

    def write_rows(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        dst.index_copy_(0, rows, new.to(dst.dtype))

    def write_keys(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        dst.index_copy_(0, rows, new.to(dst.dtype))

    def attention(self, q: Tensor, kv: Tensor, rows: Tensor, sm_scale: float,
                  sched_meta=None) -> Tensor:
        out, _ = ops.sparse_mla_attention(q.to(kv.dtype), kv, rows, sm_scale,
                                          d_v=self.kv_lora_rank, backend=self.backend)
        return out


class FP8Format(KVFormat):
    """``"fp8"``: FlashMLA's byte rows ``[N, 656]`` uint8 and FP8 key pages ``[blocks,
    block_size * 132]`` uint8 (:mod:`hisparse.ops.quant`), quantized as they are written (one
    launch); attention in the compute dtype, the kernels dequantize. When FlashMLA runs (a
    measurement switch), one scheduler metadata serves every layer of a forward."""

    def write_rows(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        ops.quantize_write_mla_rows(new, dst, rows, self.kv_lora_rank)

    def write_keys(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        ops.quantize_write_index_keys(new, dst, rows)

    def attention(self, q: Tensor, kv: Tensor, rows: Tensor, sm_scale: float,
                  sched_meta=None) -> Tensor:
        out, _ = ops.sparse_mla_attention_fp8(q.to(self.dtype), kv, rows, sm_scale,
                                              d_v=self.kv_lora_rank, backend=self.backend,
                                              sched_meta=sched_meta)
        return out

    def sched_meta(self):
        """A fresh FlashMLA metadata when FlashMLA runs (CUDA, ``HISPARSE_ATTENTION=flashmla``:
        "auto" runs the Triton kernel, which needs none); else ``None``."""
        flashmla = self.backend == "flashmla" or (self.backend == "auto"
                                                  and switches.current().attention == "flashmla")
        return flashmla_sched_meta() if self.cuda and flashmla else None


def kv_format(geo, kv_lora_rank: int, device: torch.device) -> KVFormat:
    """The format of caches of geometry ``geo`` (:class:`~hisparse.worker.cache.CacheGeometry`)."""
    return (FP8Format if geo.fp8 else BF16Format)(kv_lora_rank, device, geo.dtype)
