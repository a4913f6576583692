"""Replayed top-k selections of ``hisparse bench`` (synthetic and trace sources)."""

from __future__ import annotations

import torch

from hisparse.ops._common import want_triton


def replay_rows_reference(table: torch.Tensor, layer: int, token_slot: torch.Tensor,
                          positions: torch.Tensor, context: int) -> torch.Tensor:
    """Each token's replayed row of ``table`` (``[streams, layers, steps, width]`` int32):
    stream ``slot % streams``, layer ``layer % layers``, decode step ``position - context``
    clamped to ``[0, steps)``; ``[T, width]`` int32, all ``-1`` for a padding token
    (``token_slot`` ``-1``). ``token_slot`` int32 ``[T]``, ``positions`` integer ``[T]``."""
    streams, layers, steps, _ = table.shape
    step = (positions - context).clamp(0, steps - 1)
    selected = table[token_slot.long() % streams, layer % layers, step]
    return torch.where(token_slot[:, None] >= 0, selected, -1)


def replay_rows(table: torch.Tensor, layer: int, token_slot: torch.Tensor,
                positions: torch.Tensor, context: int) -> torch.Tensor:
    """:func:`replay_rows_reference` as one Triton kernel on CUDA (CUDA-graph safe: one
    launch, output from the graph's pool), the reference elsewhere."""
    if want_triton(table, token_slot):
        from ._replay_triton import replay_rows as replay_triton
        return replay_triton(table, layer, token_slot, positions, context)
    return replay_rows_reference(table, layer, token_slot, positions, context)
