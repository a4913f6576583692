"""Device-side storage of the three tiers plus the hot-buffer state.

- ``arena``: one packed GPU allocation ``[L, (num_gpu_blocks + 1) * block_size, D]`` of MLA rows
  (the last block is a write sink for padding tokens); with ``kv_cache_dtype="fp8"`` it is uint8
  ``[L, rows, 656]`` byte rows, so every copy, mirror, restore and the resolver's gather move
  opaque bytes;
  ``arena[l]`` is layer ``l``'s view (its own offset ``l * layer_stride``), addressed by flat
  row ids ``block * block_size + offset``. Resident pages and hot-buffer blocks share it.
- ``indexer``: ``[Li, (num_indexer_blocks + 1) * block_size, Di]`` keys, one layer per *indexer*
  layer (GLM's shared layers have none); with ``"fp8"`` uint8 pages ``[Li, num_indexer_blocks
  + 1, block_size * 132]`` (:class:`~hisparse.ops.quant.FP8KeyLayout`: per page the e4m3 values,
  then the fp32 scales; 132 B per key as in row format, values 16-B aligned). Keys are still
  addressed by flat row ids; :meth:`KVCaches.copy_keys` moves them between tiers.
- ``host`` / ``host_indexer``: the same layouts over host blocks, pinned when CUDA is used.
- ``hot_keys`` / ``hot_lru``: ``[L, R, H]`` int32 per (layer, request slot) LRU state.
- ``hot_flags``: ``[L, R, H]`` int32 per-slot policy state: ``uses << 1 | prefetched``.
- ``hot_policy`` / ``hot_band`` / ``hot_prefetch``: the resolver's replacement policy (``"lru"``
  or ``"score"``), next-ranked rows the indexer hands it, prefetched rows per (layer, request)
  step at most (see :meth:`KVCaches.set_hot_policy`); the prefetch copies run from per-layer
  plans in ``workspace`` (:meth:`StepWorkspace.prefetch_plan`) on a side stream.
- ``counters``: int64 ``[5]``: hot hits, hot (demand) misses, corrupt LRU entries skipped by the
  resolver, prefetched rows, prefetched rows later hit.
- ``staging``: ``[num_staging_rows, D]`` rows (storage dtype), one buffer shared by every
  layer: a prefill chunk's selected history rows when some are host-only (issue 14,
  :mod:`hisparse.ops.stage`); ``staged_counter`` int64 ``[1]`` counts rows staged from host
  (summed over layers).
- ``workspace``: every kernel workspace a step (and so a captured CUDA graph) touches, allocated
  here once for the largest batch (DESIGN section 7: never a module global grown on demand).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse.config import KVCacheConfig
from hisparse.ops import IndexerWorkspace, ResolveWorkspace, copy_index_keys

from .pinned import pinned_empty

KV_CACHE_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class CacheGeometry:
    """Sizes of the cached rows. ``kv_cache_dtype``: ``"bf16"`` stores rows and keys unquantized
    in ``dtype`` (the model dtype: bf16 on CUDA, fp32 in CPU tests); ``"fp8"`` stores FlashMLA's
    FP8 rows (``[rope_dim..]``: 512 e4m3 + 4 fp32 scales + 64 bf16 = 656 B) and FP8 indexer keys
    (128 e4m3 + 1 fp32 scale = 132 B) as opaque uint8 bytes (:mod:`hisparse.ops.quant`)."""

    num_layers: int
    row_dim: int                 # kv_lora_rank + qk_rope_head_dim (576 in production)
    indexer_layers: tuple[int, ...]  # model layers that own an indexer cache
    index_head_dim: int
    dtype: torch.dtype           # compute (model) dtype; the storage dtype of "bf16" caches
    kv_cache_dtype: str = "bf16"
    rope_dim: int = 64           # qk_rope_head_dim (the FP8 row keeps it in bf16)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.fp8:
            from hisparse.ops.quant import index_key_bytes, mla_row_bytes
            mla_row_bytes(self.row_dim - self.rope_dim, self.rope_dim)   # validates the tiles
            index_key_bytes(self.index_head_dim)

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    @property
    def kv_lora_rank(self) -> int:
        return self.row_dim - self.rope_dim

    @property
    def storage_dtype(self) -> torch.dtype:
        """Element type of the arena, indexer cache and host pool tensors."""
        return torch.uint8 if self.fp8 else self.dtype

    @property
    def row_width(self) -> int:
        """Last dimension of the arena / host pool: bytes (FP8) or values (bf16)."""
        if self.fp8:
            from hisparse.ops.quant import mla_row_bytes
            return mla_row_bytes(self.kv_lora_rank, self.rope_dim)
        return self.row_dim

    @property
    def key_width(self) -> int:
        if self.fp8:
            from hisparse.ops.quant import index_key_bytes
            return index_key_bytes(self.index_head_dim)
        return self.index_head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one MLA row (one token, one layer): 656 FP8, 1152 bf16 (576-d rows)."""
        return self.row_width * torch.empty(0, dtype=self.storage_dtype).element_size()

    @property
    def key_bytes(self) -> int:
        """Bytes of one indexer key (one token, one indexer layer): 132 FP8, 256 bf16."""
        return self.key_width * torch.empty(0, dtype=self.storage_dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """Host bytes per token: MLA rows of every layer plus indexer keys of indexer layers."""
        return self.num_layers * self.row_bytes + len(self.indexer_layers) * self.key_bytes

    def indexer_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int]:
        """Shape of an indexer cache (GPU or host) of ``num_blocks`` blocks: ``[Li, num_blocks *
        block_size, key_width]`` rows, or FP8 key pages ``[Li, num_blocks, block_size *
        key_bytes]`` (:class:`~hisparse.ops.quant.FP8KeyLayout`). Same bytes either way."""
        n_idx = len(self.indexer_layers)
        if self.fp8:
            from hisparse.ops.quant import FP8KeyLayout
            return FP8KeyLayout(self.index_head_dim, block_size).shape(num_blocks, n_idx)
        return (n_idx, num_blocks * block_size, self.key_width)

    def gpu_bytes_per_block(self, block_size: int) -> int:
        return block_size * self.num_layers * self.row_bytes

    def indexer_bytes_per_block(self, block_size: int) -> int:
        return block_size * len(self.indexer_layers) * self.key_bytes


