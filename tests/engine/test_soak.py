"""A short randomized soak through the real engine on CPU (the long one: benchmarks/soak.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from soak import run_soak  # noqa: E402


@pytest.mark.parametrize("mode, seed, requests, overlapped", [
    ("hisparse", 0, 300, True), ("always-host", 1, 100, True), ("gpu-only", 2, 100, True),
    ("hisparse", 1, 100, False)])
def test_soak_tiny_pool_matches_unconstrained_and_frees_every_block(dsv32_path, mode, seed,
                                                                    requests, overlapped):
    """Aborts, preemptions, stop ids, max_tokens and poisoned rows on a tiny pool: the
    overlapped loop (and the synchronous one) give the synchronous unconstrained run's greedy
    tokens, and every pool is back to full."""
    rep = run_soak(dsv32_path, requests=requests, seed=seed, mode=mode,
                   async_scheduling=overlapped)
    assert rep.completed + rep.aborted + rep.errored == requests
    assert rep.aborted > 0 and rep.preemptions > 0 and rep.errored > 0
    assert rep.stopped_by_stop_id > 0
    if mode != "gpu-only":
        assert rep.stats["host_read_switches"] > 0 and rep.stats["hot_misses"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("entry", range(6))
def test_gpu_soak_cuda_defaults_match_the_eager_reference(tmp_path_factory, entry):
    """Issue 21: the engine's CUDA defaults (bf16, graphs, the overlapped loop, FP8 KV, the
    score policy) and the variants of :data:`soak.GPU_MATRIX` under churn on a GPU pool that
    spills and preempts equal an eager synchronous unconstrained run; pools full afterwards.
    ``benchmarks/soak.py --device cuda`` is the long version."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from soak import GPU_MATRIX, gpu_soak_checkpoint

    path = gpu_soak_checkpoint(str(tmp_path_factory.mktemp("gpu_soak")))
    mode, extra = GPU_MATRIX[entry]
    rep = run_soak(path, requests=100, seed=100 + entry, mode=mode, device="cuda",
                   max_prompt=160, max_tokens=16, block_size=16, **extra)
    assert rep.stats["kv_cache_dtype"] == "fp8"
    assert rep.aborted > 0 and rep.preemptions > 0 and rep.stopped_by_stop_id > 0
    if mode != "gpu-only":
        assert rep.stats["host_read_switches"] > 0 and rep.stats["hot_misses"] > 0
