"""Where the FP8 sparse attention kernel's time goes, by leaving stages out (H200; issue 25).

    PYTHONPATH=. python benchmarks/probe_attention_stages.py [--points 8x32768,96x2048]
        [--variants no_store,...] [--base BASE/hisparse/ops/_attention_triton.py] [--out F.json]
    PYTHONPATH=. python benchmarks/probe_attention_stages.py --once 96x2048   # for ncu

At 16 heads the kernel (``_attn_fp8_kernel``, one program per token x 64-index chunk) ran at
~0.15 of HBM bandwidth at 96 tokens x 2048 indices (187 us a layer call, ninth session): about
one wave of two programs an SM every ~16 us whatever the token count. Without hardware counters
(H200.md: gVisor machines have none) this probe times copies of the kernel with one stage left
out, against the whole kernel in the same process: the kernel as it was before ``_one_copy``
(``remat``: the dequantized tile recomputed for each dot), the value dot (``no_pv``), the logit
dots (``no_qk``), the tile-scale multiply and its reshape (``no_scale``), the partial outputs'
store (``no_store``), the partials in fp32 (``fp32_partials``: before the thirteenth
session), the package's kernel with ``HISPARSE_FP8_CONVERT=int`` (``int_convert``: e4m3 ->
bf16 by integer operations, with a bits check) and
the gather and dequantization alone (``loads``: no dot, the rows summed so the loads stay
live). The merge kernel is timed alone on partials of the same shape at every warp count of
``COMBINE_WARP_COUNTS`` (4: the merge before the twenty-fourth session; the package's
``COMBINE_WARPS`` since: 2), each checked against torch's merge first. (The twenty-fourth
session also swept programs over column blocks of the row, at ``f460558``: slower everywhere.)
``--base FILE`` times another version of the module (a base commit's) in the same process, as
``base``, bits reported.
Each copy is ``hisparse/ops/_attention_triton.py`` with one source edit, made at run time (the
package's kernel is not changed); an edit that no longer matches stops the probe, and the
unedited copy must give the package's bits.

``--once TxC`` runs the package's kernel five times at one point and exits: the command for
``ncu --clock-control none --kernel-name regex:_attn_fp8 --launch-skip 3 --launch-count 1
--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ops import timeit_graph  # noqa: E402
from kernel_copy import load_ops_module  # noqa: E402

from hisparse.ops import _attention_triton as AT  # noqa: E402
from hisparse.ops import quantize_mla_rows_reference, switches  # noqa: E402

SRC = Path(AT.__file__)
HEADS, K = 16, 2048

# variant -> (text in the source, its replacement); each must match exactly once
EDITS: dict[str, tuple[str, str]] = {
    # the kernel before `_one_copy`: the compiler recomputes the dequantized tile per dot
    "remat": ("        kn = _one_copy(kn)\n", ""),
    "no_pv": ("acc = tl.dot(p.to(kn.dtype), kn, acc * alpha[:, None])",
              "acc = acc * alpha[:, None]"),
    "no_qk": ("s = tl.dot(q_nope, tl.trans(kn))\n        s = tl.dot(q_pe, tl.trans(kp), s)",
              "s = tl.zeros([q_nope.shape[0], BLOCK_N], tl.float32)"),
    "no_scale": ("kn = tl.reshape(tl.reshape(f8.to(tl.bfloat16), [BLOCK_N, NT, TILE])\n"
                 "                            * sc.to(tl.bfloat16)[:, :, None], [BLOCK_N, D_V])",
                 "kn = f8.to(tl.bfloat16)"),
    "no_store": ("tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=hm[:, None])\n"
                 "        tl.store(lse_ptrs, lse, mask=hm)",
                 "tl.store(lse_ptrs, lse + tl.sum(o, axis=1) * 0.0, mask=hm)"),
    # the chunks' partial outputs in fp32 (before the thirteenth session: bf16 now)
    "fp32_partials": ("po_dtype = out.dtype if out.element_size() == 2 else torch.float32",
                      "po_dtype = torch.float32"),
}
# the variants whose bits are reported against the kernel's (equal or not; not required)
BITS = ("remat", "int_convert", "base")
# variants of the unedited module under kernel switches
SWITCHED = {"int_convert": {"fp8_convert": "int"}}
# the gather and dequantization alone: no dot, the rows summed into the output (kept live)
SUM_ROWS = ("acc = tl.dot(p.to(kn.dtype), kn, acc * alpha[:, None])",
            "acc = acc * alpha[:, None] + tl.sum(kn.to(tl.float32), axis=0)[None, :]")
COMBOS = {"loads": ("no_qk", "sum_rows")}


def variant_module(names: tuple[str, ...]):
    """A copy of the attention module with the edits ``names`` applied."""
    text = SRC.read_text()
    for name in names:
        old, new = SUM_ROWS if name == "sum_rows" else EDITS[name]
        if text.count(old) != 1:
            raise SystemExit(f"edit {name!r} no longer matches {SRC} once: update EDITS")
        text = text.replace(old, new)
    return load_ops_module(f"_attn_{'_'.join(names) or 'copy'}", text=text)


def inputs(T: int, context: int):
    """Queries, FP8 rows and indices as a decode step reads them: token ``t`` selects K
    distinct rows of its own ``context`` rows, in random order."""
    g = torch.Generator(device="cuda").manual_seed(T * 7 + context)
    kv = torch.randn(T * context, 576, device="cuda", generator=g).to(torch.bfloat16)
    kv8 = quantize_mla_rows_reference(kv, 512)
    local = torch.rand(T, context, device="cuda", generator=g).argsort(dim=1)[:, :K]
    idx = (local + torch.arange(T, device="cuda")[:, None] * context).int()
    q = torch.randn(T, HEADS, 576, device="cuda", generator=g).to(torch.bfloat16)
    return q, kv8, idx


COMBINE_WARP_COUNTS = (1, 2, 4, 8)


def combine_only_us(T: int) -> dict[str, float]:
    """The merge kernel alone over ``T`` tokens' chunk partials (bf16) of the default plan, at
    every warp count of :data:`COMBINE_WARP_COUNTS` (``"4 warps"``: the merge before the
    twenty-fourth session) and the package's (``"package"``). Each output is checked against
    the fp32 merge in torch (bf16 tolerance), into poisoned outputs, before it is timed."""
    cfg = AT.attn_config(HEADS, K, True, False)
    S = cfg.splits(K)
    po = torch.randn(S, T, HEADS, 512, device="cuda", dtype=torch.bfloat16)
    pl = torch.randn(S, T, HEADS, device="cuda")
    w = torch.softmax(pl, dim=0)
    want = (po.float() * w[..., None]).sum(0)
    out = torch.empty(T, HEADS, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(T, HEADS, device="cuda")
    plans = {f"{nw} warps": nw for nw in COMBINE_WARP_COUNTS}
    plans["package"] = AT.COMBINE_WARPS
    us = {}
    for name, nw in plans.items():
        def run(nw=nw):
            AT._combine_kernel[(T, HEADS)](
                po, pl, out, lse, HEADS, S, po.stride(0), po.stride(1), po.stride(2),
                pl.stride(0), pl.stride(1), out.stride(0), out.stride(1), lse.stride(0),
                D_V=512, BLOCK_S=max(2, AT.next_pow2(S)), num_warps=nw)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        run()
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, torch.logsumexp(pl, dim=0), rtol=1e-5, atol=1e-5)
        us[name] = timeit_graph(run) * 1e6
    return us


def run_variant(variants: dict[str, object], name: str, q, kv8, idx, scale):
    """One call of variant ``name``'s kernel (under its switches when it has any)."""
    with switches.override(**SWITCHED.get(name, {})):
        return variants[name].sparse_mla_attention_fp8_triton(q, kv8, idx, scale)


