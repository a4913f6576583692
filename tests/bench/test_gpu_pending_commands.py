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


def test_warm_up_runs_one_whole_prefill_chunk_of_the_largest_context():
    """The warm-up compiles what the measured runs' prefill chunks run (the first measured
    mode would otherwise pay for it in its whole-run figure), within an explicit arena."""
    from hisparse.bench.decode import prefill_budget, warm_up_shape

    for contexts in ([32768], [2048, 65536], [4096]):
        ctx, n = warm_up_shape(contexts, None, 64)
        assert ctx == max(contexts) and (n - 1) * ctx == prefill_budget(ctx), contexts
    assert warm_up_shape([32768], 3 * 32776 // 64 + 1, 64) == (32768, 3)   # arena-bound
    assert warm_up_shape([32768], 100, 64) == (4096, 4)     # the arena holds no request
