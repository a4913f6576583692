"""The two formats of the KV caches (``kv_cache_dtype``), one object each: how a forward writes
its new MLA rows and indexer keys given as tensors, and which sparse attention reads the rows.
:func:`kv_format` picks one from the cache geometry, once, when a context is built.

- :class:`BF16Format` (``"bf16"``): rows ``[N, D]`` and keys ``[N, Di]`` in the model dtype
  (bf16 on CUDA, fp32 in CPU tests), written by an indexed copy;
- :class:`FP8Format` (``"fp8"``): FlashMLA's FP8 byte rows ``[N, 656]`` uint8 and FP8 key pages
  (:mod:`hisparse.ops.quant`), quantized as they are written; attention dequantizes in its
  kernels and may share one FlashMLA scheduler metadata across the layers of a forward.

``D`` = kv_lora_rank + rope (576 in production), ``R`` = kv_lora_rank (512). Row ids are flat
(``block * block_size + offset``) int64 ``[T]`` for writes, int32 ``[T, K]`` for attention with
``-1`` for no row. Rows given as :class:`~hisparse.models.context.NewRows` / ``NewKeys`` write
themselves (one fused kernel handles both formats); only plain tensors come here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from hisparse import ops
from hisparse.ops.attention import flashmla_sched_meta


class KVFormat(ABC):
    """One cache format: what a :class:`~hisparse.worker.model_runner.PagedContext` needs to
    write rows and keys and to attend over them. ``attention`` runs on the backend of the
    device (``"auto"`` on CUDA, the reference elsewhere)."""

    def __init__(self, kv_lora_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.dtype = dtype              # the compute (model) dtype
        self.cuda = device.type == "cuda"
        self.backend = "auto" if self.cuda else "reference"

    @abstractmethod
    def write_rows(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        """Row ``rows[t]`` of ``dst`` (one layer's rows) = ``new[t]`` (``[T, D]`` float)."""

    @abstractmethod
    def write_keys(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        """Key of flat row ``rows[t]`` of ``dst`` (one layer's keys) = ``new[t]`` (``[T, Di]``
        float)."""

    @abstractmethod
    def attention(self, q: Tensor, kv: Tensor, rows: Tensor, sm_scale: float,
                  sched_meta=None) -> Tensor:
        """Sparse MLA attention ``[T, H, R]`` of ``q [T, H, D]`` over ``rows [T, K]`` of ``kv``
        (one layer's rows, or the staging area); ``sched_meta``: from :meth:`sched_meta`."""

    def sched_meta(self):
        """Scheduler metadata the caller may share across the attention calls of one shape
        (every layer of a forward); ``None``: nothing to share."""
        return None


class BF16Format(KVFormat):
    """Unquantized rows and keys in the storage dtype (= the model dtype)."""


    def write_rows(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        """``dst [N, D]``: an indexed copy, cast to ``dst.dtype``."""
        dst.index_copy_(0, rows, new.to(dst.dtype))

    def write_keys(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        """``dst [N, Di]``: an indexed copy, cast to ``dst.dtype``."""
        dst.index_copy_(0, rows, new.to(dst.dtype))

    def attention(self, q: Tensor, kv: Tensor, rows: Tensor, sm_scale: float,
                  sched_meta=None) -> Tensor:
        """``kv [N, D]``; ``q`` cast to ``kv.dtype``, the result in ``kv.dtype``."""
        out, _ = ops.sparse_mla_attention(q.to(kv.dtype), kv, rows, sm_scale,
                                          d_v=self.kv_lora_rank, backend=self.backend)
        return out


class FP8Format(KVFormat):
    """FlashMLA's FP8 rows and FP8 indexer key pages (``uint8`` byte tensors)."""


    def write_rows(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        """``dst [N, 656]`` uint8: quantized and written in one launch."""
        ops.quantize_write_mla_rows(new, dst, rows, self.kv_lora_rank)

    def write_keys(self, new: Tensor, dst: Tensor, rows: Tensor) -> None:
        """``dst [blocks, block_size * 132]`` uint8 key pages: quantized and written."""
        ops.quantize_write_index_keys(new, dst, rows)

    def attention(self, q: Tensor, kv: Tensor, rows: Tensor, sm_scale: float,
                  sched_meta=None) -> Tensor:
        """``kv [N, 656]`` uint8, dequantized in the kernel; ``q`` cast to the compute dtype,
        the result in it; ``sched_meta`` ``None``: FlashMLA makes a fresh one per call."""
        out, _ = ops.sparse_mla_attention_fp8(q.to(self.dtype), kv, rows, sm_scale,
                                              d_v=self.kv_lora_rank, backend=self.backend,
                                              sched_meta=sched_meta)
        return out

    def sched_meta(self):
        """A fresh FlashMLA scheduler metadata on CUDA (``None`` on CPU, or when flash_mla does
        not import)."""
        return flashmla_sched_meta() if self.cuda else None


def kv_format(geo, kv_lora_rank: int, device: torch.device) -> KVFormat:
    """The format of caches of geometry ``geo`` (:class:`~hisparse.worker.cache.CacheGeometry`)."""
    return (FP8Format if geo.fp8 else BF16Format)(kv_lora_rank, device, geo.dtype)