def probe(T: int, context: int, variants: dict[str, object]) -> dict:
    q, kv8, idx = inputs(T, context)
    scale = 576 ** -0.5
    want = AT.sparse_mla_attention_fp8_triton(q, kv8, idx, scale)[0]
    got = variants["whole"].sparse_mla_attention_fp8_triton(q, kv8, idx, scale)[0]
    if not torch.equal(want, got):
        raise SystemExit("the unedited copy differs from the package's kernel")
    # remat: the same values into the same MMAs, at other lanes of each (the operand layout's
    # kWidth is 2, not 4); int_convert: the same tile by other instructions. Whether the
    # outputs keep their bits is what this reports
    bits = {name: bool(torch.equal(run_variant(variants, name, q, kv8, idx, scale)[0], want))
            for name in BITS if name in variants}
    us = {name: timeit_graph(lambda n=name: run_variant(variants, n, q, kv8, idx, scale)) * 1e6
          for name in variants}
    kv_bytes = T * K * kv8.shape[1]
    return {"tokens": T, "context": context, "us": us, "combine_us": combine_only_us(T),
            "bits_equal": bits,
            "kv_gb_s": kv_bytes / (us["whole"] * 1e-6) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default="8x32768,24x32768,42x32768,96x2048",
                    help="TOKENSxCONTEXT,...")
    ap.add_argument("--once", default=None, help="TxC: run the package's kernel 5 times, exit")
    ap.add_argument("--variants", default=None,
                    help="NAME,...: time only these besides the whole kernel (default: all; "
                    "'': none)")
    ap.add_argument("--base", default=None, metavar="FILE",
                    help="another _attention_triton.py (e.g. a base commit's), timed as 'base'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.once:
        T, C = (int(v) for v in args.once.split("x"))
        q, kv8, idx = inputs(T, C)
        for _ in range(5):
            AT.sparse_mla_attention_fp8_triton(q, kv8, idx, 576 ** -0.5)
        torch.cuda.synchronize()
        return
    wanted = None if args.variants is None else {n for n in args.variants.split(",") if n}
    if wanted is not None and wanted - {*EDITS, *SWITCHED, *COMBOS}:
        ap.error(f"--variants: unknown {sorted(wanted - {*EDITS, *SWITCHED, *COMBOS})} "
                 f"(known: {sorted({*EDITS, *SWITCHED, *COMBOS})}; '' for the whole kernel only)")
    variants = {"whole": variant_module(())}
    for name in EDITS:
        if wanted is None or name in wanted:
            variants[name] = variant_module((name,))
    for name in SWITCHED:
        if wanted is None or name in wanted:
            variants[name] = variants["whole"]
    for name, parts in COMBOS.items():
        if wanted is None or name in wanted:
            variants[name] = variant_module(parts)
    if args.base:
        variants["base"] = load_ops_module("_attn_base", path=args.base)
    bits_of = [n for n in BITS if n in variants]
    rows = []
    print(f"{'point':>9} " + " ".join(f"{n:>9}" for n in variants)
          + "   combine  KV GB/s  " + "  ".join(f"{n} bits" for n in bits_of))
    for point in args.points.split(","):
        T, C = (int(v) for v in point.split("x"))
        r = probe(T, C, variants)
        rows.append(r)
        print(f"{point:>9} " + " ".join(f"{r['us'][n]:9.1f}" for n in variants)
              + f" {r['combine_us']['package']:9.1f} {r['kv_gb_s']:8.0f}  "
              + "  ".join(f"{'equal' if r['bits_equal'][n] else 'DIFFER':>{len(n) + 5}}"
                          for n in bits_of), flush=True)
    # the merge alone: us a call per warp count, partials' GB/s read
    names = list(rows[0]["combine_us"]) if rows else []
    print(f"\nmerge alone, us (bf16 partials read, GB/s, at the package's plan)\n{'point':>9} "
          + " ".join(f"{n:>9}" for n in names) + "     GB/s")
    S = AT.attn_config(HEADS, K, True, False).splits(K)
    for r in rows:
        c = r["combine_us"]
        gb_s = S * r["tokens"] * HEADS * 512 * 2 / (c["package"] * 1e-6) / 1e9
        print(f"{r['tokens']}x{r['context']:<6}".rjust(9) + " "
              + " ".join(f"{c[n]:9.1f}" for n in names) + f" {gb_s:8.0f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
