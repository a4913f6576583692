"""``hisparse bench`` with the FP8 sparse attention's 16-head launch plan replaced (measurement
only: the plan the package picks, :func:`hisparse.ops._attention_triton.attn_config`, stays
as it is). A plan from ``bench_attention_plans.py`` is timed inside the real rank's step
against the package's, in the same device call:

    PYTHONPATH=. python3 benchmarks/bench_rank_attn_plan.py BN/WARPS/STAGES/KPS bench \\
        --model-shape deepseek-v3.2-tp8-rank --kv-cache-dtype fp8 ... (hisparse bench's options)

``BN/WARPS/STAGES/KPS``: rows a block, warps, pipeline stages, indices a chunk (the names
``bench_attention_plans.py`` prints). The plan still depends on the head and index counts
only, so outputs stay batch invariant (their last bits are the plan's).
"""
from __future__ import annotations

import sys

import triton

import hisparse.ops._attention_triton as AT
from hisparse.cli import main


def forced_plan(spec: str):
    """``attn_config`` with ``spec`` at <= 16 heads for FP8 rows (compiled kernels), the
    package's plan elsewhere."""
    bn, warps, stages, kps = (int(v) for v in spec.split("/"))
    package = AT.attn_config

    def attn_config(H: int, K: int, fp8: bool, is_fp32: bool) -> AT.AttnConfig:
        if H > 16 or not fp8 or is_fp32:
            return package(H, K, fp8, is_fp32)
        plan = AT.AttnConfig(16, bn, warps, stages, min(kps, triton.cdiv(K, bn) * bn))
        if plan.splits(K) > AT.MAX_SPLITS:      # the merge holds MAX_SPLITS chunk rows
            raise ValueError(f"plan {spec}: {plan.splits(K)} chunks of {K} indices, more than "
                             f"MAX_SPLITS ({AT.MAX_SPLITS})")
        return plan
    return attn_config


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] != "bench":
        sys.exit(__doc__)
    AT.attn_config = forced_plan(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
