"""FP8-KV indexer scoring on the GPU (issue 24 item 2): the old path (bf16 queries, rotated by
one small kernel, against keys upcast from e4m3, ``fp8_query=False``, what
``HISPARSE_FP8_INDEXER=0`` runs) against the new one (queries rotated and quantized to e4m3 by
one small kernel, one e4m3 x e4m3 dot per key tile); the timed calls include those launches
(``rot us`` / ``q us``: each alone; ops.rotation), plus a sweep of the new kernel's launch
configs.

Usage (repository root, CUDA):
    PYTHONPATH=. python benchmarks/bench_score.py
        [--shapes 8x32768,24x32768,48x32768,8x131072,24x32768g2,32x32768g4] [--no-sweep]
        [--out bench_score.json]

Shapes ``TxCTX[gG]``: T tokens of CTX positions, G consecutive tokens per request (MTP verify
groups, scored with ``group=G``; default 1: one decode token per request), 64 heads, D 128,
page 64, pages scattered over the cache (a random block table). The sweep runs every SWEEP
config on the group-1 shapes and SWEEP_GROUPS on the others. Times are per call from CUDA
graphs of 10 back-to-back calls (``bench_ops.timeit_graph``, as the engine replays them).
``frac`` = key bytes read (T / G x CTX x 132 B: e4m3 values + fp32 scale, each request's keys
once) / time / 4.27 TB/s (the H200's measured read bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_ops import timeit_graph  # noqa: E402  (the same graph-replay timer)

from hisparse.ops import _indexer_triton as ix  # noqa: E402
from hisparse.ops.quant import FP8KeyLayout, quantize_index_keys_reference  # noqa: E402

HBM_TBS = 4.27
HI, D, BS = 64, 128, 64
# (BLOCK_S, programs per SM, num_warps, num_stages) of the new path
SWEEP = [(128, 8, 4, 2), (128, 8, 4, 3), (128, 4, 4, 3), (128, 2, 4, 3), (64, 8, 4, 3),
         (64, 16, 4, 4), (256, 4, 8, 2), (256, 4, 8, 3), (128, 8, 8, 3)]
SWEEP_GROUPS = [(128, 8, 4, 2), (64, 8, 8, 3), (64, 8, 4, 3), (128, 8, 8, 2)]


def _case(T, ctx, group, seed):
    R = T // group
    P = ctx // BS
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(R * P * BS, D, device="cuda", generator=g)
    pages = FP8KeyLayout(D, BS).pages(quantize_index_keys_reference(k))
    del k
    bt = torch.randperm(R * P, device="cuda", generator=g).view(R, P).to(torch.int32)
    q = torch.randn(T, HI, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(T, HI, device="cuda", generator=g) * HI ** -0.5
    req = (torch.arange(T, device="cuda") // group).to(torch.int32)
    pos = (ctx - group + torch.arange(T, device="cuda") % group).to(torch.int32)
    return q, w, pages, bt, req, pos, R * ctx * (D + 4)


def _row(T, ctx, group, sweep, seed):
    q, w, pages, bt, req, pos, nbytes = _case(T, ctx, group, seed)
    keys = torch.empty((T, bt.shape[1] * BS), dtype=torch.int32, device="cuda")
    lens = torch.empty(T, dtype=torch.int32, device="cuda")

    def run(fp8_query, config=None):
        return lambda: ix.indexer_keys(q, w, pages, bt, req, pos, BS, config=config, out=keys,
                                       lengths=lens, group=group, fp8_query=fp8_query)

    frac = lambda t: nbytes / t / (HBM_TBS * 1e12)      # noqa: E731
    t_old = timeit_graph(run(False))
    t_new = timeit_graph(run(True))
    t_quant = timeit_graph(lambda: ix.quantize_queries(q, w))
    t_rot = timeit_graph(lambda: ix.rotate_queries(q))
    row = dict(T=T, ctx=ctx, group=group, key_bytes=nbytes, old_us=t_old * 1e6,
               old_frac=frac(t_old), new_us=t_new * 1e6, new_frac=frac(t_new),
               quant_us=t_quant * 1e6, rot_us=t_rot * 1e6, speedup=t_old / t_new, sweep=[])
    if sweep:
        for cfg in SWEEP if group == 1 else SWEEP_GROUPS:
            try:
                t = timeit_graph(run(True, cfg))
            except Exception as e:  # a config that does not fit (shared memory): skipped
                row["sweep"].append(dict(config=list(cfg), error=type(e).__name__))
                continue
            row["sweep"].append(dict(config=list(cfg), us=t * 1e6, frac=frac(t)))
    ok = [s for s in row["sweep"] if "us" in s]
    if ok:
        best = min(ok, key=lambda s: s["us"])
        row["best"] = best
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes",
                    default="8x32768,24x32768,48x32768,8x131072,24x32768g2,32x32768g4")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for i, s in enumerate(x for x in args.shapes.split(",") if x):
        s, _, group = s.partition("g")
        T, ctx = (int(x) for x in s.split("x"))
        rows.append(_row(T, ctx, int(group or 1), not args.no_sweep, seed=i))
        torch.cuda.empty_cache()
    print(f"\nFP8 indexer scoring, 64 heads x D 128, page 64 (frac = key bytes / time / "
          f"{HBM_TBS} TB/s; new = quantize q + e4m3 dot, defaults {ix.CONFIG_CUDA_F8Q} and "
          f"{ix.CONFIG_CUDA_F8Q_WIDE} from group 4)")
    print(f"{'T x ctx (group)':>18} | {'MB keys':>7} | {'old us':>7} {'frac':>5} | "
          f"{'new us':>7} {'frac':>5} | {'x':>5} | {'q us':>5} {'rot us':>6} | "
          "best config (us, frac)")
    for r in rows:
        b = r.get("best")
        best = f"{tuple(b['config'])} {b['us']:.1f} {b['frac']:.2f}" if b else "-"
        print(f"{r['T']:>6} x {r['ctx']:>6} ({r['group']}) | {r['key_bytes'] / 1e6:7.1f} | "
              f"{r['old_us']:7.1f} {r['old_frac']:5.2f} | {r['new_us']:7.1f} {r['new_frac']:5.2f}"
              f" | {r['speedup']:5.2f} | {r['quant_us']:5.1f} {r['rot_us']:6.1f} | {best}")
    for r in rows:
        if r["sweep"]:
            cells = [f"{tuple(s['config'])} " + (f"{s['us']:.1f}" if "us" in s else s["error"])
                     for s in r["sweep"]]
            print(f"  sweep {r['T']}x{r['ctx']}g{r['group']} (us): " + ", ".join(cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(hbm_tbs=HBM_TBS, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
