"""Configs and their validation.

Every check raises ``ValueError`` naming the field and the limit it broke, so a user can fix the
call without reading our code.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Mode(enum.StrEnum):
    """Where a request's KV may live.

    ``GPU_ONLY``: no host tier, full-length GPU reservation at admission (the baseline).
    ``HISPARSE``: GPU pages first; requests switch to host-read mode under pressure.
    ``ALWAYS_HOST``: every request reads its history through its hot buffer once its prompt is
    done (SGLang's design).
    A ``StrEnum``: ``Mode.HISPARSE == "hisparse"`` and ``str(Mode.HISPARSE) == "hisparse"``.
    """

    GPU_ONLY = "gpu-only"
    HISPARSE = "hisparse"
    ALWAYS_HOST = "always-host"

    @classmethod
    def parse(cls, value: Mode | str) -> Mode:
        """The mode named by ``value``; ValueError naming the field and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"mode must be one of {[m.value for m in cls]}, got {value!r}") \
                from None


MODES: tuple[str, ...] = tuple(m.value for m in Mode)

# Pages at the tail of a running request that may still be written by an in-flight step (I4).
ACTIVE_TAIL_PAGES = 2


def require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ~0.3 GB of bf16 rows: staging a whole 256k history per layer costs less than re-staging.
MAX_DEFAULT_STAGING_ROWS = 262144


def hot_buffer_rows(hot_buffer_size: int | None, index_topk: int) -> int:
    """Rows per (layer, request) of a hot buffer: ``hot_buffer_size`` if given, else ``2 *
    index_topk`` (the one default the engine, the planner and the pool sizing use)."""
    return 2 * index_topk if hot_buffer_size is None else hot_buffer_size


