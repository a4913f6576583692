"""Device-side storage of the three tiers plus the hot-buffer state.

- ``arena``: one packed GPU allocation ``[L, (num_gpu_blocks + 1) * block_size, D]`` of MLA rows
  (the last block is a write sink for padding tokens);
  ``arena[l]`` is layer ``l``'s view (its own offset ``l * layer_stride``), addressed by flat
  row ids ``block * block_size + offset``. Resident pages and hot-buffer blocks share it.
- ``indexer``: ``[Li, num_indexer_blocks * block_size, Di]`` keys, one layer per *indexer* layer
  (GLM's shared layers have none).
- ``host`` / ``host_indexer``: the same layouts over host blocks, pinned when CUDA is used.
- ``hot_keys`` / ``hot_lru``: ``[L, R, H]`` int32 per (layer, request slot) LRU state.
- ``hot_flags``: ``[L, R, H]`` int32 per-slot policy state: ``uses << 1 | prefetched``.
- ``hot_policy`` / ``hot_band`` / ``hot_prefetch``: the resolver's replacement policy (``"lru"``
  or ``"score"``), next-ranked rows the indexer hands it, prefetched rows per (layer, request)
  step at most (see :meth:`KVCaches.set_hot_policy`).
- ``counters``: int64 ``[5]``: hot hits, hot (demand) misses, corrupt LRU entries skipped by the
  resolver, prefetched rows, prefetched rows later hit.
- ``workspace``: every kernel workspace a step (and so a captured CUDA graph) touches, allocated
  here once for the largest batch (DESIGN section 7: never a module global grown on demand).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse.config import KVCacheConfig
from hisparse.ops import IndexerWorkspace, ResolveWorkspace


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int
    row_dim: int                 # kv_lora_rank + qk_rope_head_dim (576 in production)
    indexer_layers: tuple[int, ...]  # model layers that own an indexer cache
    index_head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Host bytes per token: MLA rows of every layer plus indexer keys of indexer layers."""
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return elt * (self.num_layers * self.row_dim
                      + len(self.indexer_layers) * self.index_head_dim)

    def gpu_bytes_per_block(self, block_size: int) -> int:
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return elt * block_size * self.num_layers * self.row_dim

    def indexer_bytes_per_block(self, block_size: int) -> int:
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return elt * block_size * len(self.indexer_layers) * self.index_head_dim


class StepWorkspace:
    """Kernel state shared by all layers of a step, sized once for the largest batch:
    the resolver's position map + scratch (``max_num_seqs`` request groups) and the indexer's
    score-key buffer. Ops receive these explicitly; nothing here is ever reallocated."""

    def __init__(self, cfg: KVCacheConfig, device: torch.device) -> None:
        positions = cfg.max_pages_per_request * cfg.block_size
        self.resolve = ResolveWorkspace(cfg.max_num_seqs, positions, cfg.hot_buffer_size, device)
        rows = IndexerWorkspace.default_rows(max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
                                             positions)
        self.indexer = IndexerWorkspace(rows, positions, device)

    def data_ptrs(self) -> tuple[int, ...]:
        """Addresses of every buffer (tests check they never change)."""
        return (self.resolve.position_map.data_ptr(), self.resolve.scratch.data_ptr(),
                self.indexer.keys.data_ptr())


class KVCaches:
    def __init__(self, cfg: KVCacheConfig, geo: CacheGeometry, device: torch.device,
                 host_buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``host_buffers``: preallocated ``(host, host_indexer)`` tensors of the right shapes
        (pinning costs ~0.45 s/GiB, so benchmarks pin one pool and reuse it across engines)."""
        self.cfg, self.geo, self.device = cfg, geo, device
        block_size = cfg.block_size
        pin = device.type == "cuda"
        # One extra block per pool is a sink that padding tokens of a captured step write to.
        self.arena = torch.empty(geo.num_layers, (cfg.num_gpu_blocks + 1) * block_size, geo.row_dim,
                                 dtype=geo.dtype, device=device)
        n_idx = len(geo.indexer_layers)
        self.indexer = torch.empty(n_idx, (cfg.num_indexer_blocks + 1) * block_size,
                                   geo.index_head_dim,
                                   dtype=geo.dtype, device=device)
        self.sink_row = cfg.num_gpu_blocks * block_size
        self.indexer_sink_row = cfg.num_indexer_blocks * block_size
        self.indexer_slot = {layer: i for i, layer in enumerate(geo.indexer_layers)}
        host_rows = cfg.num_host_blocks * block_size if cfg.uses_host else 0
        host_shape = (geo.num_layers, host_rows, geo.row_dim)
        idx_shape = (n_idx, host_rows, geo.index_head_dim)
        if host_buffers is not None:
            self.host, self.host_indexer = host_buffers
            if self.host.shape != host_shape or self.host_indexer.shape != idx_shape:
                raise ValueError(f"host_buffers must have shapes {host_shape} and {idx_shape}")
        else:
            self.host = torch.empty(host_shape, dtype=geo.dtype, pin_memory=pin)
            self.host_indexer = torch.empty(idx_shape, dtype=geo.dtype, pin_memory=pin)
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

    def set_hot_policy(self, name: str) -> None:
        """``"lru"``, ``"score"`` or ``"score+prefetch"`` (issue 15): score-aware replacement
        over a band of ``index_topk`` next-ranked rows; prefetch of up to ``index_topk // 64``
        of them per (layer, request) step. Set before the first step (graphs capture it)."""
        from hisparse.ops.resolve import hot_policy_params

        self.hot_policy, self.hot_band, self.hot_prefetch = hot_policy_params(
            name, self.cfg.index_topk)

    def arena_layer(self, layer: int) -> torch.Tensor:
        """``[num_gpu_blocks * block_size, D]`` rows of one layer (a view with its own offset)."""
        return self.arena[layer]

    def host_layer(self, layer: int) -> torch.Tensor:
        return self.host[layer]

    def indexer_layer(self, layer: int) -> torch.Tensor:
        return self.indexer[self.indexer_slot[layer]]

    def reset_hot(self, slots: torch.Tensor) -> None:
        """Forget every hot row of these request slots, in every layer (DESIGN I6)."""
        if slots.numel():
            self.hot_keys[:, slots] = -1
            self.hot_flags[:, slots] = 0
            self.hot_lru[:, slots] = torch.arange(self.cfg.hot_buffer_size, dtype=torch.int32,
                                                  device=self.device)
