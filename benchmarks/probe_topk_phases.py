"""Where the fused top-k launch's time goes, phase by phase (issue 24 item 1).

    PYTHONPATH=. python benchmarks/probe_topk_phases.py [--shapes 32768x8x2048,...] [--out F.json]

The fused launch (``hisparse/ops/_topk_triton.py``, ``_topk_select_kernel``'s one-launch branch)
runs up to four histogram passes, a collect, a chunk sort and a merge, a row barrier after each
but the last. This probe loads the kernel module's source, adds a stamp buffer to the kernel's
arguments and, after every phase and barrier of the one-launch branch, stores the SM cycle
counter (``%clock64``) and the global timer (``%globaltimer``, ns) into the program's row of it
(``-1``: a phase the program skipped, e.g. the digits of a resolved row); the copy replaces the
package's module for this process only. It runs ``topk_select`` twice back to back on the
bench's inputs (``bench_topk._topk_inputs``: keys in L2 as in its graph replay) and reports,
per phase, the median over the programs that ran it of the cycles since the previous stamp (in
us: cycles over the SM clock the spans give), and the launch's span in global-timer us.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_topk import _topk_inputs  # noqa: E402
from kernel_copy import load_ops_module  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "hisparse" / "ops" / "_topk_triton.py"
SLOTS = 16
# (a statement of the one-launch branch, matched at its first line, where the line before it
# holds the third entry if any; the stamp after it)
MARKS = (("h_row = hist_ptr + row * stride_h", "start", None),
         ("_hist_pass(keys_ptr, len_ptr, h_row, split_ptr, row, sp, slot0, W, SPLITS,", "hist0",
          None),
         ("stalled = _barrier(h_row, 0,", "bar0", None),
         ("_hist_pass(keys_ptr, len_ptr, h_row, split_ptr, row, sp, slot0, W,", "hist{L}",
          "if done == 0"),
         ("stalled = stalled | _barrier(h_row, L,", "bar{L}", None),
         ("_collect_phase(keys_ptr, len_ptr, h_row, split_ptr, count_ptr, out_ptr, sorted_ptr,",
          "collect", None),
         ("_barrier(h_row, LEVELS, SPLITS", "bar_collect", "if LAST > LEVELS + 1"),
         ("_chunk_sort_phase(h_row, sorted_ptr, row, sp, K, SPLITS, stride_q, NB, CH, C)",
          "sort", None),
         ("_barrier(h_row, LEVELS + 1, SPLITS", "bar_sort", None),
         ("_merge_phase(h_row, out_ptr, sorted_ptr, row, sp, K, SPLITS, stride_o, stride_q,",
          "merge", None))
# the stamps in slot order (hist{L} / bar{L} of the loop over L = 1..3 at 2L+1 / 2L+2)
NAMES = ["start", "hist0", "bar0", "hist1", "bar1", "hist2", "bar2", "hist3", "bar3", "collect",
         "bar_collect", "sort", "bar_sort", "merge"]


def _statement_end(lines: list[str], i: int) -> int:
    """Index of the last line of the statement that starts at line ``i`` (balanced parens)."""
    depth = 0
    for j in range(i, len(lines)):
        depth += lines[j].count("(") - lines[j].count(")")
        if depth <= 0:
            return j
    raise ValueError(f"unbalanced statement at line {i + 1}")


def _stamp(slot: str, indent: str) -> list[str]:
    p = f"stamp_ptr + pid.to(tl.int64) * {2 * SLOTS} + 2 * ({slot})"
    return [f"{indent}_c = tl.inline_asm_elementwise('mov.u64 $0, %clock64;', '=l,r', [pid], "
            f"dtype=tl.int64, is_pure=False, pack=1)\n",
            f"{indent}_g = tl.inline_asm_elementwise('mov.u64 $0, %globaltimer;', '=l,r', "
            f"[pid], dtype=tl.int64, is_pure=False, pack=1)\n",
            f"{indent}tl.store({p}, _c)\n", f"{indent}tl.store({p} + 1, _g)\n"]


def instrumented_source(src: Path = SRC) -> str:
    """The module's text with a ``stamp_ptr`` argument and the stamps (module docstring)."""
    text = src.read_text()
    sig = "stall_ptr, T, W, K, SPLITS,"
    call = "(keys, lengths, hist, sh, scratch.counts, out, sq, scratch.stalls, "
    if text.count(sig) != 1 or text.count(call) != 1:
        raise RuntimeError("probe_topk_phases: the kernel's signature or call has changed")
    text = text.replace(sig, "stall_ptr, stamp_ptr, T, W, K, SPLITS,")
    text = text.replace(call, call + "_STAMPS, ")
    text += "\n_STAMPS = None   # the probe's [programs, 2 * SLOTS] int64 stamp buffer\n"
    lines = text.splitlines(keepends=True)
    start = next(i for i, s in enumerate(lines) if s.startswith("def _topk_select_kernel"))
    end = next(i for i, s in enumerate(lines) if "else:   # one launch a phase" in s)
    found, inserts = set(), []
    for i in range(start, end):
        for marker, name, after in MARKS:
            if lines[i].lstrip().startswith(marker) and (after is None or after in lines[i - 1]):
                slot = (str(NAMES.index(name)) if name in NAMES
                        else "2 * L + 1" if name.startswith("hist") else "2 * L + 2")
                indent = re.match(r"\s*", lines[i]).group(0)
                inserts.append((_statement_end(lines, i), _stamp(slot, indent)))
                found.add(name)
    missing = {n for _, n, _ in MARKS} - found
    if missing:
        raise RuntimeError(f"probe_topk_phases: markers not found: {sorted(missing)}")
    for j, block in sorted(inserts, reverse=True):
        lines[j + 1:j + 1] = block
    return "".join(lines)


