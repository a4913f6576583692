"""benchmarks/bench_staged_prefill.py on CPU at tiny sizes: a prompt ~4x the staged modes' GPU
pool is staged (rows > 0) and its greedy tokens equal GPU-only's; the JSON and table come out."""

from __future__ import annotations

import json

import pytest


@pytest.mark.usefixtures("single_torch_thread")
def test_staged_prefill_bench_smoke(tmp_path, capsys, load_bench):
    bench = load_bench("bench_staged_prefill")
    out = tmp_path / "r.json"
    rc = bench.main(["--device", "cpu", "--context", "1024", "--layers", "2", "--block-size",
                     "16", "--dtype", "float32", "--gen-tokens", "3", "--out", str(out)])
    res = json.loads(out.read_text())
    rows = {r["mode"]: r for r in res["results"]}
    assert set(rows) == {"gpu-only", "hisparse", "always-host"}
    base = rows["gpu-only"]
    assert base["staged_rows"] == 0 and base["peak_gpu_blocks_used"] == base["num_gpu_blocks"]
    for mode in ("hisparse", "always-host"):
        r = rows[mode]
        assert r["num_gpu_blocks"] * 16 < 1024 / 2            # prompt far larger than the pool
        assert r["peak_gpu_blocks_used"] <= r["num_gpu_blocks"]
        assert r["staged_rows"] > 0 and r["staged_chunks"] > 0 and r["spilled_pages"] > 0
        assert r["staged_bytes"] == r["staged_rows"] * (64 + 16) * 4   # fp32 80-d tiny rows
        assert r["tokens"] == base["tokens"] and len(r["tokens"][0]) == 3
        assert r["lossless"] and r["staged_as_expected"] and r["prefill_tok_s"] > 0
    assert rc == 0 and res["ok"]
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-5].startswith("| mode |") and table[-1].startswith("| always-host |")


def test_staged_prefill_bench_flags_a_mismatch(tmp_path, monkeypatch, load_bench):
    """The check can fail: tokens that differ from GPU-only give exit code 1."""
    bench = load_bench("bench_staged_prefill")
    real = bench.prefill_once
    calls = []

    def fake(llm, ids, args, track_blocks):
        r = real(llm, ids, args, track_blocks)
        calls.append(1)
        if len(calls) == 2:                    # the hisparse run
            r["tokens"] = [(t + 1) % 7 for t in r["tokens"]]
        return r

    monkeypatch.setattr(bench, "prefill_once", fake)
    rc = bench.main(["--device", "cpu", "--context", "512", "--layers", "1", "--block-size",
                     "16", "--dtype", "float32", "--gen-tokens", "1", "--modes",
                     "gpu-only,hisparse", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "bench_staged_prefill.json").read_text())
    assert rc == 1 and not res["ok"] and res["results"][1]["lossless"] is False
