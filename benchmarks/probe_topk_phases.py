"""Where the fused top-k launch's time goes, phase by phase (issue 24 item 1).

    PYTHONPATH=. python benchmarks/probe_topk_phases.py [--shapes 32768x8x2048,...]
        [--per-sm P] [--width W] [--out F.json]

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

Where the programs ran: each program also stores its hardware id, its SM (``%smid``) and its
(row, split), and the probe reports per launch the SMs used, the most programs and key blocks on
one SM and how often programs of consecutive hardware ids shared an SM (runs: the hardware fills
an SM with consecutive ids; round robin: it deals them out). ``--width`` puts the rows in a
wider table (an engine's graph launches over ``max_model_len``); each launch is also timed in
CUDA graphs (its stamps included). (At 24 rows x 32k, 4 programs an SM take ~1.15x the time of
3: the twenty-eighth and twenty-ninth sessions asked for the programs in another order and
fitted the splits to the rows, here as source edits; the hardware still put 4 active programs
and 8 key blocks on an SM, so both edits were removed.)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import timeit_graph  # noqa: E402
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


# after the start stamp, in the last three columns of the program's row: its hardware id
# (``tl.program_id(0)``; the row is the program it serves), the SM it runs on and (row << 32 |
# split << 16 | splits)
WHERE = ("_sm = tl.inline_asm_elementwise('mov.u32 $0, %smid;', '=r,r', [pid], dtype=tl.int32, "
         "is_pure=False, pack=1)\n",
         f"tl.store(stamp_ptr + pid.to(tl.int64) * {2 * SLOTS} + {2 * SLOTS - 3}, "
         "tl.program_id(0).to(tl.int64))\n",
         f"tl.store(stamp_ptr + pid.to(tl.int64) * {2 * SLOTS} + {2 * SLOTS - 2}, "
         "_sm.to(tl.int64))\n",
         f"tl.store(stamp_ptr + pid.to(tl.int64) * {2 * SLOTS} + {2 * SLOTS - 1}, "
         "(row.to(tl.int64) << 32) | (sp.to(tl.int64) << 16) | SPLITS)\n")


# the probe's kernel (stamps, where it ran) at 4 programs of 4 warps an SM, as the package's
# compiles: a register cap of 128
CAP = ("                  num_warps=cfg.warps)",
       "                  num_warps=cfg.warps, maxnreg=_MAXNREG)")


def instrumented_source(src: Path = SRC) -> str:
    """The module's text with a ``stamp_ptr`` argument, the stamps and where each program ran
    (module docstring), compiled at most 128 registers a thread (``CAP``)."""
    text = src.read_text()
    sig = "stall_ptr, T, W, K, SPLITS,"
    call = "(keys, lengths, hist, sh, scratch.counts, out, sq, scratch.stalls, "
    for old in (sig, call, CAP[0]):
        if text.count(old) != 1:
            raise RuntimeError(f"probe_topk_phases: the kernel's source has changed: {old!r}")
    text = text.replace(sig, "stall_ptr, stamp_ptr, T, W, K, SPLITS,")
    text = text.replace(call, call + "_STAMPS, ")
    text = text.replace(*CAP)
    text += ("\n_STAMPS = None   # the probe's [programs, 2 * SLOTS] int64 stamp buffer\n"
             "_MAXNREG = 128   # registers a thread\n")
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
                block = _stamp(slot, indent)
                if name == "start":
                    block += [indent + w for w in WHERE]
                inserts.append((_statement_end(lines, i), block))
                found.add(name)
    missing = {n for _, n, _ in MARKS} - found
    if missing:
        raise RuntimeError(f"probe_topk_phases: markers not found: {sorted(missing)}")
    for j, block in sorted(inserts, reverse=True):
        lines[j + 1:j + 1] = block
    return "".join(lines)


def placement(where: torch.Tensor, lens: torch.Tensor, W: int, block: int) -> dict:
    """Where the programs ran: ``where [programs, 3]`` (hardware program id, SM id, ``row << 32
    | split << 16 | splits``) of the programs that ran, the rows' ``lens`` and the launch's
    ``block``: per SM the programs and key blocks (each program's share of its row, as
    ``_row_span`` splits it), and how often programs of consecutive hardware ids shared an
    SM."""
    where = where[where[:, 0].argsort()]
    sm = where[:, 1].tolist()
    blocks_on, programs_on = {}, {}
    for s_id, packed in zip(sm, where[:, 2].tolist()):
        row, sp, splits = packed >> 32, (packed >> 16) & 0xFFFF, packed & 0xFFFF
        n = min(max(int(lens[row]), 0), W)
        per = triton.cdiv(triton.cdiv(n, splits), block) * block
        lo, hi = sp * per, min(n, sp * per + per)
        blocks_on[s_id] = blocks_on.get(s_id, 0) + max(0, triton.cdiv(hi - lo, block))
        programs_on[s_id] = programs_on.get(s_id, 0) + 1
    same = sum(a == b for a, b in zip(sm, sm[1:])) / max(1, len(sm) - 1)
    return {"sms": len(programs_on), "most_programs": max(programs_on.values()),
            "busiest_blocks": max(blocks_on.values()),
            "mean_blocks": sum(blocks_on.values()) / len(blocks_on),
            "next_on_same_sm": same}


def probe(mod, ctx: int, T: int, k: int, launch=None, width: int = 0) -> dict:
    """The stamps of one launch of ``T`` rows ``ctx`` long in a table of ``max(ctx, width)``
    columns, and the call's time in CUDA graphs (stamps included)."""
    from hisparse.ops.topk import CUDA_BLOCK, TopkScratch, topk_select, topk_select_reference
    W = max(ctx, width)
    keys, _ = _topk_inputs(ctx, T, W)
    lens = torch.full((T,), ctx, dtype=torch.int32, device="cuda")
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
    where = placement(s[:, 2 * SLOTS - 3:], lens.cpu(), W,
                      (launch and launch.block) or CUDA_BLOCK)
    cyc = s[:, 0:2 * len(NAMES):2].double()
    ns = s[:, 1:2 * len(NAMES):2].double()
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
    graph_us = timeit_graph(lambda: topk_select(keys, lens, k, out=out, scratch=scratch,
                                                launch=launch)) * 1e6
    assert torch.equal(out, topk_select_reference(keys, lens, k)) and scratch.stalls.item() == 0
    return {"ctx": ctx, "rows": T, "k": k, "width": W,
            "programs": int(ran.sum()), "span_us": span_us, "start_skew_us": start_skew,
            "graph_us": graph_us, "sm_ghz": ghz, "placement": where, "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32768x8x2048,32768x24x2048,32768x64x2048,"
                                        "131072x8x2048,2112x96x2048",
                    help="ctx x rows x k, comma-separated")
    ap.add_argument("--per-sm", type=int, default=None,
                    help="TopkLaunch.per_sm (default: the launch's own choice)")
    ap.add_argument("--width", type=int, default=0,
                    help="the table's columns (default: each shape's ctx, rows as wide)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from hisparse.ops.topk import TopkLaunch
    launch = TopkLaunch(per_sm=args.per_sm) if args.per_sm else None
    mod = load_ops_module("_topk_triton", text=instrumented_source())
    res = []
    for shape in args.shapes.split(","):
        ctx, T, k = (int(x) for x in shape.split("x"))
        r = probe(mod, ctx, T, k, launch, args.width)
        res.append(r)
        pl = r["placement"]
        print(f"\n{ctx} x {T} of {r['width']} columns, k {k}: {r['graph_us']:.1f} us a call "
              f"in graphs; {r['programs']} programs, span {r['span_us']:.1f} us (start skew "
              f"{r['start_skew_us']:.1f}), SM {r['sm_ghz']:.2f} GHz; {pl['sms']} SMs, at "
              f"most {pl['most_programs']} programs and {pl['busiest_blocks']} key blocks "
              f"an SM (mean {pl['mean_blocks']:.1f}); next program on the same SM "
              f"{pl['next_on_same_sm']:.2f}")
        print("  phase        programs  median us  max us")
        for name, p in r["phases"].items():
            print(f"  {name:<12} {p['programs']:>8}  {p['median_us']:>9.2f}  "
                  f"{p['max_us']:>6.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
