"""HiSparse's miss gather against how the host pool is pinned (CUDA): scattered 656-byte rows
read by the GPU from pinned host memory, per allocation method and spread.

The resolver's miss gather reads its rows at 0.40-0.61 of the link's bulk rate when they are
spread over a whole pool, 0.81-0.85 over 2 GiB (H100, fifteenth session): the GPU's
translations of 4 KiB host pages, not the bookkeeping, looked like the limit. This probe pins
one ``--gib`` region per method and times the package's zero-copy row gather
(:func:`hisparse.ops.copy.gather_rows`: the miss gather's 16-byte chunks) over rows drawn at
random from the first ``spread`` GiB of it (``layers``: from one layer's slab of a
layer-major pool a call, the layers in turn, as the engine's step reads it), fresh rows every
call (CUDA-event timed, after a warm-up), beside one contiguous ``cudaMemcpyAsync`` of the
same bytes:

- ``exact``: ``cudaHostAlloc`` (what the engine's pool uses: :func:`pinned_empty`);
- ``register``: an anonymous ``mmap``, then ``cudaHostRegister``;
- ``register-huge``: the same, 2 MiB aligned and advised ``MADV_HUGEPAGE`` before it is
  touched (transparent huge pages where the kernel allows; ``AnonHugePages`` is reported).

    python3 benchmarks/probe_host_gather.py [--gib 32] [--spreads 2,8,all,layers]
        [--rows 8192] [--methods exact,register,register-huge] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hisparse.ops.copy import gather_rows  # noqa: E402
from hisparse.worker.pinned import (  # noqa: E402
    GIB,
    cuda_host_allocator,
    meminfo_bytes,
    pinned_empty,
    registered_host_allocator,
)

ROW_BYTES = 656         # one FP8 MLA row (512 e4m3 + 4 fp32 scales + 64 bf16 rope)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _allocator(method: str):
    if method == "exact":
        return cuda_host_allocator()
    if method in ("register", "register-huge"):
        return registered_host_allocator(huge_pages=method == "register-huge")
    raise SystemExit(f"--methods: unknown {method!r} (exact, register, register-huge)")


def _time_gather(pool: torch.Tensor, spread_rows: int, n: int, iters: int,
                 slabs: int = 1) -> float:
    """Seconds per gather of ``n`` rows drawn from the first ``spread_rows`` of ``pool``;
    ``slabs > 1``: call ``i`` draws from slab ``i % slabs`` of ``spread_rows // slabs`` rows
    (the engine's pool is layer-major: one layer's misses come from its own slab, and the
    next layer's from the next slab)."""
    dst = torch.empty(n, pool.shape[1], dtype=torch.uint8, device="cuda")
    per = spread_rows // slabs
    idx = [(i % slabs) * per + torch.randint(0, per, (n,), device="cuda")
           for i in range(iters + 3)]
    for r in idx[:3]:
        gather_rows(pool, r, dst)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for r in idx[3:]:
        gather_rows(pool, r, dst)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _time_bulk(pool: torch.Tensor, nbytes: int, iters: int) -> float:
    src = pool.view(-1)[:nbytes]
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=32.0, help="region pinned per method")
    p.add_argument("--spreads", default="2,8,all,layers",
                   help="GiB the rows are drawn from; all: the region; layers: the region "
                        "as --layers slabs, one call a slab in turn (the engine's layers)")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--rows", type=int, default=8192,
                   help="rows a gather (42 requests x ~190 misses at 32k: ~8k)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--methods", default="exact,register,register-huge")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    torch.cuda.init()
    nbytes = int(a.gib * GIB) // ROW_BYTES * ROW_BYTES
    total_rows = nbytes // ROW_BYTES
    if total_rows < max(a.rows, a.layers):
        p.error(f"--gib {a.gib:g} holds {total_rows} rows: fewer than --rows {a.rows} or "
                f"--layers {a.layers}")
    print(f"{torch.cuda.get_device_name()}; THP: {_thp_mode()}; region {a.gib:g} GiB; "
          f"{a.rows} rows of {ROW_BYTES} B a gather", flush=True)
    results = []
    for method in (m for m in a.methods.split(",") if m):
        huge0 = meminfo_bytes("AnonHugePages") or 0
        t = time.perf_counter()
        try:
            pool = pinned_empty((total_rows, ROW_BYTES), torch.uint8, _allocator(method))
        except RuntimeError as e:
            print(f"{method}: FAILED {e}", flush=True)
            results.append(dict(method=method, error=str(e)))
            continue
        pool.view(-1)[::4096].fill_(1)          # touch every page (registered: already)
        pin_s = time.perf_counter() - t
        huge = (meminfo_bytes("AnonHugePages") or 0) - huge0
        bulk = _time_bulk(pool, a.rows * ROW_BYTES, a.iters)
        bulk_gbs = a.rows * ROW_BYTES / bulk / 1e9
        print(f"{method}: pinned in {pin_s:.1f} s ({pin_s / a.gib:.2f} s/GiB), AnonHugePages "
              f"+{huge / GIB:.1f} GiB, is_pinned {pool.is_pinned()}; bulk copy "
              f"{bulk_gbs:.1f} GB/s", flush=True)
        for sp in (x for x in a.spreads.split(",") if x):
            slabs = a.layers if sp == "layers" else 1
            rows = (total_rows if sp in ("all", "layers")
                    else min(total_rows, int(float(sp) * GIB) // ROW_BYTES))
            s = _time_gather(pool, rows, a.rows, max(a.iters, 2 * slabs), slabs)
            gbs = a.rows * ROW_BYTES / s / 1e9
            what = f"{slabs} slabs" if slabs > 1 else "spread"
            print(f"  {what} {rows * ROW_BYTES / GIB:6.1f} GiB: {s * 1e6:8.1f} us a gather, "
                  f"{gbs:5.1f} GB/s ({gbs / bulk_gbs:.2f} of bulk)", flush=True)
            results.append(dict(method=method, spread_gib=rows * ROW_BYTES / GIB, slabs=slabs,
                                us=s * 1e6, gbs=gbs, bulk_gbs=bulk_gbs, pin_s=pin_s,
                                anon_huge_gib=huge / GIB))
        del pool
        gc.collect()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), thp=_thp_mode(),
                           command=" ".join(sys.argv), results=results), f, indent=1)


if __name__ == "__main__":
    main()
