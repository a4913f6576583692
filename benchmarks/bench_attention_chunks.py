"""Chunks a program of the FP8 sparse attention (``chunks_per_program``): how many programs
share a token's queries and how long each streams rows, by measurement (issue 25).

    PYTHONPATH=. python benchmarks/bench_attention_chunks.py [--points 96x2048,8x32768]
        [--chunks 1,2,4,8] [--stages 1,2] [--base FILE] [--out F.json]

At 16 heads the kernel runs one program a (token, 64-index chunk): 32 programs a token at
K = 2048, each loading the token's 18 KB of queries beside its 42 KB of rows, in a body with no
loop for the pipeliner to prefetch across. A program that runs several chunks in turn (each
its own online softmax and partial: the same bits) loads the queries once and, with two
stages, prefetches the next chunk's rows while it computes (the Triton 3.6 SM90 compile shows
the asynchronous copies: ``benchmarks/attention_resources.py``). It also leaves fewer programs
for few tokens, hence a sweep per point. Each variant's output and lse are checked bit for bit
against the package's default call first; ``--base FILE`` (another ``_attention_triton.py``,
e.g. the base commit's) is timed in the same process as ``base``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ops import timeit_graph  # noqa: E402
from kernel_copy import load_ops_module  # noqa: E402
from probe_attention_stages import HEADS, K, inputs  # noqa: E402

from hisparse.ops import _attention_triton as AT  # noqa: E402


def sweep(T: int, context: int, chunks: list[int], stages: list[int], base) -> dict:
    """us a call of the package's kernel at each (chunks, stages) that divides the launch's
    chunk count, and of ``base``'s default call; bits against the package's default call."""
    q, kv8, idx = inputs(T, context)
    scale = 576 ** -0.5
    cfg = AT.attn_config(HEADS, K, True, False)
    want_o, want_l = AT.sparse_mla_attention_fp8_triton(q, kv8, idx, scale)
    calls = {}
    for c in chunks:
        if cfg.splits(K) % c:
            continue
        for ns in stages:
            plan = dataclasses.replace(cfg, num_stages=ns)
            calls[f"c{c}s{ns}"] = lambda plan=plan, c=c: AT.sparse_mla_attention_fp8_triton(
                q, kv8, idx, scale, config=plan, chunks_per_program=c)
    if base is not None:
        calls["base"] = lambda: base.sparse_mla_attention_fp8_triton(q, kv8, idx, scale)
    bits, us = {}, {}
    for name, fn in calls.items():
        o, lse = fn()
        bits[name] = bool(torch.equal(o, want_o) and torch.equal(lse, want_l))
        us[name] = timeit_graph(fn) * 1e6
    kv_bytes = T * K * kv8.shape[1]
    return {"tokens": T, "context": context, "us": us, "bits_equal": bits,
            "kv_gb_s": {n: kv_bytes / (t * 1e-6) / 1e9 for n, t in us.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default="96x2048,24x32768,8x32768,42x32768")
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--base", default=None, metavar="FILE")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = load_ops_module("_attn_base", path=args.base) if args.base else None
    chunks = [int(v) for v in args.chunks.split(",")]
    stages = [int(v) for v in args.stages.split(",")]
    rows = []
    for point in args.points.split(","):
        T, C = (int(v) for v in point.split("x"))
        r = sweep(T, C, chunks, stages, base)
        rows.append(r)
        ref = r["us"].get("base") or next(iter(r["us"].values()))
        print(f"{point:>9} " + "  ".join(
            f"{n} {t:.1f} ({t / ref:.2f}x{'' if r['bits_equal'][n] else ' DIFFER'})"
            for n, t in r["us"].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
