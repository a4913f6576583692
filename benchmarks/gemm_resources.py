"""Registers, spills, shared memory and the MMA waits of the split-K FP8 linear kernel under each
candidate launch, compiled for an SM90 target without a GPU (Triton's bundled ptxas and
cuobjdump): which launches can keep MMAs in flight, before a GPU times them.

    python3 benchmarks/gemm_resources.py [--rows 96] [--arch 90]

Per launch (:func:`hisparse.ops._gemm_splitk_triton.splitk_configs` for ``--rows``): the
``wgmma`` instructions of the kernel, how many ``wgmma.wait_group 0`` follow them (a wait for
every MMA group just issued: the K loop's MMAs run one at a time), how many wait for all but
the newest (``wait_group 1`` or more: MMAs in flight across K blocks), and the deepest
``cp.async.wait_group`` (load groups a program keeps in flight).

Found (fifteenth session, Triton 3.9): every FP8 launch waits for each K block's four
``m64nNk32`` MMAs before the block's scaled add (``acc += dot * (s_w * s_a)``); Triton makes a
dot asynchronous only as a loop-carried accumulator (``acc = tl.dot(a, b, acc)``), which the
per-block scales rule out (unrolling two blocks a step gives two synchronous dots). Those waits
are not what holds the linears at ~0.3 of bandwidth: a W8A16 variant (weight tiles dequantized
to bf16, one loop-carried accumulator, ``wait_group 1`` in its loop) was slower at every row
count on an H100 (sixteenth session, docs/BENCHMARKS.md) and was removed.
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.pop("TRITON_INTERPRET", None)   # compile for the GPU target, not the interpreter

import triton  # noqa: E402
from attention_resources import cuobjdump  # noqa: E402  (benchmarks/: the script's directory)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hisparse.ops._gemm_splitk_triton import (  # noqa: E402
    LEVELS,
    SplitKConfig,
    _fp8_splitk_kernel,
    splitk_configs,
)

POINTERS = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32",
                out_ptr="*fp32")


def resources(cfg: SplitKConfig, arch: int, block: int = 128) -> dict:
    """Compile the split-K kernel for ``cfg`` (activations quantized in the K loop or before, as
    ``cfg.quant`` says) and read its resources from the cubin and its MMA waits from the PTX."""
    kernel = _fp8_splitk_kernel
    names = kernel.arg_names
    const = dict(BPG=1, LEVEL=LEVELS.index(cfg.level), BLOCK_T=cfg.block_t,
                 BLOCK_N=cfg.block_n, BLOCK_K=block, SCALE_N=block)
    quant_a = cfg.quant == "gemm"    # bf16 x quantized in the K loop
    const.update(QUANT_A=quant_a, POW2=False)
    pointers = dict(POINTERS, x_ptr="*bf16") if quant_a else POINTERS
    sig = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in names}
    # as a real launch specializes them: pointers, strides, N and K are multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in pointers or n.startswith("stride") or n in ("N", "K")}
    k = triton.compile(ASTSource(kernel, sig, const, attrs),
                       target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ptx = k.asm["ptx"]
    (usage,) = cuobjdump(k.asm["cubin"], "-res-usage")
    got = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    loads = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]
    return dict(registers=int(got.get("REG", -1)), stack_bytes=int(got.get("STACK", -1)),
                shared_bytes=k.metadata.shared,
                mmas=len(re.findall(r"wgmma\.mma_async", ptx)),
                mma_waits_0=len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0", ptx)),
                mma_waits_other=len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+[1-9]",
                                               ptx)),
                loads_in_flight=max(loads, default=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=96, help="M: the candidates of its bucket")
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    print(f"{'launch':>28} {'registers':>9} {'spill B':>7} {'smem B':>7} {'wgmma':>5} "
          f"{'wait 0':>6} {'wait >0':>7} {'cp.async groups ahead':>21}")
    for cfg in splitk_configs(args.rows):
        r = resources(cfg, args.arch)
        print(f"{str(cfg):>28} {r['registers']:>9} {r['stack_bytes']:>7} {r['shared_bytes']:>7} "
              f"{r['mmas']:>5} {r['mma_waits_0']:>6} {r['mma_waits_other']:>7} "
              f"{r['loads_in_flight']:>21}", flush=True)


if __name__ == "__main__":
    main()
