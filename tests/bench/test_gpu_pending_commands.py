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
        m = re.search(r"python3 (?:-m hisparse\.cli|benchmarks/bench_rank_attn_plan\.py \S+) "
                      r"bench (.*?)(;;|$)", line)
        if m:
            words = shlex.split(m.group(1).replace('"$out', '"/tmp/x'))
            # an optional argument array the script expands ("${cut[@]}"): none here
            cmds.append([w for w in words if not w.startswith("${")])
    return cmds


@pytest.mark.skipif(torch.cuda.is_available(), reason="would run the benchmark")
def test_every_bench_command_parses():
    cmds = bench_commands()
    text = SCRIPT.read_text()
    assert cmds and len(cmds) == (text.count("python3 -m hisparse.cli bench ")
                                  + text.count("python3 benchmarks/bench_rank_attn_plan.py "))
    for args in cmds:
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == "hisparse bench needs a CUDA device", (args, e.value.code)


def test_warm_up_runs_one_whole_prefill_chunk_then_a_mixed_one():
    """The warm-up compiles what the measured runs' prefill chunks run (the first measured
    mode would otherwise pay for it in its whole-run figure), within the points' bound."""
    from hisparse.bench.decode import prefill_budget, warm_up_requests

    for ctx in (2048, 4096, 32768, 65536):
        assert (warm_up_requests(ctx, 1 << 20) - 1) * ctx == prefill_budget(ctx), ctx
    assert warm_up_requests(32768, 3) == 3 and warm_up_requests(32768, 0) == 1


def test_forced_attention_plan_replaces_only_the_16_head_fp8_plan(load_bench):
    """bench_rank_attn_plan.py's plan (the names bench_attention_plans.py prints) replaces the
    package's at <= 16 heads for compiled FP8 rows, and nowhere else."""
    from hisparse.ops._attention_triton import AttnConfig, attn_config

    forced = load_bench("bench_rank_attn_plan").forced_plan("32/8/3/128")
    assert forced(16, 2048, True, False) == AttnConfig(16, 32, 8, 3, 128)
    assert forced(8, 100, True, False) == AttnConfig(16, 32, 8, 3, 128)
    assert forced(16, 60, True, False).k_per_split == 64       # no wider than K in blocks
    for args in [(64, 2048, True, False), (16, 2048, False, False), (16, 2048, True, True)]:
        assert forced(*args) == attn_config(*args), args
    with pytest.raises(ValueError, match="MAX_SPLITS"):
        load_bench("bench_rank_attn_plan").forced_plan("16/4/2/16")(16, 2048, True, False)