def watermark_for(num_gpu_blocks: int, watermark_blocks: int | None, hot_blocks: int) -> int:
    """The arena's watermark: ``watermark_blocks`` if given, else ``max(hot_blocks,
    num_gpu_blocks // 10)`` (the one rule the engine, the planner and the pool sizing use)."""
    if watermark_blocks is not None:
        return watermark_blocks
    return max(hot_blocks, num_gpu_blocks // 10)


@dataclass(frozen=True)
class KVCacheConfig:
    """Sizes of the three tiers, in blocks of ``block_size`` tokens.

    ``hot_buffer_size`` is rows per (layer, request); a request in host-read mode leases
    ``hot_blocks_per_request`` GPU blocks for it (the same block ids in every layer).
    """

    block_size: int
    num_gpu_blocks: int
    num_host_blocks: int
    num_indexer_blocks: int
    max_model_len: int
    index_topk: int
    hot_buffer_size: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    mode: Mode = Mode.HISPARSE
    enable_prefix_caching: bool = True
    # Free-block level under which requests are moved to host-read mode; None = default rule.
    watermark_blocks: int | None = None
    # Rows of the GPU staging area a prefill chunk reads spilled history through (one buffer
    # shared by all layers, allocated once); None = default rule (:attr:`num_staging_rows`).
    staging_rows: int | None = None
    # hot_policy="score+prefetch": band rows prefetched per (layer, request) step at most (the
    # bound on prefetch H2D: num_layers x running host-read requests x this x row bytes per
    # step); None = max(1, index_topk // 64); 0 = no prefetch.
    hot_prefetch_rows: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "num_indexer_blocks", "max_model_len",
                     "index_topk", "max_num_seqs", "max_num_batched_tokens"):
            require_positive(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        object.__setattr__(self, "hot_buffer_size",
                           hot_buffer_rows(self.hot_buffer_size, self.index_topk))
        require_positive("hot_buffer_size", self.hot_buffer_size)
        if self.hot_buffer_size < self.index_topk:
            raise ValueError(
                f"hot_buffer_size must be >= index_topk ({self.index_topk}), "
                f"got {self.hot_buffer_size}")
        pages = self.max_pages_per_request
        if self.mode != "gpu-only":
            if not isinstance(self.num_host_blocks, int) or self.num_host_blocks < pages:
                raise ValueError(
                    f"num_host_blocks must hold one max-length request "
                    f"(>= {pages} blocks of {self.block_size} tokens for max_model_len="
                    f"{self.max_model_len}), got {self.num_host_blocks}")
        min_gpu = self.min_gpu_blocks
        if self.num_gpu_blocks < min_gpu:
            raise ValueError(f"num_gpu_blocks must be >= {min_gpu} ({self.min_gpu_blocks_why}), "
                             f"got {self.num_gpu_blocks}")
        if self.num_indexer_blocks < pages:
            raise ValueError(
                f"num_indexer_blocks must hold one max-length request (>= {pages}), "
                f"got {self.num_indexer_blocks}")
        st = self.staging_rows
        if st is not None and (not isinstance(st, int) or isinstance(st, bool)
                               or st < self.index_topk):
            raise ValueError(f"staging_rows must be None or an integer >= index_topk "
                             f"({self.index_topk}), got {st!r}")
        pf = self.hot_prefetch_rows
        if pf is not None and (not isinstance(pf, int) or isinstance(pf, bool) or pf < 0
                               or pf > min(self.index_topk, self.hot_buffer_size)):
            # the band the indexer hands over is index_topk rows: no step can prefetch more
            raise ValueError(f"hot_prefetch_rows must be None or an integer in [0, "
                             f"min(index_topk, hot_buffer_size)="
                             f"{min(self.index_topk, self.hot_buffer_size)}], got {pf!r}")
        wm = self.watermark_blocks
        if wm is not None and (not isinstance(wm, int) or isinstance(wm, bool) or wm < 0):
            raise ValueError(f"watermark_blocks must be None or an integer >= 0, got {wm!r}")

    @property
    def max_pages_per_request(self) -> int:
        return cdiv(self.max_model_len, self.block_size)

    @property
    def hot_blocks_per_request(self) -> int:
        return cdiv(self.hot_buffer_size, self.block_size)

    @property
    def chunk_pages(self) -> int:
        """Pages one prefill chunk can touch: a chunk holds at most
        ``min(max_num_batched_tokens, max_model_len)`` tokens and may straddle a page boundary,
        and it never touches more pages than one request has."""
        chunk = min(self.max_num_batched_tokens, self.max_model_len)
        return min(cdiv(chunk, self.block_size) + 1, self.max_pages_per_request)

    @property
    def min_gpu_blocks(self) -> int:
        """The smallest GPU pool that can schedule every admissible request.

        gpu-only: one max-length request stays resident. Otherwise a prefill chunk reads its
        spilled history through the staging area (:attr:`num_staging_rows`, separate memory),
        so the GPU needs one chunk's pages, the tail pages (I4) and, once decoding, the hot
        blocks: ``hot_blocks_per_request + ACTIVE_TAIL_PAGES + chunk_pages``, independent of
        ``max_model_len``.
        """
        pages = self.max_pages_per_request
        if self.mode == "gpu-only":
            return pages
        return self.hot_blocks_per_request + ACTIVE_TAIL_PAGES + self.chunk_pages

    @property
    def min_gpu_blocks_why(self) -> str:
        pages = self.max_pages_per_request
        if self.mode == "gpu-only":
            return (f"one max-length request in gpu-only mode: {pages} blocks of "
                    f"{self.block_size} tokens for max_model_len={self.max_model_len}")
        return (f"hot blocks {self.hot_blocks_per_request} + tail {ACTIVE_TAIL_PAGES} "
                f"+ one prefill chunk {self.chunk_pages}; spilled prefill history is read "
                f"through {self.num_staging_rows} staging rows")

    @property
    def num_staging_rows(self) -> int:
        """Rows of the prefill staging area (0 in gpu-only mode). Default: a whole history
        (``max_model_len``, capped at :data:`MAX_DEFAULT_STAGING_ROWS`): a chunk's union of
        selected rows never exceeds its history, so each layer stages it once per chunk. The
        worker splits a chunk's staged attention into token groups whose union fits; smaller
        areas re-stage rows shared by several groups (measured on the H200 at 64k with
        ``8 * index_topk`` rows: 1,230 prefill tok/s, 251 GB staged, against 32,184 tok/s
        for GPU-only)."""
        if self.mode == "gpu-only":
            return 0
        if self.staging_rows is not None:
            return self.staging_rows
        return max(self.index_topk, min(self.max_model_len, MAX_DEFAULT_STAGING_ROWS))

    @property
    def watermark(self) -> int:
        """Free GPU blocks under which requests are switched to host-read mode."""
        return watermark_for(self.num_gpu_blocks, self.watermark_blocks,
                             self.hot_blocks_per_request)

    @property
    def uses_host(self) -> bool:
        return self.mode != "gpu-only"


def host_blocks_for_gib(host_pool_gib: float, bytes_per_host_block: int) -> int:
    """Number of host blocks a pool of ``host_pool_gib`` GiB holds."""
    if not isinstance(host_pool_gib, (int, float)) or not math.isfinite(host_pool_gib) \
            or host_pool_gib <= 0:
        raise ValueError(f"host_pool_gib must be a positive number, got {host_pool_gib!r}")
    return int(host_pool_gib * (1 << 30)) // bytes_per_host_block
