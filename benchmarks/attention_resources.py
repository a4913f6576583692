"""Registers, spills (stack bytes a thread) and shared memory of the sparse FP8 MLA attention
kernel under each launch plan, compiled for an SM90 target without a GPU (Triton's bundled
ptxas and cuobjdump): which plans the H200 call should time. A plan whose threads spill
reads and writes local memory in its inner loop.

    python3 benchmarks/attention_resources.py [--heads 16] [--arch 90]

Found (eighth session, Triton 3.6): today's 16-head plan (64 rows a block, 4 warps) is at the
255-register cap with 48 bytes of spills a thread; 8 warps (180 registers) do not spill. The
16-head sweep of ``bench_attention_plans.py`` had only timed 4 warps. Twelfth session (with the
static SASS instruction count of one warp): the compiler recomputed the dequantized tile for
each dot operand's layout; with ``_one_copy`` the default plan is 2,360 instructions a warp (from
4,168), 189 registers, no spill, 84 KB of shared memory (the tile once, for both dots).
Eighteenth session, Triton 3.6 (the device's compiler; run with it first on ``PYTHONPATH``):
the default plan is at the 255-register cap with 32 bytes of spills a thread, so registers
and shared memory (84 KB) both hold an SM at two programs. No plan of the sweep fits three:
32-row blocks take 73 KB (52 KB at one stage) but 255 registers at 4 warps, and a
168-register cap (three programs' worth) spills 320-352 bytes a thread.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)   # compile for the GPU target, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hisparse.ops._attention_triton import AttnConfig, _attn_fp8_kernel, attn_config  # noqa: E402
from hisparse.ops._common import next_pow2  # noqa: E402

# o_ptr: the chunks' partial outputs, bf16 as the engine stores them (a bf16 output)
POINTERS = dict(q_ptr="*bf16", kv_u8="*u8", kv_f32="*fp32", kv_bf16="*bf16", idx_ptr="*i32",
                o_ptr="*bf16", lse_ptr="*fp32")


def cuobjdump(cubin: bytes, *flags: str) -> list[str]:
    """Triton's bundled ``cuobjdump`` run on ``cubin`` once per flag (``-res-usage``,
    ``-sass``, ...): its outputs, in order."""
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                       "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return [subprocess.run([exe, flag, f.name], capture_output=True, text=True,
                               check=True).stdout for flag in flags]


def resources(cfg: AttnConfig, arch: int, maxnreg: int | None = None,
              int_cvt: bool = False) -> dict:
    """Compile ``_attn_fp8_kernel`` for ``cfg`` (512 + 64 latent, FP8 tiles of 128; ``int_cvt``:
    ``HISPARSE_FP8_CONVERT=int``'s dequantization) and read its resource usage from the
    cubin."""
    names = _attn_fp8_kernel.arg_names
    const = dict(K_PER_SPLIT=cfg.k_per_split, KPS_PAD=next_pow2(cfg.k_per_split), D_V=512,
                 D_PE=64, TILE=128, NT=4, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
                 IEEE=False, DIRECT=False, SKIP_EMPTY=True, INT_CVT=int_cvt)
    sig = {n: "constexpr" if n in const else POINTERS.get(n, "fp32" if n == "qk_scale" else "i32")
           for n in names}
    # as a real launch specializes them: pointers, the strides and K are multiples of 16
    # (without the strides' divisibility the loads are not vectorized: other registers)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in POINTERS or n.startswith("stride") or n == "K"}
    k = triton.compile(ASTSource(_attn_fp8_kernel, sig, const, attrs),
                       target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                    **({} if maxnreg is None else {"maxnreg": maxnreg})))
    usage, sass = cuobjdump(k.asm["cubin"], "-res-usage", "-sass")
    got = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    # one warp's static instruction count (the 64-index chunk is one block: no loop)
    n_ins = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, re.M))
    return dict(registers=int(got.get("REG", -1)), stack_bytes=int(got.get("STACK", -1)),
                shared_bytes=k.metadata.shared, instructions=n_ins)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    H = args.heads
    default = attn_config(H, 2048, True, False)
    plans = [default] + [AttnConfig(default.block_h, bn, nw, ns, 64 if H <= 16 else 512)
                         for bn in (64, 32) for nw in (4, 8) for ns in (2, 3)]
    print(f"{'rows/block':>10} {'warps':>5} {'stages':>6} {'indices/chunk':>13} {'maxnreg':>7} "
          f"{'registers':>9} {'spill B':>7} {'smem B':>7} {'SASS/warp':>9}")
    # a register cap on the default plan: its shared memory (84 KB) holds an SM at two
    # programs whatever the registers, so a cap only trades registers for spills
    runs = [(c, None, False) for c in dict.fromkeys(plans)] + [(default, None, True)] \
        + [(default, cap, False) for cap in (168, 128)]
    for c, cap, int_cvt in runs:
        try:
            r = resources(c, args.arch, cap, int_cvt)
        except Exception as e:  # noqa: BLE001  (ptxas refuses a cap below what a dot needs)
            print(f"{c.block_n:>10} {c.num_warps:>5} {c.num_stages:>6} {c.k_per_split:>13} "
                  f"{cap or '-':>7}  does not compile: {str(e).splitlines()[0][:60]}")
            continue
        print(f"{c.block_n:>10} {c.num_warps:>5} {c.num_stages:>6} {c.k_per_split:>13} "
              f"{cap or '-':>7} {r['registers']:>9} {r['stack_bytes']:>7} "
              f"{r['shared_bytes']:>7} {r['instructions']:>9}"
              + ("   (int convert)" if int_cvt
                 else "   (default)" if c == default and cap is None else ""), flush=True)


if __name__ == "__main__":
    main()