class StepWorkspace:
    """Kernel state shared by all layers of a step, sized once for the largest batch:
    the resolver's position map, scratch and miss-copy list (``max_num_seqs`` request groups),
    the indexer's score-key buffer and, with prefetch, one prefetch plan per layer. Ops receive
    these explicitly; nothing here is ever reallocated once a step ran."""

    def __init__(self, cfg: KVCacheConfig, device: torch.device) -> None:
        positions = cfg.max_pages_per_request * cfg.block_size
        self.device = device
        self.max_groups = cfg.max_num_seqs
        self.resolve = ResolveWorkspace(cfg.max_num_seqs, positions, cfg.hot_buffer_size, device)
        rows = IndexerWorkspace.default_rows(max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
                                             positions)
        self.indexer = IndexerWorkspace(rows, positions, device)
        # [L, 2 * max_groups * prefetch] int64, all -1 between steps (prefetch_copy consumes
        # it); one per layer: layer l's side-stream copy may still read it while layer l + 1
        # resolves. Allocated by set_prefetch (the policy is set after the caches).
        self.prefetch_plans: torch.Tensor | None = None
        self.prefetch_rows = 0

    def set_prefetch(self, num_layers: int, prefetch_rows: int) -> None:
        """(Re)allocate the per-layer prefetch plans for ``prefetch_rows`` rows per (layer,
        request) step; before the first step only (a captured graph keeps the addresses)."""
        self.prefetch_rows = int(prefetch_rows)
        self.prefetch_plans = None
        if self.prefetch_rows:
            self.prefetch_plans = torch.full(
                (num_layers, 2 * self.max_groups * self.prefetch_rows), -1, dtype=torch.int64,
                device=self.device)

    def prefetch_plan(self, layer: int, groups: int) -> torch.Tensor | None:
        """Layer ``layer``'s plan as a contiguous ``[2, groups, prefetch_rows]`` view (groups
        ``<= max_num_seqs``: a call has at most ``min(T, max_num_seqs)`` request groups)."""
        if self.prefetch_plans is None:
            return None
        groups = min(int(groups), self.max_groups)
        n = 2 * groups * self.prefetch_rows
        return self.prefetch_plans[layer, :n].view(2, groups, self.prefetch_rows)

    def data_ptrs(self) -> tuple[int, ...]:
        """Addresses of every buffer (tests check they never change)."""
        ptrs = (self.resolve.position_map.data_ptr(), self.resolve.map_epoch.data_ptr(),
                self.resolve.scratch.data_ptr(),
                *self.indexer.data_ptrs())
        if self.prefetch_plans is not None:
            ptrs += (self.prefetch_plans.data_ptr(),)
        return ptrs


