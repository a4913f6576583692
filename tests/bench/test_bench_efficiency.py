"""The bench's per-request efficiency table (issue 24's figure and its fixed-cost ceiling)."""

import math
from dataclasses import replace

import pytest

from hisparse.bench import report


def _point(mode: str, running: int, wall_ms: float, **kw) -> report.Point:
    """A measured point whose steady tok/s follows from its running count and step time."""
    return report.Point(mode=mode, topk_source="synthetic:0.8", context=32768,
                        concurrency=kw.pop("concurrency", running), outputs=256,
                        decode_tok_s=0.0, tpot_p50_ms=1.0, tpot_p99_ms=1.0,
                        running_reached=running, hot_hit_rate=0.9, h2d_gb_s=0.0, gpu_mem_gib=1.0,
                        host_pool_gib=1.0, num_preempted=0, spilled_pages=0, wall_s=1.0,
                        steady_tok_s=running / wall_ms * 1e3, wall_ms_per_step=wall_ms, **kw)


def test_efficiency_against_gpu_only_line():
    # GPU-only on the line 5 + 0.5 n; HiSparse at 56 one ms above that line
    # a second point at 31 running, of a smaller concurrency (listed later): not the fit's
    pts = [_point("gpu-only", 8, 9.0), _point("gpu-only", 24, 17.0),
           _point("gpu-only", 31, 20.5, concurrency=56), _point("hisparse", 56, 34.0),
           _point("gpu-only", 31, 25.0, concurrency=31)]
    (row,) = report.efficiency_rows(pts)
    assert (row["running"], row["gpu_only_running"]) == (56, 31)
    assert row["efficiency"] == pytest.approx((56 / 34.0) / (31 / 20.5) / (56 / 31))
    assert row["fixed_ms"] == pytest.approx(5.0) and row["ms_per_request"] == pytest.approx(0.5)
    assert row["ceiling"] == pytest.approx(20.5 / 33.0)
    assert row["vs_line"] == pytest.approx(33.0 / 34.0)
    assert row["extra_ms_per_request"] == pytest.approx((34.0 - 20.5) / 25)
    # the figure never exceeds its ceiling when HiSparse is at or above the line
    assert row["efficiency"] <= row["ceiling"]


def test_efficiency_needs_a_gpu_only_point_below_and_two_for_the_fit():
    one = [_point("gpu-only", 31, 20.5), _point("always-host", 56, 40.0, hot_policy="lru")]
    (row,) = report.efficiency_rows(one)
    assert row["efficiency"] == pytest.approx((56 / 40.0) / (31 / 20.5) / (56 / 31))
    assert all(math.isnan(row[k]) for k in ("fixed_ms", "ms_per_request", "ceiling", "vs_line"))
    # HiSparse at or below GPU-only's count, or another context / source: no row
    level = _point("hisparse", 31, 21.0)
    assert report.efficiency_rows([_point("gpu-only", 31, 20.5), level]) == []
    other = replace(_point("hisparse", 56, 34.0), context=65536)
    assert report.efficiency_rows([_point("gpu-only", 31, 20.5), other]) == []
    src = replace(_point("hisparse", 56, 34.0), topk_source="synthetic:0.9")
    assert report.efficiency_rows([_point("gpu-only", 31, 20.5), src]) == []


def test_report_joins_runs(tmp_path, capsys):
    """``python -m hisparse.bench.report`` over two runs' JSON: the efficiency row needs the
    GPU-only point of one and the HiSparse point of the other."""
    import json
    from dataclasses import asdict

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([asdict(_point("gpu-only", 31, 20.5)),
                             asdict(_point("hisparse", 56, 34.0))]))
    b.write_text(json.dumps([asdict(_point("gpu-only", 8, 9.0))]))
    assert [p.mode for p in report.load_points([str(a), str(b)])] == ["gpu-only", "hisparse",
                                                                        "gpu-only"]
    assert report.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    point_row = "hisparse | lru | synthetic:0.8 | 32768 | 56 |"     # the points' table
    assert sum(line.startswith(point_row) for line in out) == 1
    rows = [line for line in out if line.startswith("hisparse | lru | 32768 | 56 | 31 |")]
    assert len(rows) == 1           # the efficiency table's row
    fixed, per_request = (float(v) for v in rows[0].split(" | ")[6:8])
    assert fixed == pytest.approx(5.0, abs=1e-3) and per_request == pytest.approx(0.5, abs=1e-4)
