"""Ops tests: Triton kernels run under the CPU interpreter when there is no CUDA.

``triton.jit`` reads TRITON_INTERPRET when a kernel is *decorated*; hisparse imports its kernel
modules lazily (on the first Triton dispatch), so setting the variable here, at collection, is
early enough even if other test packages imported hisparse before.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except Exception:  # pragma: no cover
    HAS_TRITON = False


@pytest.fixture
def triton_cpu(kernel_switches):
    """Force the Triton path on CPU tensors (interpreter)."""
    if not HAS_TRITON:
        pytest.skip("triton not installed")
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU-only machines")
    kernel_switches(force_triton=True)
    yield


@pytest.fixture
def no_force(kernel_switches):
    kernel_switches(force_triton=False)
    yield


@pytest.fixture(autouse=True)
def _seeded(request):
    """Random data, but the same for a given test on every run (no flaky tolerance misses)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture
def poisoned_empty(monkeypatch):
    """``torch.empty`` of a float dtype comes back full of NaN (outputs, partial-sum buffers):
    an element a kernel should write and does not shows up."""
    real = torch.empty

    def empty(*size, **kw):
        t = real(*size, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    yield


def _selection_overlap(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean over rows of |got ∩ want| / |want| for ``[T, k]`` position lists (``-1`` pads ignored).
    Rank order does not count: FP8 MMA rounding swaps near-tied scores, and one swap shifts
    every later rank of a positional comparison."""
    fractions = []
    for g, w in zip(got, want):
        w = w[w >= 0]
        if w.numel():
            fractions.append(torch.isin(w, g[g >= 0]).float().mean().item())
    return sum(fractions) / max(1, len(fractions))


@pytest.fixture
def selection_overlap():
    """``overlap(got, want) -> float`` (see ``_selection_overlap``)."""
    return _selection_overlap
