"""The fused MoE's padded per-expert tile layout (contract in :mod:`hisparse.ops.moe`, step 1):
tile height, the bound on tiles any routing needs, and the torch sort-based alignment with its
Python spec. Triton-free: shared by ``moe``, ``moe_layer`` and their Triton kernels.
"""

from __future__ import annotations

import torch

from ._common import cdiv

FUSED_BLOCK_M = 16        # grouped-GEMM tile height of the fused layer, whatever T


def moe_block_m(num_assignments: int, num_experts: int) -> int:
    """Tile height: 16 rows at decode (few tokens per expert), larger for prefill batches."""
    per_expert = num_assignments / max(1, min(num_experts, num_assignments))
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def moe_max_tiles(num_assignments: int, num_experts: int, block_m: int) -> int:
    A = num_assignments
    return cdiv(A + min(num_experts, A) * (block_m - 1), block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort assignments by expert into padded tiles (no host sync, shapes fixed by ``T, k, E``).

    Returns ``sorted_ids [max_tiles * block_m]`` int32 (assignment id ``t * k + j`` or -1) and
    ``tile_expert [max_tiles]`` int32 (the tile's expert, or -1 past the last used tile)."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    A = flat.numel()
    max_tiles = moe_max_tiles(A, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    first_slot = (tile_end - tiles) * block_m
    start = torch.cumsum(counts, 0) - counts
    sorted_e, order = torch.sort(flat, stable=True)
    rank = torch.arange(A, device=dev) - start[sorted_e]
    sorted_ids = torch.full((max_tiles * block_m,), -1, dtype=torch.int32, device=dev)
    sorted_ids[first_slot[sorted_e] + rank] = order.to(torch.int32)
    t = torch.arange(max_tiles, device=dev)
    tile_expert = torch.searchsorted(tile_end, t, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_ids, tile_expert


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Python loop spec of :func:`moe_align`."""
    flat = topk_ids.reshape(-1).tolist()
    max_tiles = moe_max_tiles(len(flat), num_experts, block_m)
    ids, experts = [], []
    for e in range(num_experts):
        mine = [a for a, v in enumerate(flat) if v == e]
        while mine:
            chunk, mine = mine[:block_m], mine[block_m:]
            ids += chunk + [-1] * (block_m - len(chunk))
            experts.append(e)
    ids += [-1] * (max_tiles * block_m - len(ids))
    experts += [-1] * (max_tiles - len(experts))
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(experts, dtype=torch.int32)