class KVCaches:
    def __init__(self, cfg: KVCacheConfig, geo: CacheGeometry, device: torch.device,
                 host_buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``host_buffers``: preallocated ``(host, host_indexer)`` tensors of the right shapes
        (pinning costs ~0.45 s/GiB, so benchmarks pin one pool and reuse it across engines)."""
        self.cfg, self.geo, self.device = cfg, geo, device
        block_size = cfg.block_size
        if geo.fp8 and device.type == "cuda" and (block_size * geo.key_bytes) % 16:
            raise ValueError(f"kv_cache_dtype='fp8' on CUDA needs 16-B aligned indexer key "
                             f"pages: block_size ({block_size}) x {geo.key_bytes} B must be a "
                             f"multiple of 16 (block_size >= 4)")
        pin = device.type == "cuda"
        # One extra block per pool is a sink that padding tokens of a captured step write to.
        sdt = geo.storage_dtype
        self.arena = torch.empty(geo.num_layers, (cfg.num_gpu_blocks + 1) * block_size,
                                 geo.row_width, dtype=sdt, device=device)
        self.indexer = torch.empty(geo.indexer_shape(cfg.num_indexer_blocks + 1, block_size),
                                   dtype=sdt, device=device)
        self.sink_row = cfg.num_gpu_blocks * block_size
        self.indexer_sink_row = cfg.num_indexer_blocks * block_size
        self.indexer_slot = {layer: i for i, layer in enumerate(geo.indexer_layers)}
        host_blocks = cfg.num_host_blocks if cfg.uses_host else 0
        host_shape = (geo.num_layers, host_blocks * block_size, geo.row_width)
        idx_shape = geo.indexer_shape(host_blocks, block_size)
        if host_buffers is not None:
            self.host, self.host_indexer = host_buffers
            if (self.host.shape != host_shape or self.host_indexer.shape != idx_shape
                    or self.host.dtype != sdt or self.host_indexer.dtype != sdt):
                raise ValueError(f"host_buffers must be {sdt} tensors of shapes {host_shape} and "
                                 f"{idx_shape}")
        else:
            # exact-size pinning: torch's pin_memory rounds a pool up to a power of two
            self.host = pinned_empty(host_shape, sdt) if pin else torch.empty(host_shape, dtype=sdt)
            self.host_indexer = (pinned_empty(idx_shape, sdt) if pin
                                 else torch.empty(idx_shape, dtype=sdt))
        R, H = cfg.max_num_seqs, cfg.hot_buffer_size
        self.hot_keys = torch.full((geo.num_layers, R, H), -1, dtype=torch.int32, device=device)
        self.hot_lru = torch.arange(H, dtype=torch.int32, device=device).repeat(
            geo.num_layers, R, 1)
        self.hot_flags = torch.zeros((geo.num_layers, R, H), dtype=torch.int32, device=device)
        self.hot_policy, self.hot_band, self.hot_prefetch = "lru", 0, 0
        # hot hits, hot misses, corrupt LRU entries skipped (resolver fail-safe), prefetched,
        # prefetch hits
        self.counters = torch.zeros(5, dtype=torch.int64, device=device)
        self.workspace = StepWorkspace(cfg, device)
        # Prefill staging area (eager prefill steps only; allocated once, never grown).
        self.staging = torch.empty(cfg.num_staging_rows, geo.row_width, dtype=sdt,
                                   device=device)
        self.staged_counter = torch.zeros(1, dtype=torch.int64, device=device)

    def set_hot_policy(self, name: str) -> None:
        """``"lru"``, ``"score"`` or ``"score+prefetch"`` (issue 15): score-aware replacement
        over a band of ``index_topk`` next-ranked rows; prefetch of up to
        ``cfg.hot_prefetch_rows`` (default ``max(1, index_topk // 64)``) of them per (layer,
        request) step, copied on a side stream from per-layer plans in the workspace. Set
        before the first step (graphs capture it)."""
        from hisparse.ops.resolve import hot_policy_params

        self.hot_policy, self.hot_band, self.hot_prefetch = hot_policy_params(
            name, self.cfg.index_topk, self.cfg.hot_prefetch_rows)
        self.workspace.set_prefetch(self.hot_keys.shape[0], self.hot_prefetch)

    def arena_layer(self, layer: int) -> torch.Tensor:
        """``[num_gpu_blocks * block_size, D]`` rows of one layer (a view with its own offset)."""
        return self.arena[layer]

    def resolve_view(self, rows: torch.Tensor) -> torch.Tensor:
        """The resolver's view of one layer's rows: FP8 byte rows as int32 words
        (``[N, 164]`` for 656 B), unquantized rows as they are."""
        return rows.view(torch.int32) if self.geo.fp8 else rows

    def host_layer(self, layer: int) -> torch.Tensor:
        return self.host[layer]

    def indexer_layer(self, layer: int) -> torch.Tensor:
        """One indexer layer's keys (a view with its own offset): ``[rows, Di]`` or FP8 pages
        ``[blocks, block_size * 132]``."""
        return self.indexer[self.indexer_slot[layer]]

    def copy_keys(self, src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                  dst_rows: torch.Tensor) -> None:
        """Indexer keys of flat rows ``src_rows`` of ``src`` to ``dst_rows`` of ``dst``, every
        indexer layer, one launch (``indexer`` / ``host_indexer``: mirrors, restores)."""
        if src_rows.numel() and src.shape[0]:
            copy_index_keys(src, dst, src_rows, dst_rows, self.geo.index_head_dim)

    def reset_hot(self, slots: torch.Tensor) -> None:
        """Forget every hot row of these request slots, in every layer (DESIGN I6)."""
        if slots.numel():
            self.hot_keys[:, slots] = -1
            self.hot_flags[:, slots] = 0
            self.hot_lru[:, slots] = torch.arange(self.cfg.hot_buffer_size, dtype=torch.int32,
                                                  device=self.device)
