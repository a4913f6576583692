"""What ``hisparse bench`` reports from its measured points: the points' table, device ms by
kernel class, step times against the all-hit baseline, issue 24's per-request efficiency, and
the plot. Pure functions of :class:`Point` lists (no device, no engine)."""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass

ALL_HIT = "synthetic:1.0"     # the all-hit baseline source of the ratio table


@dataclass
class Point:
    """One measured point of ``hisparse bench``: a mode at a context and concurrency (one JSON
    object of ``bench_decode.json``). ``running_reached``: the most requests decoding together;
    the steady figures are over the decode steps at that count."""

    mode: str
    topk_source: str
    context: int
    concurrency: int
    outputs: int
    decode_tok_s: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    running_reached: int
    hot_hit_rate: float
    h2d_gb_s: float
    gpu_mem_gib: float
    host_pool_gib: float
    num_preempted: int
    spilled_pages: int
    wall_s: float
    steady_tok_s: float = float("nan")       # decode tok/s of those steps (running / wall)
    wall_ms_per_step: float = float("nan")   # pure decode steps at full concurrency
    gpu_ms_per_step: float = float("nan")    # CUDA events around each such step
    planned_max_running: int = 0             # the capacity planner's prediction
    planned_bound_by: str = ""
    planned_tok_s: float = float("nan")      # roofline: HBM and PCIe bytes per step
    planned_gpu_held: int = 0                # of planned_max_running: GPU-held (hisparse)
    gpu_kv_bytes: int = 0                    # the GPU KV budget the engine split (0: not split)
    hot_policy: str = "lru"                  # hot-buffer replacement (HiSparse modes)
    hot_demand_misses: int = 0               # rows a step waited for
    hot_prefetched: int = 0                  # band rows copied ahead (score+prefetch)
    hot_prefetch_hits: int = 0               # prefetched rows later selected
    # --profile-kernels: device ms per step by kernel class (hisparse.bench.kernels), kernels
    # per step and per decoder layer, the costliest kernels; every kernel as [name, ms per step,
    # launches per step]
    kernel_ms: dict | None = None
    kernels_per_layer: float = float("nan")
    top_kernels: list | None = None
    by_kernel: list | None = None


def print_kernel_table(points: list[Point]) -> None:
    """Device ms per decode step by kernel class, one column per profiled point."""
    from hisparse.bench.kernels import KERNEL_CLASSES, OTHER

    prof = [pt for pt in points if pt.kernel_ms]
    if not prof:
        return
    print("kernel class | " + " | ".join(
        f"{pt.mode} {pt.hot_policy} {pt.context // 1024}k x {pt.running_reached}" for pt in prof))
    for cls in ["all"] + [c for c, _ in KERNEL_CLASSES] + [OTHER]:
        print(f"{cls} | " + " | ".join(f"{pt.kernel_ms.get(cls, 0.0):.2f}" for pt in prof))
    print("kernels per layer | " + " | ".join(f"{pt.kernels_per_layer:.1f}" for pt in prof))
    for pt in prof:    # ms a step and launches a step
        print(f"top kernels, {pt.mode} {pt.context // 1024}k x {pt.running_reached}: " + "; ".join(
            f"{name[:60]} {ms:.2f} ({n:.0f}x)" for name, ms, n in pt.by_kernel[:10]))


def print_table(points: list[Point]) -> None:
    cols = ["mode", "hot_policy", "topk_source", "context", "concurrency", "decode_tok_s",
            "steady_tok_s", "tpot_p50_ms",
            "tpot_p99_ms", "wall_ms_per_step", "gpu_ms_per_step", "running_reached",
            "planned_max_running", "planned_bound_by", "planned_tok_s", "hot_hit_rate", "h2d_gb_s",
            "hot_demand_misses", "hot_prefetched", "hot_prefetch_hits", "num_preempted"]
    print(" | ".join(cols))
    for pt in points:
        d = asdict(pt)
        print(" | ".join(f"{d[c]:.3g}" if isinstance(d[c], float) else str(d[c]) for c in cols))


def ratio_rows(points: list[Point], baseline: str = ALL_HIT) -> list[dict]:
    """Every point that has an all-hit baseline (the ``lru`` point of source ``baseline`` at
    the same mode, context and concurrency, itself included): its hit and prefetch counters,
    steady-state wall and GPU ms per decode step, and both as ratios to the baseline's."""
    base = {(p.mode, p.context, p.concurrency): p for p in points
            if p.topk_source == baseline and p.hot_policy == "lru"}
    rows = []
    for p in points:
        b = base.get((p.mode, p.context, p.concurrency))
        if b is None:
            continue
        rows.append(dict(
            mode=p.mode, source=os.path.basename(p.topk_source), policy=p.hot_policy,
            context=p.context, concurrency=p.concurrency, hit_rate=p.hot_hit_rate,
            demand_misses=p.hot_demand_misses, prefetched=p.hot_prefetched,
            prefetch_hits=p.hot_prefetch_hits, wall_ms=p.wall_ms_per_step,
            gpu_ms=p.gpu_ms_per_step, wall_x=p.wall_ms_per_step / b.wall_ms_per_step,
            gpu_x=p.gpu_ms_per_step / b.gpu_ms_per_step))
    return rows


