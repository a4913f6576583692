"""The fused MoE layer's grouped-GEMM launches (``num_warps``, ``num_stages``) per token count,
at one TP-8 rank of DeepSeek-V3.2 (256 FP8 experts of I = 256 per rank, D = 7168, the shared
expert fused, V3.2's grouped routing over random router weights): the measurement behind
``_moe_triton.MOE_LAUNCHES``, against the runtime autotune it replaces (tuned here on the first
token count only, as an engine tunes it on its first call).

For each token count: the gate-up kernel's candidates (``_gemm_triton.TUNE_CONFIGS``) with the
down kernel at the first, then the down kernel's with the gate-up at its best; each time is
the whole layer per call (router to combine) from a CUDA graph of 10 back-to-back calls
(``bench_ops.timeit_graph``). Prints a table and the ``MOE_LAUNCHES`` entries, ready to paste.

Usage (repository root, CUDA; ~1-2 min, most of it compiling):
    PYTHONPATH=. python benchmarks/bench_moe_launch.py [--tokens 1,8,24,96] [--out moe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ops import timeit_graph  # noqa: E402

from hisparse.ops import _moe_triton as M  # noqa: E402
from hisparse.ops._gemm_triton import TUNE_CONFIGS  # noqa: E402
from hisparse.ops.gemm import quantize_fp8_weight  # noqa: E402
from hisparse.ops.moe_layer import RoutingConfig, SharedExpert, moe_layer  # noqa: E402

E, I, D = 256, 256, 7168
ROUTING = RoutingConfig(top_k=8, n_group=8, topk_group=4, norm_topk_prob=True,
                        routed_scaling_factor=2.5)


def rank_layer(dev):
    """Random FP8 experts, shared expert and fp32 router of one rank's MoE layer."""
    gu, gus = quantize_fp8_weight(torch.randn(E, 2 * I, D, device=dev) * 0.02)
    dn, dns = quantize_fp8_weight(torch.randn(E, D, I, device=dev) * 0.02)
    sh = [quantize_fp8_weight(torch.randn(shape, device=dev) * 0.02)
          for shape in ((I, D), (I, D), (D, I))]
    shared = SharedExpert(sh[0][0], sh[1][0], sh[2][0], sh[0][1], sh[1][1], sh[2][1])
    router = torch.randn(E, D, device=dev) * 0.02
    bias = torch.randn(E, device=dev) * 0.01
    return dict(router_weight=router, router_bias=bias, gate_up=gu, down=dn,
                gate_up_scale=gus, down_scale=dns, shared=shared)


def timed(layer, x) -> float:
    return 1e6 * timeit_graph(lambda: moe_layer(
        x, layer["router_weight"], layer["router_bias"], ROUTING, layer["gate_up"],
        layer["down"], gate_up_scale=layer["gate_up_scale"], down_scale=layer["down_scale"],
        block=(128, 128), shared=layer["shared"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default=",".join(map(str, M.MOE_T_BUCKETS)))
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layer = rank_layer(dev)
    tokens = [int(t) for t in a.tokens.split(",")]
    cands = [(c.num_warps, c.num_stages) for c in TUNE_CONFIGS]
    saved = dict(M.MOE_LAUNCHES)
    try:
        rows = sweep(layer, tokens, cands, dev)
    finally:                        # the module's table as it was, whatever happened
        M.MOE_LAUNCHES.clear()
        M.MOE_LAUNCHES.update(saved)
    print("\nMOE_LAUNCHES = {  # (kernel, I, D, token bucket): (num_warps, num_stages)")
    for r in rows:
        b = M.t_bucket(r["T"])
        print(f'    ("gate_up", {I}, {D}, {b}): {r["best_gate_up"]}, '
              f'("down", {I}, {D}, {b}): {r["best_down"]},')
    print("}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def sweep(layer, tokens: list[int], cands: list[tuple[int, int]], dev) -> list[dict]:
    """The autotuned layer at every token count, then each kernel's candidates (module doc)."""
    rows = []
    # the autotune as an engine runs it: tuned on the first call, kept for every count
    M.MOE_LAUNCHES.clear()
    auto = {T: timed(layer, torch.randn(T, D, device=dev, dtype=torch.bfloat16))
            for T in tokens}
    print(f"{'T':>4} | {'autotune':>8} | {'best':>8} gate_up  down  | per candidate (us)")
    for T in tokens:
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        b = M.t_bucket(T)
        row = {"T": T, "autotune_us": auto[T], "gate_up": {}, "down": {}}
        M.MOE_LAUNCHES[("down", I, D, b)] = cands[0]
        for c in cands:
            M.MOE_LAUNCHES[("gate_up", I, D, b)] = c
            row["gate_up"][str(c)] = timed(layer, x)
        gu = min(cands, key=lambda c: row["gate_up"][str(c)])
        M.MOE_LAUNCHES[("gate_up", I, D, b)] = gu
        for c in cands:
            M.MOE_LAUNCHES[("down", I, D, b)] = c
            row["down"][str(c)] = timed(layer, x)
        dn = min(cands, key=lambda c: row["down"][str(c)])
        M.MOE_LAUNCHES[("down", I, D, b)] = dn
        row.update(best_gate_up=gu, best_down=dn, best_us=row["down"][str(dn)])
        rows.append(row)
        cells = " ".join(f"{k}:{v:.0f}" for k, v in row["gate_up"].items())
        print(f"{T:>4} | {auto[T]:8.1f} | {row['best_us']:8.1f} {gu} {dn} | gu {cells}",
              flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
