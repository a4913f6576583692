"""Shared helpers for the data-plane ops: backend choice, Triton availability, and what an op's
reference module and its Triton kernels both need (formats, policy constants).

Triton kernels live in private ``_*_triton.py`` modules that are imported lazily, on the first
Triton dispatch. ``triton.jit`` decides at decoration time whether a kernel is compiled or
interpreted (``TRITON_INTERPRET=1``), so importing kernels lazily lets tests set that variable
after ``hisparse`` itself was imported.

Imports run one way: an op's module (``quant``, ``topk``, ...) imports its ``_*_triton``
module, and the ``_*_triton`` module does not import its op's module back: what both sides
share lives here, or in a small Triton-free module of its own (``block_fp8``: the FP8 GEMM
format; ``moe_tiles``: the MoE tile layout; ``switches``: the ``HISPARSE_*`` kernel switches;
``pending``: a sum handed from its producer's kernels to the next norm's).
Importing any of them loads no Triton (``tests/ops/test_ops_layering.py`` checks the import
graph).
"""

from __future__ import annotations

import functools
import os

import torch

from . import switches


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def want_triton(*tensors: torch.Tensor) -> bool:
    """Triton when any given tensor is on CUDA (or HISPARSE_FORCE_TRITON=1:
    :mod:`hisparse.ops.switches`), and Triton imports."""
    if not triton_available():
        return False
    if switches.current().force_triton:
        return True
    return any(t is not None and t.is_cuda for t in tensors)


def interpreted() -> bool:
    """Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``). Kernels with loop
    bounds loaded from memory use a ``while`` loop there: triton 3.6's interpreter cannot take
    them in a ``for`` (the compiled ``for`` is the one Triton software-pipelines)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def bucket_of(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest of the ascending ``buckets`` holding ``n`` (the last when none does): the
    key of the measured launch tables."""
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- shared by ops and kernels
# FP8 formats (quant): values per scale tile.
TILE = 128


def fp8_tile(d: int) -> int:
    """Values per scale tile for ``d`` quantized values (128, or ``d`` itself below 128)."""
    tile = min(TILE, d)
    if d % tile or (d // tile) & (d // tile - 1):
        raise ValueError(f"FP8 format: {d} values must be a power-of-two number of "
                         f"{TILE}-value tiles (or a single tile below {TILE})")
    return tile


def mla_row_bytes(d_nope: int, d_rope: int) -> int:
    """Bytes of one FP8 MLA row (quant's layout): 656 for 512 + 64."""
    return d_nope + 4 * (d_nope // fp8_tile(d_nope)) + 2 * d_rope


# Indexer rotation (rotation): a Walsh-Hadamard transform of a power-of-two size.
def check_rotation_dim(d: int) -> None:
    """``d`` must be a power of two (the Hadamard transform's size)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"indexer rotation: the head size ({d}) must be a power of two (a "
                         "Walsh-Hadamard transform)")


# Radix select (topk): four 8-bit digits of the 32-bit key; MAX_SPLITS programs per row at most
# cooperate on one row's histograms.
RADIX_BINS = 256
RADIX_LEVELS = 4
TOPK_HIST_WIDTH = RADIX_LEVELS * RADIX_BINS + 64   # a row of TopkScratch.hist: counts + state
MAX_SPLITS = 64          # a power of two


# Hot-buffer resolver (resolve).
PROTECT_USES = 3          # score policy: rows used this often since loaded are evicted last
USE_COUNT_CAP = 1 << 20   # saturation of the per-slot use count
MISS_COPY_SPLIT = 16      # miss-gather programs per request group (a power of two)


def position_map_shift(hot_buffer_size: int) -> int:
    """Bits of a resolver position-map entry that hold its value; the bits above hold the call
    (epoch) that wrote it, so a call never resets the map: an entry of an older epoch reads as
    unmapped (``-1``). Values lie in ``[-2 - H, 4H)``, stored plus ``H + 2``."""
    return (5 * max(1, int(hot_buffer_size)) + 1).bit_length()


def position_map_max_epoch(hot_buffer_size: int) -> int:
    """The last epoch before a row of the map is cleared and its epochs start again at 1
    (entries are non-negative int32: epoch << shift stays below 2**31)."""
    shift = position_map_shift(hot_buffer_size)
    if shift > 30:
        raise ValueError(f"resolve_rows: hot_buffer_size {hot_buffer_size} is too large for "
                         f"the resolver's int32 position map")
    return (1 << (31 - shift)) - 1


def check_prefetch_plan(plan: torch.Tensor | None, prefetch: int, T: int, R: int) -> None:
    """``resolve_rows``' ``prefetch_plan``: None, or contiguous int64 ``[2, >= min(T, R),
    prefetch]`` (host rows, arena rows per request group); ``ValueError`` otherwise."""
    if plan is None:
        return
    G = min(T, R)
    if (plan.dim() != 3 or plan.shape[0] != 2 or plan.shape[1] < G
            or plan.shape[2] != int(prefetch) or plan.dtype != torch.int64
            or not plan.is_contiguous()):
        raise ValueError(f"resolve_rows: prefetch_plan must be contiguous int64 [2, >= {G}, "
                         f"{int(prefetch)}] (request groups x prefetch), got "
                         f"{tuple(plan.shape)} {plan.dtype}")
