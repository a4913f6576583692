"""The fused MoE layer's grouped GEMMs, token tiles on the MMA's M side (``HISPARSE_MOE_GEMM=
tiles``, the default) against the weight rows there (``swapped``: ``h^T = W x^T``), at one
TP-8 rank of DeepSeek-V3.2 (256 FP8 experts of I = 256, D = 7168, the shared expert fused):
the whole layer per call (router to combine, ``bench_moe_launch.timed``) at each token count,
the swapped GEMMs at each candidate launch (``_moe_triton.SWAPPED_LAUNCHES``, printed ready to
paste), and the largest difference from the tile-major layer's output.

Why (eighth session, compiled for sm_90 on the CPU box with Triton 3.6): with a tile's 16
token rows on M the tile-major kernels lower their FP8 dots to f16 ``mma.sync`` (both tiles
upcast in registers; 100-110 registers, pipelined, no spills); with 64-128 weight rows on M
and the 16 tokens on N the same dot is a native FP8 warp-group MMA fed by ``cp.async``
stages, at 34-80 registers. The split-K linears already compute this way. Whether that is
faster for kernels near their read bandwidth (~0.8 at 24 tokens) is what this measures; the
swapped kernels give other bits (another MMA accumulation), batch invariant as well.

    PYTHONPATH=. python3 benchmarks/bench_moe_swap_ab.py [--tokens 1,8,24,64,96] [--out f.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GATE_UP_CANDIDATES = [(64, 4, 3), (64, 4, 4), (64, 8, 3), (64, 8, 4), (128, 4, 3), (128, 8, 3)]
DOWN_CANDIDATES = [(128, 4, 3), (128, 4, 4), (128, 8, 3), (64, 4, 3), (64, 8, 3)]


def main() -> None:
    from bench_moe_launch import ROUTING, D, rank_layer, timed

    from hisparse.ops import _moe_triton as M
    from hisparse.ops import switches
    from hisparse.ops.moe_layer import moe_layer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,8,24,64,96")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layer = rank_layer(dev)

    def run(x):
        return moe_layer(x, layer["router_weight"], layer["router_bias"], ROUTING,
                         layer["gate_up"], layer["down"], gate_up_scale=layer["gate_up_scale"],
                         down_scale=layer["down_scale"], block=(128, 128),
                         shared=layer["shared"])

    saved = dict(M.SWAPPED_LAUNCHES)
    rows = []
    try:
        for T in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
            row = {"T": T, "tiles_us": timed(layer, x), "swapped_us": {}}
            tiles_out = run(x).float()
            with switches.override(moe_gemm="swapped"):
                for gu, dn in itertools.product(GATE_UP_CANDIDATES, DOWN_CANDIDATES):
                    M.SWAPPED_LAUNCHES.update(gate_up=gu, down=dn)
                    row["swapped_us"][f"{gu}|{dn}"] = timed(layer, x)
                best = min(row["swapped_us"], key=row["swapped_us"].get)
                gu, dn = (tuple(int(v) for v in p.strip("()").split(","))
                          for p in best.split("|"))
                M.SWAPPED_LAUNCHES.update(gate_up=gu, down=dn)
                diff = (run(x).float() - tiles_out).abs().max().item()
            row.update(best=best, max_abs_diff=diff, scale=tiles_out.abs().max().item())
            rows.append(row)
            print(f"T={T:3d}: tiles {row['tiles_us']:7.1f} us, swapped best {best} "
                  f"{row['swapped_us'][best]:7.1f} us "
                  f"({row['swapped_us'][best] / row['tiles_us']:.2f}x; max |diff| {diff:.3g} "
                  f"of {row['scale']:.3g})", flush=True)
    finally:
        M.SWAPPED_LAUNCHES.clear()
        M.SWAPPED_LAUNCHES.update(saved)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
