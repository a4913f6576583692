"""A kernel running ``_topk_triton._fitted_splits`` once a case, for test_ops_topk (a module of
its own: the interpreter resolves a kernel's names in its module, and tests import it only
where Triton is installed)."""

import triton
import triton.language as tl

from hisparse.ops._topk_triton import _fitted_splits


@triton.jit
def fit_probe(n_ptr, long_ptr, out_ptr, MOST, PROGRAMS, SMS, BLOCK: tl.constexpr):
    """``out[i]``: the splits a row for ``n[i]`` live rows whose longest is ``long[i]``."""
    i = tl.program_id(0)
    tl.store(out_ptr + i, _fitted_splits(tl.load(n_ptr + i), tl.load(long_ptr + i), MOST,
                                         PROGRAMS, SMS, BLOCK))
