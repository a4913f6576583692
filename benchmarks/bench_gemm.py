"""FP8 block linears at decode sizes (issue 25 item 2): the split-K kernel (``backend="triton"``)
against the stream kernel it replaces (``triton_stream``) and bf16 ``torch.mm``, per linear of
one TP-8 rank of DeepSeek-V3.2 and M in 1..512, with a small launch sweep of the new kernel.

Usage (repository root, CUDA; ~60 s on an H200, most of it compiling):
    PYTHONPATH=. python benchmarks/bench_gemm.py --out bench_gemm.json
        [--ops q_a,kv_a,...] [--batches 1,8,16,24,32,48,64,128,256,512] [--chunks-sweep]
        [--jobs 8]   # processes that compile every kernel first (Triton's disk cache)
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_gemm.py --smoke   # CPU: code paths

Columns: ``default`` the new kernel's default launch for M (µs); ``best`` the fastest launch
of the sweep (``_gemm_splitk_triton.splitk_configs``; every launch gives the same bits) and its
fraction of the read-only HBM bandwidth measured in the same run (weight + activation + output
bytes / time); ``stream`` the old kernel's default (µs); ``bf16`` ``torch.mm`` of the same
shape (twice the weight bytes); ``x old`` = stream / best. Times are per call from CUDA graphs
(``bench_ops.timeit_graph``) of back-to-back calls that rotate through weight copies larger
than L2 (every call reads HBM, as the engine's 61 layers do). The footer estimates one decode
step's linears (61 attention layers, 3 dense MLPs) at each M, new best vs old (and, with every
separate linear in ``--ops``, the same step unstacked), and prints the
``SPLITK_TABLE`` entries of the best launches, ready to paste. ``S/G``: the plan's chunk and
group counts (the numerics: per linear, never per M). ``--chunks-sweep``: for each linear also
the default launch at half and twice the default chunk count at M = 1, 24, 64, 256 (``S n:µs``
after the row; ``SPLITK_PLANS`` material: chosen per linear over all M).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_ops import timeit_graph  # noqa: E402  (the same graph-replay timer)

from hisparse.ops import _gemm_splitk_triton as G  # noqa: E402
from hisparse.ops import switches  # noqa: E402
from hisparse.ops.gemm import fp8_block_linear, quantize_fp8_weight  # noqa: E402

# name: (N, K, launches per decode step) of one TP-8 rank of DeepSeek-V3.2 (61 layers, the
# first 3 dense; the shared expert runs inside the fused MoE layer, so it is not counted). The
# model stacks the linears that share an input (``DSAForCausalLM.stack_projections_``): the
# step runs ``stack.x`` = [q_a | idx.wk | kv_a], ``stack.q`` = [q_b | idx.wq_b] and
# ``dense.gate_up``; the separate linears (0 launches) are kept for the comparison.
RANK_LINEARS = {
    "stack.x": (2240, 7168, 61), "stack.q": (11264, 1536, 61), "o_proj": (7168, 2048, 61),
    "dense.gate_up": (4608, 7168, 3), "dense.down": (7168, 2304, 3),
    "q_a": (1536, 7168, 0), "kv_a": (576, 7168, 0), "q_b": (3072, 1536, 0),
    "idx.wq_b": (8192, 1536, 0), "idx.wk": (128, 7168, 0), "dense.gate": (2304, 7168, 0),
    "shared.gate_up": (512, 7168, 0), "shared.down": (7168, 256, 0),
}
# the same step's launches before the stacking (the footer's "unstacked" column)
UNSTACKED = {"q_a": 61, "kv_a": 61, "q_b": 61, "idx.wq_b": 61, "idx.wk": 61, "o_proj": 61,
             "dense.gate": 6, "dense.down": 3}
SMOKE_LINEARS = {"tiny": (96, 512, 1)}
BATCHES = (1, 8, 16, 24, 32, 48, 64, 128, 256, 512)
CHUNK_SWEEP_MS = (1, 24, 64, 256)  # --chunks-sweep: the M it times other plans at
DEVICE = "cuda"


def read_bandwidth() -> float:
    """Read-only HBM bytes/s: a bf16 sum over 2 GiB (what a weight-streaming GEMM does)."""
    buf = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    t = timeit_graph(lambda: buf.sum(dtype=torch.float32), calls=5, reps=5)
    return 2 * buf.numel() / t


def _rotating(fn, pool):
    state = {"i": 0}

    def call():
        fn(pool[state["i"] % len(pool)])
        state["i"] += 1
    return call


def _time(fn, pool) -> float:
    if DEVICE != "cuda":  # --smoke: the code paths, not a measurement
        t = time.perf_counter()
        fn(pool[0])
        return time.perf_counter() - t
    return timeit_graph(_rotating(fn, pool), calls=max(len(pool), 10), reps=5)


def _alt_plans(N: int, K: int) -> list:
    """The other plans ``--chunks-sweep`` times: half and twice the default chunk count."""
    plan = G.splitk_plan(N, K)
    return [G.splitk_plan(N, K, chunks=s, groups=plan.groups)
            for s in sorted({max(1, plan.chunks // 2), 2 * plan.chunks})]


def _launch_keys(ops, batches, chunks_sweep: bool = False) -> list[tuple]:
    """One ``(linear, M, launch, chunks)`` per distinct compiled kernel the run needs
    (``"stream"``: the old kernel's default launch for that M; ``chunks``: the plan's when not
    the default): what :func:`precompile` spreads over processes."""
    from hisparse.ops import _gemm_triton as old

    seen: dict[tuple, tuple] = {}

    def add(name, M, cfg, plan, chunks):
        parts = {"chunk": plan.chunks, "group": plan.groups, "all": 1}[cfg.level]
        red = (parts, plan.group if cfg.level == "chunk" else 1) if parts > 1 else None
        launch = str(cfg) if parts > 1 else str(cfg).replace(f"/{cfg.level}/", "/all/")
        seen.setdefault((launch, red), (name, M, str(cfg), chunks))

    for name in ops:
        N, K, _ = RANK_LINEARS[name]
        plan = G.splitk_plan(N, K)
        sms = old._num_sms(torch.device(DEVICE))
        S = old.stream_chunks(N, K, 128, sms)
        for M in batches:
            seen.setdefault(("stream", old.stream_config(M, N, K, S, sms), S > 1),
                            (name, M, "stream", None))
            for cfg in dict.fromkeys([G.splitk_config(M, N, K, plan)] + G.splitk_configs(M)):
                add(name, M, cfg, plan, None)
            if chunks_sweep and M in CHUNK_SWEEP_MS:
                for alt in _alt_plans(N, K):
                    add(name, M, G.splitk_config(M, N, K, alt), alt, alt.chunks)
    return list(seen.values())


def _compile(items: list[tuple]) -> None:
    """Run each launch once (a worker process of :func:`precompile`: fills Triton's disk cache)."""
    for name, M, cfg, chunks in items:
        N, K, _ = RANK_LINEARS[name]
        try:
            wq, ws = quantize_fp8_weight(torch.randn(N, K, device="cuda") * 0.02)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            if cfg == "stream":
                fp8_block_linear(x, wq, ws, backend="triton_stream")
            else:
                plan = G.splitk_plan(N, K)
                plan = G.splitk_plan(N, K, chunks=chunks, groups=plan.groups) if chunks else plan
                G.fp8_block_linear_splitk(x, wq, ws, (128, 128), torch.bfloat16,
                                          config=G.SplitKConfig.parse(cfg), plan=plan)
        except Exception:  # noqa: BLE001, S112 - the timed run reports it
            continue
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def precompile(ops, batches, jobs: int, chunks_sweep: bool) -> None:
    """Compile every kernel of the run in ``jobs`` processes first (Triton compiles one kernel at
    a time per process; the timed run then loads them from the disk cache)."""
    import concurrent.futures
    import multiprocessing

    keys = _launch_keys(ops, batches, chunks_sweep)
    shares = [keys[i::jobs] for i in range(jobs)]
    t = time.time()
    try:
        with concurrent.futures.ProcessPoolExecutor(
                jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_compile, [sh for sh in shares if sh]))
    except Exception as e:  # noqa: BLE001 - only a speed-up: the timed run compiles instead
        print(f"precompile failed ({type(e).__name__}: {e}); compiling as timed", flush=True)
        return
    print(f"compiled {len(keys)} launches in {jobs} processes: {time.time() - t:.0f} s",
          flush=True)


