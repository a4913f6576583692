"""Programmatic dependent launch (PDL) on a chain of small Triton kernels in a CUDA graph.

Result (H200, docs/BENCHMARKS.md, seventh session): 0.3-0.4 us saved a launch here, but the
engine's MoE, attention and resolver kernels launched so gave the same real-rank step (16.36
vs 16.37 ms at 8 x 32k, 46.35 vs 46.34 at 2k x 96): the engine does not use it.

The decode step of a real rank is ~2,000 launches, most of them small: this probe measures what
one kernel boundary costs in graph replay with and without PDL (``launch_pdl=True``, the kernel
waiting on its predecessor with ``gdc_wait`` before it reads), and checks that the chain's
result stays right (each kernel reads its predecessor's output).

Variants: ``plain``; ``pdl`` (``gdc_wait`` first); ``pdl+trigger`` (``gdc_launch_dependents``
then ``gdc_wait``: the next kernel may start its prologue as soon as every program got there);
``mixed`` (PDL kernels with a torch elementwise op every 4th launch, as a decode layer mixes
cuBLAS and torch launches in) against ``mixed-plain`` (the same chain without PDL).

    python3 benchmarks/probe_pdl.py [--chain 256] [--programs 8,132] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _step_kernel(src, dst, n, BLOCK: tl.constexpr, WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(src + offs, mask=m)
    tl.store(dst + offs, x + 1.0, mask=m)


def _chain(a: torch.Tensor, b: torch.Tensor, length: int, programs: int, variant: str) -> None:
    n = a.numel()
    block = triton.next_power_of_2(triton.cdiv(n, programs))
    pdl = variant in ("pdl", "pdl+trigger", "mixed")
    for i in range(length):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        if variant.startswith("mixed") and i % 4 == 3:
            torch.add(src, 1.0, out=dst)
            continue
        _step_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, WAIT=pdl,
                                               TRIGGER=variant == "pdl+trigger",
                                               launch_pdl=pdl)


def measure(length: int, programs: int, variant: str, elems: int, reps: int = 20) -> dict:
    a = torch.zeros(elems, device="cuda", dtype=torch.float32)
    b = torch.zeros_like(a)
    _chain(a, b, length, programs, variant)      # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _chain(a, b, length, programs, variant)
    a.zero_()
    b.zero_()
    g.replay()
    torch.cuda.synchronize()
    final = a if length % 2 == 0 else b
    ok = bool((final == float(length)).all())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    us = times[len(times) // 2]
    return dict(variant=variant, programs=programs, chain=length, elems=elems, correct=ok,
                us_per_graph=round(us, 1), us_per_launch=round(us / length, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chain", type=int, default=256)
    ap.add_argument("--programs", default="8,132")
    ap.add_argument("--elems", type=int, default=8 * 7168)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for programs in (int(p) for p in args.programs.split(",")):
        for variant in ("plain", "pdl", "pdl+trigger", "mixed-plain", "mixed"):
            rows.append(measure(args.chain, programs, variant, args.elems))
    print(f"{'variant':>12} {'programs':>8} {'us/launch':>10} {'correct':>8}")
    for r in rows:
        print(f"{r['variant']:>12} {r['programs']:>8} {r['us_per_launch']:>10} {r['correct']!s:>8}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
