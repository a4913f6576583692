"""The command line: simulate (KV core + fake worker) and generate (a tiny checkpoint)."""

import json

from hisparse.cli import main
from hisparse.models.random_checkpoint import make_random_checkpoint


def test_simulate_prints_every_design(capsys):
    assert main(["simulate", "--requests", "6", "--max-len", "128", "--block-size", "8",
                 "--gpu-blocks", "40", "--check", "--json"]) == 0
    out = capsys.readouterr().out
    results = json.loads(out.strip().splitlines()[-1])
    assert set(results) == {"gpu-only", "hisparse", "always-host"}
    assert all(r["finished"] == 6 for r in results.values())
    assert results["hisparse"]["hot_misses"] > 0
    assert results["gpu-only"]["peak_running"] < results["hisparse"]["peak_running"]


def test_generate_from_token_ids(tmp_path, capsys):
    path = make_random_checkpoint(tmp_path / "ck", "deepseek_v32", seed=1, num_hidden_layers=2)
    assert main(["generate", "--model", path, "--prompt-ids", "5,6,7,8,9", "--max-tokens", "4",
                 "--ignore-eos", "--device", "cpu", "--dtype", "float32", "--block-size", "8",
                 "--host-pool-gib", "0.01", "--max-model-len", "64"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()
             if line.startswith("{")]
    assert len(lines[0]["token_ids"]) == 4 and lines[0]["finish_reason"] == "length"
    assert "hot_hits" in lines[-1]


def test_engine_flags_reach_llm_kwargs():
    import argparse

    from hisparse.engine.arg_utils import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    import inspect

    from hisparse import LLM

    kw = engine_kwargs(p.parse_args([]))
    llm_defaults = inspect.signature(LLM.__init__).parameters
    for name in ("gc_freeze", "kv_cache_dtype", "hot_policy"):   # the CLI's defaults are LLM's
        assert kw[name] == llm_defaults[name].default, name
    kw = engine_kwargs(p.parse_args(["--no-gc-freeze", "--kv-cache-dtype", "fp8",
                                     "--hot-policy", "score+prefetch", "--hot-prefetch-rows", "4"]))
    assert kw["gc_freeze"] is False and kw["kv_cache_dtype"] == "fp8"
    assert kw["hot_policy"] == "score+prefetch" and kw["hot_prefetch_rows"] == 4
