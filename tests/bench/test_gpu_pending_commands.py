"""The `hisparse bench` commands of benchmarks/gpu_pending.sh parse (a typo there would cost a
GPU session's call): each reaches the CUDA check, past argument parsing."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest
import torch

from hisparse.bench.decode import main

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_pending.sh"


def bench_commands() -> list[list[str]]:
    text = SCRIPT.read_text().replace("\\\n", " ")
    cmds = []
    for line in text.splitlines():
        m = re.search(r"python3 -m hisparse\.cli bench (.*?)(;;|$)", line)
        if m:
            cmds.append(shlex.split(m.group(1).replace('"$out', '"/tmp/x')))
    return cmds


@pytest.mark.skipif(torch.cuda.is_available(), reason="would run the benchmark")
def test_every_bench_command_parses():
    cmds = bench_commands()
    assert cmds and len(cmds) == SCRIPT.read_text().count("python3 -m hisparse.cli bench ")
    for args in cmds:
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == "hisparse bench needs a CUDA device", (args, e.value.code)
