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
