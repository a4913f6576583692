"""The top-k replay of ``hisparse bench`` as one Triton kernel per layer (imported lazily).

One named kernel instead of the half-dozen small torch kernels of
:func:`hisparse.bench.replay.replay_rows_reference`, so a kernel profile can show the
benchmark's own replay apart from the engine's kernels (class "benchmark replay" in
:mod:`hisparse.bench.kernels`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _bench_topk_replay_kernel(table_ptr, slot_ptr, pos_ptr, out_ptr, layer_base, context,
                              streams, steps, width, stream_stride,
                              BLOCK: tl.constexpr):
    """Program ``(t, b)``: columns ``b * BLOCK ..`` of token ``t``'s row."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < width
    slot = tl.load(slot_ptr + t)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    step = tl.minimum(tl.maximum(pos - context, 0), steps - 1)
    stream = tl.where(slot >= 0, slot % streams, 0).to(tl.int64)
    src = table_ptr + stream * stream_stride + layer_base + step * width + cols
    rows = tl.load(src, mask=cmask & (cols * 0 + slot >= 0), other=-1)
    tl.store(out_ptr + t.to(tl.int64) * width + cols, rows, mask=cmask)


def replay_rows(table: torch.Tensor, layer: int, token_slot: torch.Tensor,
                positions: torch.Tensor, context: int) -> torch.Tensor:
    """See :func:`hisparse.bench.replay.replay_rows_reference` (same contract)."""
    streams, layers, steps, width = table.shape
    T = token_slot.shape[0]
    out = torch.empty((T, width), dtype=table.dtype, device=table.device)
    if T == 0:
        return out
    _bench_topk_replay_kernel[(T, triton.cdiv(width, BLOCK))](
        table, token_slot, positions, out, (layer % layers) * steps * width, context,
        streams, steps, width, layers * steps * width, BLOCK=BLOCK)
    return out
