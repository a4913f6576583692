"""benchmarks/bench_scheduler.py on CPU at tiny sizes: the engine step path runs with the
host-path worker (every request in host-read mode, streamed every step) and reports every phase;
the scheduler-only mode still runs."""

from __future__ import annotations

import pytest


@pytest.mark.usefixtures("single_torch_thread")
def test_bench_scheduler_engine_phases(load_bench):
    bench = load_bench("bench_scheduler")
    res = bench.run_engine(requests=6, context=700, block_size=16, steps=8, mode="always-host")
    assert res["host_read_requests"] == 6 and res["steps"] == 8
    phases = res["ms_per_step"]
    assert set(phases) == {"schedule", "stage_plan", "stage_tokens", "sampling", "update",
                           "outputs", "other", "total"}
    assert all(p["median"] >= 0 for p in phases.values()) and phases["total"]["median"] > 0
    # StepState uploaded the rows the KV core reported, not whole tables every step
    assert 0 < res["table_rows_uploaded_per_step"] < 6 * 4


def test_bench_scheduler_scheduler_only(load_bench):
    bench = load_bench("bench_scheduler")
    res = bench.run(requests=4, context=300, block_size=16, steps=5, mode="hisparse")
    assert res["steps"] == 5 and res["step_ms_median"] > 0
