"""How much host memory pins on this machine: torch's pinned allocator, exact-size
``cudaHostAlloc`` and ``cudaHostRegister`` (CUDA).

    python benchmarks/probe_pinned.py                      # every method, 8 GiB steps to 112
    python benchmarks/probe_pinned.py --single 66,72,100   # plus one region of each size
    python benchmarks/probe_pinned.py --json probe.json

Methods (each pins ``--step-gib`` chunks one after another, keeping them, until a chunk fails,
``--max-gib`` is reached or the method's share of ``--time-limit`` is spent; then frees
everything before the next method):

- ``alloc``: ``torch.empty(n, dtype=uint8, pin_memory=True)`` (torch's caching host allocator:
  ``cudaHostAlloc`` of ``n`` rounded up to a power of two);
- ``exact``: :func:`hisparse.worker.pinned.pinned_empty` (``cudaHostAlloc`` of ``n``: what the
  engine's host pool uses);
- ``register``: an anonymous ``mmap`` of ``n`` bytes, then ``cudaHostRegister`` (what a pool
  shared across TP ranks uses).

The chunked figures give the total pinnable memory (8 GiB chunks are powers of two: ``alloc``
and ``exact`` pin the same there); ``--single`` tells a per-allocation limit from a total one:
one 66 GiB ``alloc`` region asks the driver for 128 GiB. Every line reports the seconds per GiB
of pinning. A figure marked ``(time limit)`` is a lower bound.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import time

import torch

GIB = 1 << 30


class Pinned:
    """One pinned region of ``nbytes`` by ``method``; :meth:`free` releases it."""

    def __init__(self, method: str, nbytes: int):
        self.method, self.nbytes = method, nbytes
        self.tensor = self.map = self.buf = None
        self.registered = False
        if method == "alloc":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return
        if method == "exact":
            from hisparse.worker.pinned import pinned_empty

            self.tensor = pinned_empty((nbytes,), torch.uint8)
            return
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buf = (ctypes.c_char * nbytes).from_buffer(self.map)
        rc = torch.cuda.cudart().cudaHostRegister(ctypes.addressof(self.buf), nbytes, 0)
        code = int(getattr(rc, "value", rc))
        if code != 0:
            self.free()
            # the number too: torch's enum names few codes (an H100 host gave "cudaError.???")
            raise RuntimeError(f"cudaHostRegister failed (cudaError {code}: {rc})")
        self.registered = True

    def free(self) -> None:
        if self.buf is not None:
            if self.registered:
                torch.cuda.cudart().cudaHostUnregister(ctypes.addressof(self.buf))
            self.buf = None
        if self.map is not None:
            self.map.close()
            self.map = None
        self.tensor = None


def probe_chunks(method: str, step: int, limit: int, seconds: float) -> dict:
    held: list[Pinned] = []
    t0 = time.perf_counter()
    stop = "max"
    try:
        while (len(held) + 1) * step <= limit:
            if time.perf_counter() - t0 > seconds:
                stop = "time limit"
                break
            t = time.perf_counter()
            try:
                held.append(Pinned(method, step))
            except (RuntimeError, OSError, MemoryError) as e:
                stop = f"failed: {str(e).splitlines()[0][:80]}"
                break
            total = len(held) * step
            print(f"  {method:8s} {total / GIB:6.0f} GiB pinned "
                  f"({(time.perf_counter() - t) / (step / GIB):.2f} s/GiB)", flush=True)
    finally:
        total = len(held) * step
        elapsed = time.perf_counter() - t0
        for p in held:
            p.free()
        held.clear()
        gc.collect()
    return {"method": method, "pinned_gib": total / GIB, "stop": stop,
            "s_per_gib": elapsed / (total / GIB) if total else float("nan")}


def probe_single(method: str, nbytes: int) -> dict:
    t = time.perf_counter()
    try:
        Pinned(method, nbytes).free()
        ok, why = True, ""
    except (RuntimeError, OSError, MemoryError) as e:
        ok, why = False, str(e).splitlines()[0][:80]
    gc.collect()
    return {"method": method, "single_gib": nbytes / GIB, "ok": ok, "error": why,
            "seconds": time.perf_counter() - t}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="alloc,exact,register")
    p.add_argument("--step-gib", type=int, default=8)
    p.add_argument("--max-gib", type=int, default=112)
    p.add_argument("--time-limit", type=float, default=55.0,
                   help="seconds for the chunked probes, shared equally by the methods")
    p.add_argument("--single", default="", help="comma list of GiB: one region each, per method")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs CUDA (pinned memory is a CUDA driver facility)")
    torch.cuda.init()
    from hisparse.worker.pinned import available_host_memory_bytes

    methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in methods if m not in ("alloc", "exact", "register")]
    if bad:
        p.error(f"--methods: unknown {bad} (alloc, exact, register)")
    print(f"MemAvailable {available_host_memory_bytes() / GIB:.1f} GiB", flush=True)
    results = []
    for m in methods:
        r = probe_chunks(m, a.step_gib * GIB, a.max_gib * GIB, a.time_limit / len(methods))
        print(f"{m}: {r['pinned_gib']:.0f} GiB in {a.step_gib} GiB chunks ({r['stop']}), "
              f"{r['s_per_gib']:.2f} s/GiB", flush=True)
        results.append(r)
    for gib in (float(x) for x in a.single.split(",") if x):
        for m in methods:
            r = probe_single(m, int(gib * GIB))
            print(f"{m}: one {gib:g} GiB region {'pinned' if r['ok'] else 'FAILED ' + r['error']}"
                  f" ({r['seconds']:.1f} s)", flush=True)
            results.append(r)
    chunked = {r["method"]: r["pinned_gib"] for r in results if "pinned_gib" in r}
    if len(chunked) > 1:
        best = max(chunked, key=chunked.get)
        print(f"larger: {best} ({chunked[best]:.0f} GiB)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