def bench(ops, batches, chunks_sweep: bool, bw: float) -> list[dict]:
    l2 = (getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
          if DEVICE == "cuda" else 0)
    rows = []
    for name in ops:
        N, K, _ = RANK_LINEARS[name]
        wq, ws = quantize_fp8_weight(torch.randn(N, K, device=DEVICE) * 0.02)
        copies = max(2, math.ceil(3 * l2 / (N * K)))
        fp8 = [(wq.clone(), ws.clone()) for _ in range(copies)]
        bf16 = [wq.to(torch.bfloat16) for _ in range(max(2, copies // 2))]
        plan = G.splitk_plan(N, K)
        for M in batches:
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
            byts = N * K + M * K * 2 + M * N * 2
            row = {"op": name, "N": N, "K": K, "M": M, "chunks": plan.chunks,
                   "groups": plan.groups, "configs": {}}
            default = G.splitk_config(M, N, K, plan)
            row["default"] = str(default)
            for cfg in dict.fromkeys([default] + G.splitk_configs(M)):
                try:
                    t = _time(lambda p, c=cfg, x=x: G.fp8_block_linear_splitk(
                        x, p[0], p[1], (128, 128), torch.bfloat16, config=c), fp8)
                except Exception as e:  # noqa: BLE001 - a launch that does not build is data
                    row["configs"][str(cfg)] = {"error": f"{type(e).__name__}: {e}"[:200]}
                    continue
                row["configs"][str(cfg)] = {"us": t * 1e6, "frac_read_bw": byts / t / bw}
            row["stream_us"] = 1e6 * _time(lambda p, x=x: fp8_block_linear(
                x, p[0], p[1], backend="triton_stream"), fp8)
            row["bf16_us"] = 1e6 * _time(lambda p, x=x: torch.mm(x, p.t()), bf16)
            if chunks_sweep and M in CHUNK_SWEEP_MS:
                row["chunks_sweep"] = {}
                for alt in _alt_plans(N, K):
                    c = G.splitk_config(M, N, K, alt)
                    row["chunks_sweep"][alt.chunks] = 1e6 * _time(
                        lambda p, c=c, alt=alt, x=x: G.fp8_block_linear_splitk(
                            x, p[0], p[1], (128, 128), torch.bfloat16, config=c, plan=alt), fp8)
            rows.append(row)
            print_row(row, header=len(rows) == 1)
        del fp8, bf16
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def best(row: dict) -> tuple[str, float]:
    ok = {k: v["us"] for k, v in row["configs"].items() if "us" in v}
    k = min(ok, key=ok.get)
    return k, ok[k]


def print_row(r: dict, header: bool) -> None:
    if header:
        print(f"\n{'linear':>14} {'N x K':>11} {'M':>4} S/G  | {'default':>7} | {'best':>7} "
              f"{'frac':>5} {'(launch)':<28} | {'stream':>7} | {'bf16':>6} | x old", flush=True)
    k, t = best(r)
    d = r["configs"].get(r["default"], {}).get("us", float("nan"))
    frac = r["configs"][k]["frac_read_bw"]
    extra = ""
    if "chunks_sweep" in r:
        extra = "  S " + " ".join(f"{s}:{v:.1f}" for s, v in r["chunks_sweep"].items())
    sg = f"{r['chunks']}/{r['groups']}"
    print(f"{r['op']:>14} {r['N']:>5}x{r['K']:<5} {r['M']:>4} {sg:<5}| {d:7.1f} | "
          f"{t:7.1f} {frac:5.2f} {k:<28} | {r['stream_us']:7.1f} | {r['bf16_us']:6.1f} | "
          f"{r['stream_us'] / t:4.2f}x{extra}", flush=True)


def print_footer(rows: list[dict]) -> None:
    print("\nPer decode step (61 attention layers, 3 dense MLPs), µs of FP8 linears:")
    for M in dict.fromkeys(r["M"] for r in rows):
        mine = [r for r in rows if r["M"] == M]
        new = sum(best(r)[1] * RANK_LINEARS[r["op"]][2] for r in mine)
        dflt = sum(r["configs"][r["default"]].get("us", math.nan) * RANK_LINEARS[r["op"]][2]
                   for r in mine)
        old = sum(r["stream_us"] * RANK_LINEARS[r["op"]][2] for r in mine)
        bf = sum(r["bf16_us"] * RANK_LINEARS[r["op"]][2] for r in mine)
        unst = ""
        if all(any(r["op"] == op for r in mine) for op in UNSTACKED):
            us = sum(best(r)[1] * UNSTACKED.get(r["op"], 0) for r in mine)
            unst = f"  unstacked best {us:8.0f}"
        print(f"  M={M:>4}: new best {new:8.0f}  new default {dflt:8.0f}  stream {old:8.0f}  "
              f"bf16 {bf:8.0f}{unst}")
    print("\nSPLITK_TABLE = {  # (N, K, m_bucket): launch, from this run")
    for r in rows:
        c = G.SplitKConfig.parse(best(r)[0])
        print(f"    ({r['N']}, {r['K']}, {G.m_bucket(r['M'])}): SplitKConfig({c.block_t}, "
              f"{c.block_n}, {c.num_warps}, {c.num_stages}, {c.level!r}, {c.quant!r}),")
    print("}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="", help="JSON results path")
    p.add_argument("--ops", default="", help=f"comma-separated subset of {list(RANK_LINEARS)}")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--chunks-sweep", action="store_true",
                   help="also time half and twice the default chunk count per linear")
    p.add_argument("--jobs", type=int, default=min(8, (os.cpu_count() or 2) // 2),
                   help="processes that compile the kernels first (0: compile as timed)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU (TRITON_INTERPRET=1): checks the code paths")
    a = p.parse_args(argv)
    global DEVICE
    if a.smoke:
        DEVICE = "cpu"
        os.environ["HISPARSE_FORCE_TRITON"] = "1"      # the compile jobs' too
        switches.reload()
        RANK_LINEARS.update(SMOKE_LINEARS)
        a.ops, a.batches = a.ops or "tiny", "1,16,80"
    elif not torch.cuda.is_available():
        raise SystemExit("bench_gemm.py needs CUDA (or --smoke)")
    ops = [o for o in a.ops.split(",") if o] or list(RANK_LINEARS)
    bad = [o for o in ops if o not in RANK_LINEARS]
    if bad:
        raise SystemExit(f"--ops: unknown {bad}; known: {list(RANK_LINEARS)}")
    t0 = time.time()
    batches = [int(b) for b in a.batches.split(",")]
    if DEVICE == "cuda" and a.jobs > 0:
        precompile(ops, batches, a.jobs, a.chunks_sweep)
    bw = read_bandwidth() if DEVICE == "cuda" else 1e12
    print(f"read-only HBM bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    rows = bench(ops, batches, a.chunks_sweep, bw)
    print_footer(rows)
    print(f"\n({time.time() - t0:.0f} s)")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
                       "read_bw_bytes_s": bw,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
