"""The serving side of the command line: --version, python -m, one-line errors, bench-serve."""

import json
import runpy
import sys

import pytest

from hisparse.cli import main


def test_version_and_python_dash_m(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["hisparse", "--version"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("hisparse", run_name="__main__")
    assert e.value.code == 0 and capsys.readouterr().out.startswith("hisparse ")


def test_serve_user_error_is_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model: no such checkpoint")
    with pytest.raises(ValueError):
        main(["serve", str(tmp_path / "missing"), "--device", "cpu", "--debug"])
    assert main(["serve", str(tmp_path), "--port", "70000"]) == 2


def test_bench_serve_smoke(model_dir, capsys):
    assert main(["bench-serve", "--model", model_dir, "--modes", "hisparse", "--device", "cpu",
                 "--dtype", "float32", "--block-size", "8", "--max-model-len", "96",
                 "--max-num-seqs", "4", "--host-pool-gib", "0.01", "--num-prompts", "4",
                 "--input-len", "30", "--output-len", "4", "--request-rate", "100",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["mode"] == "hisparse" and res["completed"] == 4 and res["failed"] == 0
    assert res["ttft_p50_ms"] > 0 and res["tpot_p50_ms"] > 0
