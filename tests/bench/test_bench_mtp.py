"""benchmarks/bench_mtp.py on CPU at tiny sizes: injected acceptance is realised exactly (1.0 and
0.0), every speculative run is lossless vs k = 0, also under GPU pressure (host reads)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.usefixtures("single_torch_thread")
def test_bench_mtp_smoke(tmp_path, load_bench):
    bench = load_bench("bench_mtp")
    out = tmp_path / "mtp.json"
    rc = bench.main(["--device", "cpu", "--requests", "2", "--context", "96", "--outputs", "10",
                     "--ks", "1,2", "--accepts", "0.0,1.0", "--out", str(out)])
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert rc == 0 and res["ok"] and len(rows) == 5 and rows[0]["k"] == 0
    for r in rows[1:]:
        assert r["lossless"] and r["spec_draft_tokens"] > 0 and r["decode_tok_s"] > 0
        if r["accept_injected"] == 1.0:
            assert r["spec_acceptance_rate"] == 1.0
            assert r["spec_mean_accepted_length"] > 1 + 0.5 * r["k"]
        else:
            assert r["spec_acceptance_rate"] == 0.0 and r["spec_mean_accepted_length"] == 1.0


@pytest.mark.usefixtures("single_torch_thread")
def test_bench_mtp_under_gpu_pressure(tmp_path, load_bench):
    bench = load_bench("bench_mtp")
    out = tmp_path / "mtp.json"
    rc = bench.main(["--device", "cpu", "--requests", "2", "--context", "256", "--outputs", "12",
                     "--ks", "2", "--accepts", "0.7", "--gpu-blocks", "8", "--batched-tokens",
                     "64", "--warmup", "--warmup-context", "64", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0 and rows[1]["lossless"]
    assert rows[0]["hot_misses"] > 0 and rows[1]["hot_misses"] > 0
