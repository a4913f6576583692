"""Registers, spills and the per-block instruction cost of the fused top-k kernel, compiled for an
SM90 target without a GPU (Triton's bundled ptxas and cuobjdump): where a launch's time can go
before a GPU times it.

    python3 benchmarks/topk_resources.py [--arch 90] [--sparse 0,64] [--block 1024]
        [--short 4096,8192]

Per order (column order, ranked) and ``TopkLaunch.sparse``: registers a thread, spill bytes,
programs an SM fits (:func:`hisparse.ops._topk_triton._fits_per_sm`, 4 warps), SASS
instructions a warp, and for each loop of the kernel (a backward branch over more than 16
instructions, in program order: the four digit histograms, then the collect) its instructions
a warp and the ``VOTE`` / ``POPC`` / ``REDG`` among them; then the short rows' kernel
(``TopkLaunch.short_rows``) at each ``--short``. A histogram loop iteration is one key
block: ``tl.histogram`` of 256 bins lowers to 8 ``VOTE`` ballots a key slot (8 slots a thread at
4 warps and 1,024 keys) and ~8 logic ops and a ``POPC`` for each of a thread's 8 bins.

Found (twenty-ninth session, Triton 3.6): a histogram block is 690-870 instructions a warp and
the collect's ~740; at 4 programs an SM the passes are issue-bound (~1.2-1.7 us a block, what
``probe_topk_phases.py`` measured), whatever share of the block is in the threshold bucket,
hence the later digits' atomics for sparse blocks (``TopkLaunch.sparse``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)   # compile for the GPU target, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from attention_resources import cuobjdump  # noqa: E402

from hisparse.ops import _topk_triton as tk  # noqa: E402
from hisparse.ops._common import MAX_SPLITS, RADIX_BINS, RADIX_LEVELS  # noqa: E402

POINTERS = dict(keys_ptr="*i32", len_ptr="*i32", hist_ptr="*i32", split_ptr="*i32",
                count_ptr="*i32", out_ptr="*i32", sorted_ptr="*i64", stall_ptr="*i32",
                long_ptr="*i32")
WARPS = 4
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
COUNTED = ("VOTE", "POPC", "REDG")


def _compile(kernel, const: dict, pointers: dict, warps: int, stages: int, arch: int):
    """``kernel`` compiled for ``arch`` with ``const`` constexprs, ``pointers`` typed as given
    and the other arguments int32; pointers and strides specialized as a real launch does
    (multiples of 16)."""
    names = kernel.arg_names
    const = {n: v for n, v in const.items() if n in names}
    sig = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in pointers or n.startswith("stride")}
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def compile_fused(columns: bool, sparse: int, block: int, arch: int):
    """The one-launch kernel as ``topk_select_triton`` launches it by default (live rows, k up
    to 2,048 in chunks of 256), for ``arch``: the compiled kernel."""
    last = RADIX_LEVELS + (1 if columns else 2)
    const = dict(FIRST=0, LAST=last, LEVELS=RADIX_LEVELS, NB=RADIX_BINS, BLOCK=block,
                 STATE=tk.STATE_OFFSET, BAR=tk.BAR_OFFSET, FOR_LOOP=True, STAGES=2, CH=256,
                 LOG_CH=8, C=8, CPAD=8, MAXS=MAX_SPLITS, SPIN=tk.SPIN_POLLS, LIVE=True,
                 TPAD=tk.LIVE_MAX_ROWS, FILL=True, RANKED=not columns, COLUMNS=columns,
                 SPARSE=min(sparse, block))
    return _compile(tk._topk_select_kernel, const, POINTERS, WARPS, 2, arch)


def compile_short(row: int, k: int, arch: int):
    """The short rows' kernel (``TopkLaunch(short_rows=row)``) as ``topk_select_triton``
    launches it for ``k``: the compiled kernel."""
    const = dict(ROW=row, NB=RADIX_BINS, LEVELS=RADIX_LEVELS,
                 KPAD=max(16, triton.next_power_of_2(k)))
    return _compile(tk._topk_short_kernel, const, POINTERS, tk.short_warps(row), 1, arch)


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def loops(sass: str) -> list[dict]:
    """The kernel's loops in program order: each backward branch over more than 16
    instructions, its instruction count and the :data:`COUNTED` opcodes in it."""
    ins = [(int(a, 16), t) for a, t in LINE.findall(sass)]
    found = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [_opcode(t) for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if len(body) > 16:
                ops = collections.Counter(body)
                found.append(dict(instructions=len(body), **{o: ops[o] for o in COUNTED}))
    return found


def resources(columns: bool, sparse: int, block: int, arch: int, short: int = 0) -> dict:
    """``short``: the short rows' kernel for rows of that many columns (k = 2048) instead."""
    k = compile_short(short, 2048, arch) if short else compile_fused(columns, sparse, block, arch)
    warps = k.metadata.num_warps
    usage, sass = cuobjdump(k.asm["cubin"], "-res-usage", "-sass")
    got = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    regs = int(got.get("REG", -1))
    return dict(registers=regs, stack_bytes=int(got.get("STACK", -1)),
                per_sm=tk._fits_per_sm(regs, k.metadata.shared, warps),
                instructions=len(LINE.findall(sass)), loops=loops(sass))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sparse", default="0,64", help="TopkLaunch.sparse values")
    ap.add_argument("--block", type=int, default=1024, help="TopkLaunch.block")
    ap.add_argument("--short", default="4096,8192", help="TopkLaunch.short_rows values")
    args = ap.parse_args()
    print(f"{'order':>7} {'sparse':>6} {'registers':>9} {'spill B':>7} {'per SM':>6} "
          f"{'SASS/warp':>9} | loops: instructions (VOTE / POPC / REDG)")
    for columns in (True, False):
        for sparse in (int(s) for s in args.sparse.split(",")):
            r = resources(columns, sparse, args.block, args.arch)
            body = "  ".join(f"{lp['instructions']} ({lp['VOTE']}/{lp['POPC']}/{lp['REDG']})"
                             for lp in r["loops"])
            print(f"{'cols' if columns else 'ranked':>7} {sparse:>6} {r['registers']:>9} "
                  f"{r['stack_bytes']:>7} {r['per_sm']:>6} {r['instructions']:>9} | {body}",
                  flush=True)
    for short in (int(s) for s in args.short.split(",") if s):
        r = resources(True, 0, args.block, args.arch, short)
        print(f"short rows of {short} (one program a row, "
              f"{tk.short_warps(short)} warps): {r['registers']} registers, "
              f"{r['stack_bytes']} B spill, {r['per_sm']} an SM, {r['instructions']} SASS",
              flush=True)


if __name__ == "__main__":
    main()
