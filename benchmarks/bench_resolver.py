"""Resolver + miss gather at one real rank's decode shape (H200): GPU time of one layer's call.

    PYTHONPATH=. python benchmarks/bench_resolver.py [--requests 42] [--splits 16,1]

One CUDA-graph replay of ``resolve_rows`` per timed step (as the engine runs it): ``R`` decode
requests, top-k 2048, hot buffer 4096 slots, block 64, 32k context, FP8 rows (656 B) in a
pinned host pool, the selections of ``--topk synthetic:0.8`` (``hisparse bench``'s source:
~178 misses per request and layer once the buffers are warm). Scenarios:

- ``steady``: every request in host-read mode, nothing resident, warm hot buffers;
- ``cold2``: as ``steady``, but two requests start each step with an empty hot buffer (a request
  that just entered host-read mode: 2048 misses in every layer);
- ``mixed``: half the requests host-read (warm), half with every page resident and no hot block;
- ``resident``: no request holds a hot block, every page resident;
- ``leased``: every request holds its hot blocks (stale keys) but every page is resident
  (HiSparse at 24 requests on the real rank, where no lookup was a hot one, is one of these two
  or a mix).

``--policy score+prefetch``: the engine's default hot policy, with a band (class ``Policy``).
``--splits``: miss-gather programs per request group; ``1`` is the pre-split placement (one
program moves a group's misses). ``--configs BLOCK_H:WARPS,...``: also time the resolver with
those slots per pass over the hot buffer and warps (default 1024:8), at split 16.
Each run first prints the rate of one contiguous pinned -> GPU copy of a steady step's miss
bytes (``cudaMemcpyAsync``): the link's ceiling for the gather's ``GB/s of missed rows``.
``--baseline FILE``: also time another version of ``hisparse/ops/_resolve_triton.py`` (e.g.
``git show 986c8d9:hisparse/ops/_resolve_triton.py > .bench_base/resolve_base.py``: the kernel
before the split) on the same inputs; ratios are printed against it, else against split 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import timeit_graph  # noqa: E402
from kernel_copy import load_ops_module  # noqa: E402

from hisparse.bench.decode import topk_table  # noqa: E402
from hisparse.ops import ResolveWorkspace  # noqa: E402
from hisparse.ops._resolve_triton import resolve_rows_triton  # noqa: E402

K, H, BS, ROW = 2048, 4096, 64, 656
WARM, TIMED = 6, 8


def pages(ctx: int) -> int:
    return -(-(ctx + WARM + TIMED + 1) // BS)


def build(R: int, ctx: int, scenario: str, gen: torch.Generator, host: torch.Tensor) -> dict:
    P = pages(ctx)
    HB = H // BS
    n_blocks = R * HB + R * P + 1
    perm = torch.randperm(n_blocks, generator=gen).to(torch.int32)
    hot = perm[:R * HB].view(R, HB).clone()
    res = perm[R * HB:R * HB + R * P].view(R, P).clone()
    slotless = torch.zeros(R, dtype=torch.bool)      # requests not in host-read mode
    if scenario == "resident":
        slotless[:] = True
    elif scenario == "mixed":
        slotless[R // 2:] = True
    hot[slotless] = -1
    if scenario != "leased":
        res[~slotless] = -1
    dev = "cuda"
    return dict(
        P=P, hot=hot.to(dev), res=res.to(dev),
        hostbt=torch.randperm(R * P, generator=gen).to(torch.int32).view(R, P).to(dev),
        arena=torch.randint(0, 256, (n_blocks * BS, ROW), dtype=torch.uint8, device=dev),
        host=host,
        keys=(torch.randint(0, P * BS, (R, H), dtype=torch.int32, generator=gen)
              if scenario == "leased" else torch.full((R, H), -1, dtype=torch.int32)).to(dev),
        lru=torch.stack([torch.randperm(H, generator=gen) for _ in range(R)]).to(torch.int32)
        .to(dev),
        counters=torch.zeros(3, dtype=torch.int64, device=dev))


def load_baseline(path: str):
    """``resolve_rows_triton`` of another version of the kernel module, imported inside
    ``hisparse.ops`` (its relative imports resolve against this tree's package)."""
    return load_ops_module("_resolve_triton_baseline", path=path).resolve_rows_triton


def legacy_map(ws: ResolveWorkspace) -> None:
    """A kernel from before the epoch-tagged map (``ae322f2`` and older) reads a
    workspace whose map is all -1 between calls."""
    ws.position_map.fill_(-1)


class Policy:
    """The hot policy a run resolves under: ``lru`` (what ``--topk synthetic:0.8`` benches
    run: that source has no band), or the engine's default ``score+prefetch`` with a band of
    ``K`` next-ranked positions a token (another stream's selections of the same step: some
    held in the hot buffer, some not) and ``PREFETCH`` rows prefetched a call, copied by the
    miss gather. ``steps(R, s)``: the band of step ``s``; ``kw(band, flags)``: the resolver's
    keyword arguments."""

    PREFETCH = K // 64      # hot_policy_params: index_topk // 64

    def __init__(self, name: str, table: torch.Tensor) -> None:
        if name not in ("lru", "score+prefetch"):
            raise ValueError(f"--policy must be lru or score+prefetch, got {name!r}")
        self.name, self.table = name, table

    def steps(self, R: int, s: int) -> torch.Tensor | None:
        if self.name == "lru":
            return None
        return self.table[(torch.arange(R) + 1) % self.table.shape[0], 0, s].contiguous().cuda()

    def kw(self, band: torch.Tensor | None, flags: torch.Tensor | None) -> dict:
        if self.name == "lru":
            return {}
        return dict(band=band, policy="score", prefetch=self.PREFETCH, hot_flags=flags)


class Replay:
    """One layer's resolver call over a :func:`build` state, captured in a CUDA graph as the
    engine runs it (compiled outside the capture by a first eager call), and the steps'
    selections (and band, under ``score+prefetch``) to feed its static inputs: what
    :func:`run` and ``probe_resolver_phases.py`` time."""

    def __init__(self, R: int, b: dict, ws: ResolveWorkspace, resolve, kw: dict,
                 table: torch.Tensor, policy: Policy) -> None:
        self.steps = [table[torch.arange(R) % table.shape[0], 0, s].contiguous().cuda()
                      for s in range(WARM + TIMED)]
        self.bands = [policy.steps(R, s) for s in range(WARM + TIMED)]
        topk = self.steps[0].clone()
        band = self.bands[0].clone() if self.bands[0] is not None else None
        flags = torch.zeros((R, H), dtype=torch.int32, device="cuda") if band is not None else None
        out = torch.empty_like(topk)
        req = torch.arange(R, dtype=torch.int32, device="cuda")
        # the graph replays raw addresses and keeps no tensor alive: every input and output
        # it touches lives on self (freed, the next allocation would take their memory: the
        # request ids became a probe's clock stamps, an illegal address on the next replay)
        self.topk, self.band, self.flags, self.out, self.req = topk, band, flags, out, req
        self.state, self.ws = b, ws
        kw = {**kw, **policy.kw(band, flags)}

        def call():
            resolve(topk, req, b["res"], b["hostbt"], b["hot"], b["keys"], b["lru"],
                    b["arena"], b["host"], BS, b["counters"], ws, out=out, **kw)

        call()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            call()

    def feed(self, i: int) -> None:
        """Step ``i``'s selections (and band) into the graph's inputs."""
        self.topk.copy_(self.steps[i])
        if self.band is not None:
            self.band.copy_(self.bands[i])

    def check(self) -> None:
        """The graph's request ids are intact (nothing reused their memory)."""
        want = torch.arange(self.req.numel(), dtype=torch.int32, device=self.req.device)
        if not torch.equal(self.req, want):
            raise RuntimeError("bench_resolver: the graph's request ids were overwritten")

    def timed(self) -> float:
        """One replay, us."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3


def scenario_step(b: dict, scenario: str, i: int) -> None:
    """The scenario's change to the state before step ``i``'s replay: under ``cold2`` the hot
    keys of requests 0 and 1 are forgotten every timed step (all their lookups miss)."""
    if scenario == "cold2" and i >= WARM:
        b["keys"][:2] = -1


def run(R: int, ctx: int, scenario: str, variant: str, resolve, kw: dict,
        table: torch.Tensor, host: torch.Tensor, policy: Policy | None = None) -> dict:
    gen = torch.Generator().manual_seed(0)
    b = build(R, ctx, scenario, gen, host)
    ws = ResolveWorkspace(R, b["P"] * BS, H, "cuda")
    if variant == "baseline":
        legacy_map(ws)
    replay = Replay(R, b, ws, resolve, kw, table, policy or Policy("lru", table))
    times, hits, misses = [], 0, 0
    for i in range(WARM + TIMED):
        replay.feed(i)
        scenario_step(b, scenario, i)
        c0 = b["counters"].clone()
        us = replay.timed()
        if i >= WARM:
            times.append(us)
            d = (b["counters"] - c0).tolist()
            hits, misses = hits + d[0], misses + d[1]
    assert int(b["counters"][2]) == 0
    replay.check()
    times.sort()
    us = times[len(times) // 2]
    miss_rows = misses / TIMED
    return dict(scenario=scenario, variant=variant, requests=R, us=us,
                misses_per_request=miss_rows / R,
                hit_rate=hits / max(1, hits + misses),
                miss_gb_s=miss_rows * ROW / (us * 1e-6) / 1e9 if miss_rows else None)


def dma_ceiling_gb_s(host: torch.Tensor, nbytes: int) -> float:
    """GB/s of one ``cudaMemcpyAsync`` of ``nbytes`` contiguous pinned bytes to the GPU (timed
    as the resolver is, in a CUDA graph): the link's bulk rate, which the miss gather's
    scattered SM loads of host rows are read against."""
    src = host.view(-1)[:nbytes]
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return nbytes / timeit_graph(lambda: dst.copy_(src, non_blocking=True)) / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=42)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--splits", default="16,1")
    p.add_argument("--scenarios", default="steady,cold2,mixed,resident,leased")
    p.add_argument("--configs", default="", help="BLOCK_H:WARPS,... resolver configs to try")
    p.add_argument("--baseline", default=None, help="another _resolve_triton.py to time")
    p.add_argument("--policy", default="lru", help="lru or score+prefetch (class Policy)")
    p.add_argument("--out", default=None, help="JSON file")
    a = p.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    table = topk_table("synthetic:0.8", 1, a.context, WARM + TIMED, K)
    policy = Policy(a.policy, table)
    variants = [(f"split {n}", resolve_rows_triton, {"split": int(n)})
                for n in a.splits.split(",")]
    for cfg in filter(None, a.configs.split(",")):
        bh, nw = (int(x) for x in cfg.split(":"))
        variants.append((f"h{bh} w{nw}", resolve_rows_triton,
                         {"split": 16, "block_h": bh, "num_warps": nw}))
    if a.baseline:
        variants.insert(0, ("baseline", load_baseline(a.baseline), {}))
    ref = "baseline" if a.baseline else "split 1"
    # the pinned pool (contents do not matter for the timing), shared by every run
    host = torch.empty((a.requests * pages(a.context) * BS, ROW), dtype=torch.uint8,
                       pin_memory=True)
    # the bytes of a steady step's misses (~190 rows a request), contiguous
    ceiling = dma_ceiling_gb_s(host, min(host.numel(), a.requests * 192 * ROW))
    print(f"pinned -> GPU cudaMemcpyAsync, contiguous, a step's miss bytes: {ceiling:.1f} GB/s",
          flush=True)
    res = [dict(scenario="dma_ceiling", requests=a.requests, gb_s=ceiling)]
    for scenario in a.scenarios.split(","):
        rows = []
        for name, fn, kw in variants:
            r = run(a.requests, a.context, scenario, name, fn, kw, table, host, policy)
            r["policy"] = a.policy
            rows.append(r)
            print(f"{scenario:<9} {name:<9}: {r['us']:8.1f} us per layer call, "
                  f"{r['misses_per_request']:6.1f} misses per request (hit rate "
                  f"{r['hit_rate']:.3f})"
                  + (f", {r['miss_gb_s']:.1f} GB/s of missed rows" if r["miss_gb_s"] else ""),
                  flush=True)
        base = [r for r in rows if r["variant"] == ref]
        for r in rows:
            if base and r is not base[0]:
                print(f"{scenario:<9} {r['variant']} / {ref}: {r['us'] / base[0]['us']:.2f}x "
                      f"time", flush=True)
        res += rows
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