def probe(mod, ctx: int, T: int, k: int, launch=None) -> dict:
    from hisparse.ops.topk import TopkScratch, topk_select, topk_select_reference
    keys, lens = _topk_inputs(ctx, T, ctx)
    scratch = TopkScratch(T, "cuda")
    out = torch.empty((T, k), dtype=torch.int32, device="cuda")
    stamps = torch.full((T * 64 + 4096, 2 * SLOTS), -1, dtype=torch.int64, device="cuda")
    mod._STAMPS = stamps
    for _ in range(3):                          # compile, then keys in L2 as in the bench
        topk_select(keys, lens, k, out=out, scratch=scratch, launch=launch)
    torch.cuda.synchronize()
    stamps.fill_(-1)
    topk_select(keys, lens, k, out=out, scratch=scratch, launch=launch)
    torch.cuda.synchronize()
    assert torch.equal(out, topk_select_reference(keys, lens, k)), (ctx, T, k)
    s = stamps.cpu()
    ran = s[:, 0] >= 0
    s = s[ran]
    cyc, ns = s[:, 0::2].double(), s[:, 1::2].double()
    t0 = ns[:, 0].min()
    last = ns.amax(1)                            # unwritten stamps are -1
    span_us = float((last.max() - t0) / 1e3)
    # the SM clock: cycles over ns on each program's own span
    prog_cyc = cyc.amax(1) - cyc[:, 0]
    prog_ns = last - ns[:, 0]
    ok = prog_ns > 1000
    ghz = float((prog_cyc[ok] / prog_ns[ok]).median()) if ok.any() else 1.75
    phases = {}
    prev_c = cyc[:, 0].clone()
    for i, name in enumerate(NAMES[1:], start=1):
        have = cyc[:, i] >= 0
        if have.any():
            d = (cyc[have, i] - prev_c[have]) / ghz / 1e3
            phases[name] = {"programs": int(have.sum()), "median_us": statistics.median(d.tolist()),
                            "max_us": float(d.max())}
        prev_c = torch.where(have, cyc[:, i], prev_c)
    start_skew = float((ns[:, 0].max() - t0) / 1e3)
    return {"ctx": ctx, "rows": T, "k": k, "programs": int(ran.sum()), "span_us": span_us,
            "start_skew_us": start_skew, "sm_ghz": ghz, "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32768x8x2048,32768x24x2048,32768x64x2048,"
                                        "131072x8x2048,2112x96x2048",
                    help="ctx x rows x k, comma-separated")
    ap.add_argument("--per-sm", type=int, default=None,
                    help="TopkLaunch.per_sm (default: the launch's own choice)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hisparse.ops.topk import TopkLaunch
    launch = TopkLaunch(per_sm=args.per_sm) if args.per_sm else None
    mod = load_ops_module("_topk_triton", text=instrumented_source())
    res = []
    for shape in args.shapes.split(","):
        ctx, T, k = (int(x) for x in shape.split("x"))
        r = probe(mod, ctx, T, k, launch)
        res.append(r)
        print(f"\n{ctx} x {T}, k {k}: {r['programs']} programs, span {r['span_us']:.1f} us "
              f"(start skew {r['start_skew_us']:.1f}), SM {r['sm_ghz']:.2f} GHz")
        print("  phase        programs  median us  max us")
        for name, p in r["phases"].items():
            print(f"  {name:<12} {p['programs']:>8}  {p['median_us']:>9.2f}  {p['max_us']:>6.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