def print_ratio_table(points: list[Point], baseline: str = ALL_HIT) -> None:
    rows = ratio_rows(points, baseline)
    if not rows:
        return
    print(f"step time vs the all-hit baseline ({baseline}, lru) of the same mode, context and "
          f"concurrency:")
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()))


def efficiency_rows(points: list[Point]) -> list[dict]:
    """Issue 24's per-request efficiency of every HiSparse-mode point (hisparse, always-host)
    against the GPU-only point of the same context, top-k source and hot policy ``lru`` with
    the most running requests below its own (none: no row):

    - ``efficiency``: (steady tok/s ratio) / (running ratio), the issue's figure;
    - where GPU-only ran at two or more running counts, its steps fitted as ``F + c * n`` (wall
      ms, least squares) give ``ceiling``, the figure a HiSparse step on GPU-only's own line
      would reach, ``(F + c * n_g) / (F + c * n_h)``: below 1 whenever ``F > 0``, so a fixed
      cost that shrinks lowers the figure with no per-request cost changed; ``vs_line``, the
      tok/s against that line at HiSparse's count (1: an extra request costs HiSparse what it
      costs GPU-only); and the ms per extra request, HiSparse's from GPU-only's point to its
      own against GPU-only's ``c``. ``nan`` where there is no fit.
    """
    nan = float("nan")
    rows = []
    for h in points:
        if h.mode == "gpu-only":
            continue
        same = [g for g in points if g.mode == "gpu-only" and g.context == h.context
                and g.topk_source == h.topk_source and g.hot_policy == "lru"
                and not math.isnan(g.steady_tok_s)]
        below = [g for g in same if g.running_reached < h.running_reached]
        if not below:
            continue
        g = max(below, key=lambda x: (x.running_reached, x.concurrency))
        n_g, n_h = g.running_reached, h.running_reached
        fit = {}
        for x in sorted(same, key=lambda x: x.concurrency):   # per running count: the point
            fit[x.running_reached] = x.wall_ms_per_step        # of the largest concurrency
        f = c = nan
        if len(fit) >= 2:   # least squares
            c, f = statistics.linear_regression(list(fit), list(fit.values()))
        rows.append(dict(
            mode=h.mode, policy=h.hot_policy, context=h.context,
            running=n_h, gpu_only_running=n_g,
            efficiency=(h.steady_tok_s / g.steady_tok_s) / (n_h / n_g),
            fixed_ms=f, ms_per_request=c,
            ceiling=(f + c * n_g) / (f + c * n_h),
            vs_line=(f + c * n_h) / h.wall_ms_per_step,
            extra_ms_per_request=(h.wall_ms_per_step - g.wall_ms_per_step) / (n_h - n_g)))
    return rows


def print_efficiency_table(points: list[Point]) -> None:
    rows = efficiency_rows(points)
    if not rows:
        return
    print("per-request efficiency (issue 24) against GPU-only's most running; ceiling: the figure "
          "at GPU-only's own per-request cost (fixed_ms + ms_per_request * n, fitted over its "
          "points); vs_line: tok/s against that line at the same running count:")
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()))


def plot_series(points: list[Point]) -> list[tuple[str, list[int], list[float]]]:
    """The plot's lines: per mode, context and top-k source, (label, concurrencies ascending,
    decode tok/s); a single concurrency is a line of one point (drawn as its marker)."""
    series = []
    for mode in ("gpu-only", "hisparse", "always-host"):
        for context in sorted({p.context for p in points}):
            for source in sorted({p.topk_source for p in points}):
                pts = sorted((p for p in points if p.mode == mode and p.context == context
                              and p.topk_source == source), key=lambda p: p.concurrency)
                if pts:
                    series.append((f"{mode} {context // 1024}k {os.path.basename(source)}",
                                   [p.concurrency for p in pts], [p.decode_tok_s for p in pts]))
    return series


def plot(points: list[Point], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, xs, ys in plot_series(points):
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("concurrent requests submitted")
    ax.set_ylabel("decode tokens/s")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def load_points(paths: list[str]) -> list[Point]:
    """The points of ``hisparse bench`` JSON files (``bench_decode.json``), in file order."""
    points = []
    for path in paths:
        with open(path) as f:
            points += [Point(**d) for d in json.load(f)]
    return points


def main(argv: list[str] | None = None) -> int:
    """``python -m hisparse.bench.report A/bench_decode.json B/bench_decode.json ...``: the
    tables of several runs' points together, e.g. issue 24's efficiency of a HiSparse run
    against a GPU-only run given more memory."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m hisparse.bench.report", description=main.__doc__)
    p.add_argument("paths", nargs="+", help="bench_decode.json files")
    points = load_points(p.parse_args(argv).paths)
    print_table(points)
    print_ratio_table(points)
    print_efficiency_table(points)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
